// Package adopttest holds the adoption tests that need dependencies the library must not
// carry: watermill-sql v4 (and, through it, lib/pq). It is a module of its own, like bench/,
// so the library's go.mod never names them; `make test` runs it (go -C internal/adopttest test).
package adopttest
