# gpufrac — build, test and demo. `make help` lists the targets.

GO      ?= go
BIN     := $(CURDIR)/bin
TOOLS   := $(CURDIR)/hack/tools
GOLANGCI_LINT := $(BIN)/golangci-lint
BENCHSTAT     := $(BIN)/benchstat
# The real control plane (kube-apiserver, kube-controller-manager, etcd), KWOK (the local cluster's
# fake kubelets), kubectl and Helm are built from source as tools of this
# module (go.mod's tool block), so they and bin/gpufrac share one module
# graph and Go compiles the Kubernetes packages they have in common once.
KUBE_BIN      := $(BIN)/kube
KUBE_STAMP    := $(KUBE_BIN)/.built
KUBECTL       := $(KUBE_BIN)/kubectl
KUBE_VERSION  := v1.37.2
KUBE_LDFLAGS  := -X k8s.io/component-base/version.gitVersion=$(KUBE_VERSION) \
                 -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=37 \
                 -X k8s.io/component-base/version.gitTreeState=clean
export KUBEBUILDER_ASSETS := $(KUBE_BIN)
KWOK          := $(BIN)/kwok
HELM          := $(BIN)/helm
CHART         := deploy/helm/gpufrac
# go-nvml needs cgo; its header marks calls deprecated that it still wraps.
export CGO_ENABLED := 1
export CGO_CFLAGS  := -O2 -g -Wno-deprecated-declarations
FUZZTIME ?= 5m
# $(,) is a comma inside $(call ...)'s arguments.
, := ,

.DEFAULT_GOAL := help

.PHONY: help
help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-12s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

# Before a step that can take minutes, a line says what it builds and what
# that costs the first time; later runs reuse Go's caches and bin/.
announce = @printf '==> %s\n' $(1)
# While a long step runs, a line every 30 s says how long so far and what Go
# is compiling (PROGRESS_INTERVAL=seconds to change it).
PROGRESS = hack/progress.sh

.PHONY: preflight
preflight: ## check the Go version and cgo's C compiler before anything long starts
	@hack/preflight.sh

.PHONY: build
build: preflight ## build bin/gpufrac
	$(call announce,"bin/gpufrac: gpufrac with kube-scheduler$(,) client-go$(,) controller-runtime and go-nvml (first time: 5 to 9 min on 2 cores$(,) module download included; seconds once cached)")
	$(PROGRESS) bin/gpufrac $(GO) build -o $(BIN)/gpufrac ./cmd/gpufrac

.PHONY: shim
shim: ## build the nvidia-smi view library (bin/shim/libnvidia-ml.so.1) for fractional containers
	$(GO) run ./shim/cmd/build-shim $(BIN)/shim

.PHONY: image
# The image without a container engine: an OCI layout and its archive,
# from this commit (hack/node/gpufracimage; the chart README says how to
# push or import it). Reproducible: `make image-check` builds it twice.
APP_VERSION := $(shell sed -n 's/^appVersion: *"*\([^"]*\)"*$$/\1/p' $(CHART)/Chart.yaml)
IMAGE_REF   ?= ghcr.io/gpufrac/gpufrac:$(APP_VERSION)
IMAGE_DIR   ?= $(BIN)/image
image: preflight ## build gpufrac's image (amd64) as an OCI layout and archive in bin/image, without a container engine
	$(call announce,"$(IMAGE_REF): gpufrac$(,) its view library and the C library$(,) as an OCI archive (first time: about 8.5 min on 2 cores$(,) a -trimpath build of every package; then seconds)")
	rm -rf $(IMAGE_DIR)/build && mkdir -p $(IMAGE_DIR)/build
	$(PROGRESS) "the image's gpufrac" $(GO) build -trimpath -ldflags='-s -w -buildid=' -o $(IMAGE_DIR)/build/gpufrac ./cmd/gpufrac
	$(GO) run ./shim/cmd/build-shim $(IMAGE_DIR)/build/shim >/dev/null
	cd hack/node && $(GO) build -o $(NODE_BIN)/gpufracimage ./gpufracimage
	$(NODE_BIN)/gpufracimage -binary $(IMAGE_DIR)/build/gpufrac -library $(IMAGE_DIR)/build/shim/libnvidia-ml.so.1 \
	  -ref $(IMAGE_REF) -revision "$$(git rev-parse HEAD)$$(git diff --quiet HEAD -- . || echo -dirty)" \
	  -created "$$(git log -1 --format=%ct)" -out $(IMAGE_DIR) >$(IMAGE_DIR)/digest
	@printf '%s %s (%s)\n' "$(IMAGE_REF)" "$$(cat $(IMAGE_DIR)/digest)" "$$(du -h $(IMAGE_DIR)/gpufrac.oci.tar | cut -f1)"

