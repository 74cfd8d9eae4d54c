# gpufrac — build, test and demo. `make help` lists the targets.

GO      ?= go
BIN     := $(CURDIR)/bin
TOOLS   := $(CURDIR)/hack/tools
GOLANGCI_LINT := $(BIN)/golangci-lint
BENCHSTAT     := $(BIN)/benchstat
FUZZTIME ?= 5m

.DEFAULT_GOAL := help

.PHONY: help
help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-12s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

.PHONY: build
build: ## build bin/gpufrac
	$(GO) build -o $(BIN)/gpufrac ./cmd/gpufrac

.PHONY: demo
demo: build ## the main job: validate the shipped examples and print their normalised requests
	$(BIN)/gpufrac validate examples/

.PHONY: test
test: verify unit ## the whole suite: formatting, vet, lint, then every test

.PHONY: unit
unit: ## go test with the race detector (fuzz tests run their seed corpus)
	$(GO) test -race -count=1 ./...

.PHONY: verify
verify: fmt-check vet lint tidy-check ## static checks only

.PHONY: fmt-check
fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt needed on:"; echo "$$out"; exit 1; fi

.PHONY: vet
vet:
	$(GO) vet ./...

.PHONY: lint
lint: $(GOLANGCI_LINT) ## golangci-lint, built from hack/tools at a pinned version
	$(GOLANGCI_LINT) run ./...

.PHONY: tidy-check
tidy-check: ## go.mod and go.sum must already be tidy
	$(GO) mod tidy -diff

.PHONY: fuzz
fuzz: ## fuzz the annotation parser and the manifest reader for FUZZTIME each (default 5m)
	$(GO) test ./pkg/api -run '^$$' -fuzz '^FuzzParse$$' -fuzztime $(FUZZTIME)
	$(GO) test ./pkg/manifest -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime $(FUZZTIME)

.PHONY: bench
bench: $(BENCHSTAT) ## benchmarks, 10 runs, summarised by benchstat
	$(GO) test -run '^$$' -bench . -benchmem -count 10 ./... | tee $(BIN)/bench.txt
	$(BENCHSTAT) $(BIN)/bench.txt

.PHONY: tools
tools: $(GOLANGCI_LINT) $(BENCHSTAT) ## build the pinned developer tools into bin/

$(GOLANGCI_LINT) $(BENCHSTAT): $(TOOLS)/go.mod $(TOOLS)/go.sum
	cd $(TOOLS) && $(GO) build -o $(BIN)/ tool
	@touch $(GOLANGCI_LINT) $(BENCHSTAT)

.PHONY: clean
clean: ## remove build outputs (keeps Go's caches)
	rm -rf $(BIN)
