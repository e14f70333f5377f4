# onceflow — common tasks. CI (.ci/run) runs `make test` and `make lint`.
GO       ?= go
# golangci-lint is pinned and built from the Go module proxy into ./bin (ignored by git), so
# every machine lints with the same version whatever else is on its PATH.
GOLANGCI ?= github.com/golangci/golangci-lint/v2/cmd/golangci-lint@v2.15.0
BIN      := $(CURDIR)/bin
# BENCH_FLAGS is passed to the bench program, e.g. `make bench BENCH_FLAGS=-only=outbox_write`.
BENCH_FLAGS ?=

.PHONY: test lint bench demo demo-ha demo-core build examples

## test: check the prerequisites README.md lists (fails in a second, one line per missing tool),
## then go vet and every test with the race detector (starts its own Postgres, Redis and kfake); then
## the adoption tests and the console's browser tests, modules of their own (internal/adopttest:
## watermill-sql and lib/pq; internal/browsertest: chromedp; all stay out of go.mod)
test:
	GO=$(GO) .ci/check-prereqs
	$(GO) vet ./...
	$(GO) test -race -timeout 20m ./...
	$(GO) -C internal/adopttest vet ./...
	$(GO) -C internal/adopttest test -race -timeout 10m ./...
	$(GO) -C internal/browsertest vet ./...
	$(GO) -C internal/browsertest test -race -timeout 5m ./...

## lint: no binaries or big files tracked, gofmt, go.mod tidy, go vet and golangci-lint (pinned)
## on the library and on the bench, adoption and browser test modules; fails if golangci-lint finds something or cannot be installed
lint:
	.ci/check-files_test.sh
	.ci/check-prereqs_test.sh
	.ci/check-files
	@out=$$(gofmt -l $$(git ls-files --cached --others --exclude-standard '*.go')); \
	 if [ -n "$$out" ]; then echo "gofmt needed (run gofmt -w on these):"; echo "$$out"; exit 1; fi
	$(GO) mod tidy -diff
	$(GO) -C bench mod tidy -diff
	$(GO) -C internal/adopttest mod tidy -diff
	$(GO) -C internal/browsertest mod tidy -diff
	$(GO) vet ./...
	$(GO) -C bench vet ./...
	$(GO) -C internal/adopttest vet ./...
	$(GO) -C internal/browsertest vet ./...
	GOBIN=$(BIN) $(GO) install $(GOLANGCI)
	$(BIN)/golangci-lint run ./...
	cd bench && $(BIN)/golangci-lint run ./...
	cd internal/adopttest && $(BIN)/golangci-lint run ./...
	cd internal/browsertest && $(BIN)/golangci-lint run ./...

## bench: onceflow vs the plain-Watermill baseline, side by side, same run (see docs/PERFORMANCE.md);
## the bench is a module of its own (bench/go.mod), so its baselines stay out of the library's go.mod
bench:
	$(GO) -C bench run . $(BENCH_FLAGS)

## build: the onceflow binary into ./bin
build:
	$(GO) build -o bin/onceflow ./cmd/onceflow

## examples: the example services (examples/{orders,inventory,payments,projection}) into ./bin/examples
examples:
	$(GO) build -o bin/examples/ ./examples/orders ./examples/inventory ./examples/payments ./examples/projection

## demo: the example shop end to end: orders, inventory, payments and a projection as child processes,
## each with its own schema and `onceflow relay`; retries, duplicates, crashes; then checks the invariants
demo: build examples
	$(GO) run ./examples/demo -bin bin

## demo-ha: the same shop on a PostgreSQL primary and a synchronous standby (one multi-host URL); the
## primary is killed mid-stream and the standby promoted; the same invariants
demo-ha: build examples
	$(GO) run ./examples/demo -bin bin -ha

## demo-core: producers → outbox → `onceflow relay` (killed and restarted) → Kafka → inbox consumer, then checks the invariants
demo-core: build
	$(GO) run ./examples/coredemo -onceflow bin/onceflow