.PHONY: image-check
image-check: ## build the image twice from scratch: the digests must be equal
	$(MAKE) --no-print-directory image IMAGE_DIR=$(BIN)/image-check
	$(MAKE) --no-print-directory image
	@a=$$(cat $(BIN)/image-check/digest); b=$$(cat $(IMAGE_DIR)/digest); rm -rf $(BIN)/image-check; \
	if [ "$$a" != "$$b" ]; then echo "image-check: two builds of one commit gave $$a and $$b: the image is not reproducible"; exit 1; fi; \
	echo "image-check: two builds, one digest $$a"

.PHONY: gpu-proof-pack
# What hack/gpu-proof.sh needs on a GPU machine without Go, small enough to
# travel (the device tool carries 64 MiB): gpufrac stripped and gzipped,
# the view library, the probe; run it there with build/gpu-proof carried.
gpu-proof-pack: preflight ## build build/gpu-proof for hack/gpu-proof.sh on a GPU machine without Go (docs/gpu-proof/README.md)
	rm -rf build/gpu-proof && mkdir -p build/gpu-proof
	$(GO) build -trimpath -ldflags='-s -w' -o build/gpu-proof/gpufrac ./cmd/gpufrac
	gzip -9 build/gpu-proof/gpufrac
	$(GO) run ./shim/cmd/build-shim build/gpu-proof/shim
	$${CC:-cc} -std=c11 -D_POSIX_C_SOURCE=200809L -O2 -o build/gpu-proof/probe hack/gpu-proof/csrc/probe.c -ldl
	git rev-parse HEAD >build/gpu-proof/commit
	@du -sh build/gpu-proof

.PHONY: demo
# DEMO_FLAGS=--keep stays up afterwards, with the dashboard's URL printed.
DEMO_FLAGS ?=
demo: build $(KUBE_STAMP) $(KWOK) ## the main job: a local GPU-fraction cluster places examples/, shows every GPU, refuses a bad pod, stops (DEMO_FLAGS=--keep: stays up, with the dashboard)
	$(BIN)/gpufrac up --demo $(DEMO_FLAGS)

.PHONY: test
test: preflight verify unit node-e2e image-check chart-e2e soak-ci ## the whole suite: formatting, vet, lint, every test, the real node, the image built twice, the chart on the real node, a short soak

.PHONY: unit
# The trace replays (fidelity to the published study, our policy's margin)
# are pure single-goroutine computation: they run without the race detector,
# which would make them ten times slower.
TRACE_TESTS := ^(TestFidelityToThePublishedStudy|TestQualityOurPolicyBeatsFGD)$$

unit: $(KUBE_STAMP) $(KWOK) $(KUBECTL) $(HELM) chromium ## every test: with the race detector, then the trace replays without it
	$(call announce,"go test -race ./...: compiles every package again with the race detector (first time: 7 to 12 min)$(,) then runs the suite (about 7 min)")
	$(PROGRESS) "go test -race" $(GO) test -race -count=1 -skip '$(TRACE_TESTS)' ./...
	$(call announce,"the trace replays against the published study$(,) without the race detector (about 1.5 min)")
	$(GO) test -count=1 -run '$(TRACE_TESTS)' ./pkg/sim

.PHONY: e2e
e2e: $(KUBE_STAMP) $(KWOK) chromium ## end to end on a local cluster (gpufrac up): examples, a forged key, crashes during a burst of 500 (also in make test)
	$(GO) test -count=1 -v ./test/e2e/

