# The gpufrac image: one binary (scheduler, webhook, node agent, hook) and
# the nvidia-smi view library, as the Helm chart (deploy/helm/gpufrac)
# expects them:
#   /usr/local/bin/gpufrac
#   /usr/local/lib/gpufrac/libnvidia-ml.so.1
# and a shell for the node agent's init container, which copies both to the
# host. go-nvml needs cgo (it loads libnvidia-ml at run time), hence glibc.
#
#   docker build -t ghcr.io/gpufrac/gpufrac:0.1.0 .
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ENV CGO_ENABLED=1 CGO_CFLAGS="-O2 -g -Wno-deprecated-declarations"
RUN go build -trimpath -o /out/gpufrac ./cmd/gpufrac && go run ./shim/cmd/build-shim /out/shim

FROM debian:bookworm-slim
COPY --from=build /out/gpufrac /usr/local/bin/gpufrac
COPY --from=build /out/shim/libnvidia-ml.so.1 /usr/local/lib/gpufrac/libnvidia-ml.so.1
# The scheduler and webhook run as this user (the chart sets it too); the
# node agent runs as root for the runtime's and kubelet's sockets.
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/gpufrac"]
