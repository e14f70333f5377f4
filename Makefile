# onceflow — common tasks. `make test` is what CI runs (.ci/run).
GO       ?= go
GOLANGCI ?= github.com/golangci/golangci-lint/v2/cmd/golangci-lint@v2.15.0

.PHONY: test lint bench demo build

## test: go vet, then every test with the race detector (starts its own Postgres and kfake)
test:
	$(GO) vet ./...
	$(GO) test -race -timeout 20m ./...

## lint: gofmt check, go vet, and golangci-lint when it installs from the module proxy
lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	@if $(GO) install $(GOLANGCI) 2>/dev/null; then "$$($(GO) env GOPATH)/bin/golangci-lint" run ./...; \
	 else echo "golangci-lint could not be installed from the module proxy; skipped"; fi

## bench: onceflow vs the plain-Watermill baseline, side by side, same run (see docs/PERFORMANCE.md)
bench:
	$(GO) run ./internal/bench

## build: the onceflow binary into ./bin
build:
	$(GO) build -o bin/onceflow ./cmd/onceflow

## demo: producers → outbox → `onceflow relay` (killed and restarted) → Kafka → inbox consumer, then checks the invariants
demo: build
	$(GO) run ./examples/demo -onceflow bin/onceflow