# The real node (test/node): containerd, its runc shim and ctr from source
# in a module of their own (hack/node), the kubelet from this module's
# Kubernetes, runc, BusyBox and the CNI plugins from Debian, the fake
# libnvidia-ml.so.1 (C, against go-nvml's copy of nvml.h) and the probe
# image, built without a registry.
NODE_BIN      := $(BIN)/node
NODE_STAMP    := $(NODE_BIN)/.built
KUBELET       := $(KUBE_BIN)/kubelet
FAKE_NVML     := $(NODE_BIN)/lib/libnvidia-ml.so.1
NODE_IMAGES   := $(NODE_BIN)/images.tar
NODE_PACKAGES := runc busybox-static containernetworking-plugins iproute2 iptables

.PHONY: node-e2e
node-e2e: build $(KUBE_STAMP) $(KUBELET) $(NODE_STAMP) $(FAKE_NVML) $(NODE_IMAGES) ## a real node (kubelet, containerd, runc; GPU, driver and MPS stand-ins) joined to gpufrac up: pods started through it (also in make test; root)
	$(call announce,"the real node: kubelet + containerd + runc with the node agent as NRI plugin and the hook under runc$(,) in namespaces of their own (about 2.5 min)")
	$(GO) test -tags nodee2e -count=1 -v -timeout 20m ./test/node/

.PHONY: soak soak-ci
# The soak (test/soak, -tags soak): the local cluster with two scheduler and
# two webhook replicas under a seeded random workload and random faults,
# the invariants checked every 3 s. SOAK_SEED replays a run's choices.
SOAK_SEED     ?= 1
SOAK_DURATION ?= 10m
SOAK_NODES    ?= 4
SOAK_TIMEOUT  ?= 24h
soak: build $(KUBE_STAMP) $(KWOK) ## a seeded soak: load and faults for SOAK_DURATION (default 10m) with SOAK_SEED (default 1); SOAK_REPORT=file keeps the report (docs/development.md)
	$(call announce,"soak: seed $(SOAK_SEED)$(,) $(SOAK_DURATION) of load and faults on $(SOAK_NODES) nodes$(,) then up to 5 min to converge")
	SOAK_SEED=$(SOAK_SEED) SOAK_DURATION=$(SOAK_DURATION) SOAK_NODES=$(SOAK_NODES) SOAK_REPORT=$(SOAK_REPORT) SOAK_BINARY=$(BIN)/gpufrac \
	  $(GO) test -tags soak -count=1 -v -timeout $(SOAK_TIMEOUT) -run '^TestSoak$$' ./test/soak/

soak-ci: ## the short soak make test runs: seed 1, 3 minutes
	$(MAKE) soak SOAK_SEED=1 SOAK_DURATION=3m SOAK_TIMEOUT=20m

.PHONY: chart-e2e
# The same real node with gpufrac as users install it: make image's image
# imported into containerd, helm install of the chart with its defaults,
# every part a real pod; kube-proxy and kube-controller-manager as any
# cluster has them (test/node/chart_test.go, -tags charte2e).
KUBE_PROXY    := $(KUBE_BIN)/kube-proxy
NVIDIA_RUNTIME := $(NODE_BIN)/nvidia-container-runtime
chart-e2e: build image $(KUBE_STAMP) $(KUBELET) $(KUBE_PROXY) $(HELM) $(NODE_STAMP) $(FAKE_NVML) $(NODE_IMAGES) $(NVIDIA_RUNTIME) ## helm install on the real node: the image, every part a real pod, kube-proxy; scenarios, privileges, upgrade, uninstall (also in make test; root)
	$(call announce,"the chart on the real node: helm install of the image$(,) scenarios through it$(,) helm upgrade to another digest$(,) helm uninstall$(,) in the node's own namespaces (about 10 min)")
	@# What helm upgrade moves to: the same build, another revision label,
	@# so another digest, tagged $(IMAGE_REF)-next.
	mkdir -p $(IMAGE_DIR)/next && $(NODE_BIN)/gpufracimage -binary $(IMAGE_DIR)/build/gpufrac -library $(IMAGE_DIR)/build/shim/libnvidia-ml.so.1 \
	  -ref $(IMAGE_REF)-next -revision "$$(git rev-parse HEAD)-next" -created "$$(git log -1 --format=%ct)" -out $(IMAGE_DIR)/next >$(IMAGE_DIR)/next/digest
	$(GO) test -tags charte2e -count=1 -v -timeout 30m ./test/node/

$(KUBE_PROXY): go.mod go.sum | preflight
	$(call announce,"bin/kube/kube-proxy $(KUBE_VERSION) from source (first time: about 1 min after bin/kube; kept until go.mod changes)")
	$(PROGRESS) kube-proxy $(GO) build -ldflags "$(KUBE_LDFLAGS)" -o $@ k8s.io/kubernetes/cmd/kube-proxy
	@touch $@

$(NVIDIA_RUNTIME): test/node/nvidiaruntime/main.go
	CGO_ENABLED=0 $(GO) build -o $@ ./test/node/nvidiaruntime

.PHONY: node-packages
# Debian's packages the real node needs, installed once (root and apt).
node-packages:
	@missing=; for p in $(NODE_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  printf '==> %s\n' "Debian packages for the real node:$$missing (first time: about 30 s)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null || \
	  { echo "installing$$missing failed: install Debian's $(NODE_PACKAGES) by hand (as root)"; exit 1; }; fi

$(KUBELET): go.mod go.sum | preflight
	$(call announce,"bin/kube/kubelet $(KUBE_VERSION) from source (first time: about 1 min after bin/kube; kept until go.mod changes)")
	$(PROGRESS) kubelet $(GO) build -ldflags "$(KUBE_LDFLAGS)" -o $@ k8s.io/kubernetes/cmd/kubelet
	@touch $@

$(NODE_STAMP): hack/node/go.mod hack/node/go.sum hack/node/mkimage/main.go | preflight
	$(call announce,"bin/node: containerd v2.4.2$(,) containerd-shim-runc-v2$(,) ctr and mkimage (hack/node: a module of its own; first time: about 2 min)")
	cd hack/node && ../../$(PROGRESS) bin/node $(GO) build -o $(NODE_BIN)/ tool ./mkimage
	@touch $@

# go list of the package (not -m) downloads go-nvml if it is not yet; cgo's
# C compiler is the one preflight checked.
$(FAKE_NVML): test/node/fakenvml/fakenvml.c go.mod | preflight
	@mkdir -p $(dir $@)
	nvml_h=$$($(GO) list -f '{{.Dir}}' github.com/NVIDIA/go-nvml/pkg/nvml) && \
	  $$($(GO) env CC) -shared -fPIC -O2 -Wall -Wextra -Werror -I"$$nvml_h" -o $@ $< -lpthread

$(NODE_IMAGES): $(NODE_STAMP) test/node/probe/main.go | node-packages
	CGO_ENABLED=0 $(GO) build -o $(NODE_BIN)/probe ./test/node/probe
	$(NODE_BIN)/mkimage "$$(command -v busybox)" $(NODE_BIN)/probe $@

.PHONY: kube-binaries
kube-binaries: $(KUBE_STAMP) ## build kube-apiserver, kube-controller-manager and etcd from source into bin/kube

$(KUBE_STAMP): go.mod go.sum | preflight
	$(call announce,"bin/kube: kube-apiserver$(,) kube-controller-manager $(KUBE_VERSION) and etcd v3.7.0 from source (first time: 4 to 9 min after bin/gpufrac$(,) whose Kubernetes packages they reuse; kept until go.mod changes)")
	$(PROGRESS) bin/kube $(GO) build -ldflags "$(KUBE_LDFLAGS)" -o $(KUBE_BIN)/ k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager go.etcd.io/etcd/server/v3
	mv -f $(KUBE_BIN)/server $(KUBE_BIN)/etcd
	@touch $@

.PHONY: kubectl
kubectl: $(KUBECTL) ## build kubectl from source into bin/kube (for the README's tour; make test builds it too)

$(KUBECTL): go.mod go.sum | preflight
	$(call announce,"bin/kube/kubectl $(KUBE_VERSION) from source (first time: about 30 s after bin/kube; kept until go.mod changes)")
	$(PROGRESS) kubectl $(GO) build -ldflags "$(KUBE_LDFLAGS)" -o $@ k8s.io/kubernetes/cmd/kubectl
	@touch $@

.PHONY: chromium
# The dashboard's browser test drives Debian's Chromium headless. It is a
# system package (apt, as root): installed once, then found on PATH.
chromium: ## install Debian's Chromium for the dashboard's browser test (once; needs root and apt)
	@command -v chromium >/dev/null 2>&1 || { \
	  printf '==> %s\n' "chromium: Debian's package, for the dashboard's browser test (first time: about 1 min)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; }
	@command -v chromium >/dev/null 2>&1 || { echo "chromium is not on PATH after installing it: install Debian's chromium package by hand"; exit 1; }

.PHONY: kwok
kwok: $(KWOK) ## build KWOK (the local cluster's fake kubelets) into bin/

$(KWOK): go.mod go.sum | preflight
	$(call announce,"bin/kwok: KWOK v0.8.0 from source$(,) the local cluster's fake kubelets (first time: about 30 s; kept until go.mod changes)")
	$(GO) build -o $@ sigs.k8s.io/kwok/cmd/kwok
	@touch $@

.PHONY: helm
helm: $(HELM) ## build Helm into bin/ (for the chart's lint and render test)

$(HELM): go.mod go.sum | preflight
	$(call announce,"bin/helm: Helm v3.22.0 from source$(,) for the chart's lint and render test (first time: about 30 s; kept until go.mod changes)")
	$(GO) build -o $@ helm.sh/helm/v3/cmd/helm
	@touch $@

.PHONY: chart-lint
chart-lint: $(HELM) ## helm lint the chart: defaults, cert-manager, no scheduler, dashboard, monitoring (its render tests are in test/chart)
	$(HELM) lint --strict --kube-version $(KUBE_VERSION) $(CHART)
	$(HELM) lint --strict --kube-version $(KUBE_VERSION) $(CHART) --set webhook.certificates.provider=certManager
	$(HELM) lint --strict --kube-version $(KUBE_VERSION) $(CHART) --set scheduler.enabled=false,nodeAgent.restrictToOwnNode=false
	$(HELM) lint --strict --kube-version $(KUBE_VERSION) $(CHART) --set dashboard.enabled=true
	$(HELM) lint --strict --kube-version $(KUBE_VERSION) $(CHART) --set monitoring.grafanaDashboard.enabled=true,monitoring.prometheusRule.enabled=true,monitoring.podMonitor.enabled=true

.PHONY: verify
verify: standalone-check fmt-check vet lint tidy-check chart-lint ## static checks only

.PHONY: standalone-check
# The pattern is spelt so that it does not match this rule itself.
standalone-check: ## no tracked file reads the workspace's shared folder: a clone with nothing beside it must build, test and run
	@if git grep -n -e '\.\./sha[r]ed' -- . ; then \
		echo "standalone-check: the lines above read a folder beside the repository that a clone does not have; use what the repository carries (e.g. traces/)"; exit 1; fi

.PHONY: fmt-check
fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt needed on:"; echo "$$out"; exit 1; fi

.PHONY: vet
vet:
	$(call announce,"go vet ./...: compiles every package and its tests (first time: about 1.5 min after make demo$(,) 10 min with nothing built)")
	$(PROGRESS) "go vet" $(GO) vet -tags nodee2e ./...
	$(GO) vet -tags charte2e ./test/node/...
	$(GO) vet -tags soak ./test/soak/
	cd hack/node && $(GO) vet ./...

.PHONY: lint
lint: $(GOLANGCI_LINT) ## golangci-lint, built from hack/tools at a pinned version
	$(call announce,"golangci-lint run ./... (first time: 1.5 to 4.5 min; its own cache keeps later runs short)")
	$(GOLANGCI_LINT) run ./...
	$(GOLANGCI_LINT) run --build-tags charte2e ./test/node/...
	$(GOLANGCI_LINT) run --build-tags soak ./test/soak/...

.PHONY: tidy-check
tidy-check: ## go.mod and go.sum must already be tidy
	$(GO) mod tidy -diff

.PHONY: fuzz
fuzz: ## fuzz the annotation parser, the manifest, trace and scheduler-args readers, --simulate-gpus, the usage annotation and the cgroup join for FUZZTIME each (default 5m)
	$(GO) test ./pkg/api -run '^$$' -fuzz '^FuzzParse$$' -fuzztime $(FUZZTIME)
	$(GO) test ./pkg/manifest -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime $(FUZZTIME)
	$(GO) test ./pkg/sim -run '^$$' -fuzz '^FuzzLoadPods$$' -fuzztime $(FUZZTIME)
	$(GO) test ./pkg/scheduler -run '^$$' -fuzz '^FuzzDecodeArgs$$' -fuzztime $(FUZZTIME)
	$(GO) test ./pkg/node/inventory -run '^$$' -fuzz '^FuzzSimulated$$' -fuzztime $(FUZZTIME)
	$(GO) test ./pkg/api -run '^$$' -fuzz '^FuzzUsageOf$$' -fuzztime $(FUZZTIME)
	$(GO) test ./pkg/node/usage -run '^$$' -fuzz '^FuzzContainerID$$' -fuzztime $(FUZZTIME)

TRACES ?= $(CURDIR)/traces/alibaba-gpu-v2023

.PHONY: sim
sim: build ## one seed of every policy on the default Alibaba trace (TRACES=dir), with curves and a plot in _output/sim
	$(BIN)/gpufrac sim --nodes $(TRACES)/openb_node_list_gpu_node.csv --pods $(TRACES)/openb_pod_list_default.csv \
		--policy all --seeds 42 --out _output/sim

.PHONY: sim-table
sim-table: build ## docs/placement.md's table: every policy on every trace in TRACES, seeds 42-51 (about 40 min on 2 cores)
	hack/sim-table.sh $(TRACES) _output/sim-table

.PHONY: replay
replay: build $(KUBE_STAMP) $(KWOK) ## live vs simulated placement, paired: a 32-node G2 slice of the default trace, seeds 42-46, gpufrac and fgd (about 30 min)
	$(BIN)/gpufrac replay --nodes $(TRACES)/openb_node_list_gpu_node.csv --pods $(TRACES)/openb_pod_list_default.csv \
		--model G2 --count 32 --seeds 42-46 --policy gpufrac,fgd --out _output/replay

.PHONY: bench
bench: $(BENCHSTAT) ## pure-code benchmarks, 10 runs, summarised by benchstat
	$(GO) test -run '^$$' -bench . -benchmem -count 10 ./pkg/... | tee $(BIN)/bench.txt
	$(BENCHSTAT) $(BIN)/bench.txt

.PHONY: bench-webhook
bench-webhook: $(KUBE_STAMP) ## admission latency: handler ns/op, and p50/p99 of 1,000 pod creates through kube-apiserver
	$(GO) test -run '^$$' -bench 'Validator|Mutator' -benchmem -count 5 ./pkg/admission/
	$(GO) test -run '^$$' -bench PodCreate -benchtime 1x ./test/integration/

.PHONY: bench-scheduler
bench-scheduler: $(KUBE_STAMP) $(BENCHSTAT) ## scheduler: Filter+Score ns/op per node, and pods/s of 2,000 fractional vs 2,000 whole-GPU pods on 1,000 and 5,000 nodes x 8 GPUs
	$(GO) test -run '^$$' -bench FilterScore -benchmem -count 6 ./pkg/scheduler/ | tee $(BIN)/bench-scheduler.txt
	$(GO) test -run '^$$' -bench SchedulerThroughput -benchtime 1x -count 3 -timeout 60m ./test/integration/ | tee -a $(BIN)/bench-scheduler.txt
	$(BENCHSTAT) $(BIN)/bench-scheduler.txt

.PHONY: bench-node
bench-node: build $(KUBE_STAMP) ## node agent: CreateContainer adjustment ns/op, and the agent's RSS with 8 simulated GPUs
	$(GO) test -run '^$$' -bench Adjust -benchmem -count 5 ./pkg/node/injection/
	GPUFRAC_BIN=$(BIN)/gpufrac $(GO) test -run '^$$' -bench NodeAgentRSS -benchtime 1x ./test/integration/

.PHONY: tools
tools: $(GOLANGCI_LINT) $(BENCHSTAT) ## build the pinned developer tools into bin/

$(GOLANGCI_LINT) $(BENCHSTAT): $(TOOLS)/go.mod $(TOOLS)/go.sum | preflight
	$(call announce,"bin/golangci-lint and bin/benchstat at pinned versions (hack/tools: a module of its own$(,) its dependencies are far from ours; first time: 2 to 4 min)")
	cd $(TOOLS) && $(GO) build -o $(BIN)/ tool
	@touch $(GOLANGCI_LINT) $(BENCHSTAT)

.PHONY: clean
clean: ## remove build outputs (keeps Go's caches)
	rm -rf $(BIN) build
