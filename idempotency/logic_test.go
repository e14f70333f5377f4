package idempotency_test

import (
	"bytes"
	"context"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/idempotency"
)

func TestFingerprint(t *testing.T) {
	base := idempotency.Fingerprint("POST", "/orders", "a=1", []byte(`{"x":1}`))
	if len(base) != 32 {
		t.Fatalf("fingerprint is %d bytes; want a SHA-256 (32)", len(base))
	}
	same := idempotency.Fingerprint("POST", "/orders", "a=1", []byte(`{"x":1}`))
	if !bytes.Equal(base, same) {
		t.Fatal("the same request gave two fingerprints")
	}
	different := []struct {
		name                 string
		method, route, query string
		body                 string
	}{
		{"method", "PATCH", "/orders", "a=1", `{"x":1}`},
		{"route", "POST", "/orders/2", "a=1", `{"x":1}`},
		{"query", "POST", "/orders", "a=2", `{"x":1}`},
		{"no query", "POST", "/orders", "", `{"x":1}`},
		{"body", "POST", "/orders", "a=1", `{"x":2}`},
		{"empty body", "POST", "/orders", "a=1", ``},
		{"route/query boundary", "POST", "/ordersa=1", "", `{"x":1}`},
	}
	for _, d := range different {
		fp := idempotency.Fingerprint(d.method, d.route, d.query, []byte(d.body))
		if bytes.Equal(fp, base) {
			t.Errorf("%s: a different request has the same fingerprint", d.name)
		}
	}
}

func TestCanonicalJSON(t *testing.T) {
	tests := []struct {
		name, a, b string
		equal      bool
	}{
		{"key order and whitespace", `{"b":1,"a":[1,2]}`, " {\n \"a\" : [1, 2],\t\"b\":1 } ", true},
		{"nested objects", `{"o":{"z":true,"y":null}}`, `{"o":{"y":null,"z":true}}`, true},
		{"string escapes", `{"s":"\u0041\/"}`, `{"s":"A/"}`, true},
		{"HTML characters kept", `{"s":"<&>"}`, `{"s":"\u003c\u0026\u003e"}`, true},
		{"array order matters", `[1,2]`, `[2,1]`, false},
		{"number literals differ", `{"n":1.0}`, `{"n":1}`, false},
		{"big numbers kept exact", `{"n":12345678901234567890}`, `{"n":12345678901234567891}`, false},
		{"values differ", `{"a":"x"}`, `{"a":"y"}`, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ca, ok := idempotency.CanonicalJSON([]byte(tt.a))
			if !ok {
				t.Fatalf("%q not accepted", tt.a)
			}
			cb, ok := idempotency.CanonicalJSON([]byte(tt.b))
			if !ok {
				t.Fatalf("%q not accepted", tt.b)
			}
			if bytes.Equal(ca, cb) != tt.equal {
				t.Fatalf("canonical %q vs %q: equal=%v, want %v", ca, cb, !tt.equal, tt.equal)
			}
		})
	}
	for _, bad := range []string{``, `{`, `{} {}`, `{"a":1} x`, `nope`} {
		if out, ok := idempotency.CanonicalJSON([]byte(bad)); ok {
			t.Errorf("CanonicalJSON(%q) = %q; want not ok (raw bytes are fingerprinted instead)", bad, out)
		}
	}
}

func TestDefaultStore(t *testing.T) {
	tests := []struct {
		status int
		stored bool
	}{
		{100, false}, {200, true}, {201, true}, {204, true}, {299, true},
		{301, false}, {303, false}, {304, false},
		{400, true}, {404, true}, {409, true}, {422, true},
		{408, false}, {425, false}, {429, false},
		{500, false}, {502, false}, {503, false},
	}
	for _, tt := range tests {
		if got := idempotency.DefaultStore(tt.status); got != tt.stored {
			t.Errorf("DefaultStore(%d) = %v; want %v", tt.status, got, tt.stored)
		}
	}
}

func TestNewRefusesBadConfig(t *testing.T) {
	// Every problem is reported in one error.
	_, err := idempotency.New(idempotency.Config{
		Schema:                 "Bad-Schema",
		Methods:                []string{"POST", "NOT A METHOD"},
		Window:                 time.Hour,
		MaxBodyBytes:           -1,
		MaxStoredResponseBytes: -1,
		StoredHeaders:          []string{"Location", "set-cookie"},
		MismatchStatus:         400,
		WaitInFlight:           -time.Second,
		MaxWaiters:             -1,
		RetryAfter:             -time.Second,
	})
	if err == nil {
		t.Fatal("New accepted an invalid config")
	}
	for _, want := range []string{"Pool is nil", "Owner is nil", "Schema", "NOT A METHOD", "Window", "MaxBodyBytes", "MaxStoredResponseBytes", "Set-Cookie", "MismatchStatus", "WaitInFlight", "MaxWaiters", "RetryAfter"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not mention %s:\n%v", want, err)
		}
	}

	// Owner is required even when everything else is fine.
	pool, perr := pgxpool.New(context.Background(), "postgres://localhost:1/none") // lazy: never connects here
	if perr != nil {
		t.Fatal(perr)
	}
	defer pool.Close()
	if _, err := idempotency.New(idempotency.Config{Pool: pool}); err == nil || !strings.Contains(err.Error(), "Owner is nil") {
		t.Fatalf("New without Owner: %v; want a refusal naming Owner", err)
	}
	owner := func(*http.Request) (string, error) { return "u", nil }
	if _, err := idempotency.New(idempotency.Config{Pool: pool, Owner: owner, Window: time.Hour}); err == nil {
		t.Fatal("a 1h retention was accepted without AllowShortWindow")
	}
	m, err := idempotency.New(idempotency.Config{Pool: pool, Owner: owner, Window: time.Hour, AllowShortWindow: true, Logger: slog.Default()})
	if err != nil {
		t.Fatalf("valid config refused: %v", err)
	}
	c := m.Config()
	if c.Schema != "onceflow" || c.MismatchStatus != 422 || c.MaxBodyBytes != idempotency.DefaultMaxBodyBytes ||
		c.MaxStoredResponseBytes != idempotency.DefaultMaxStoredResponseBytes || c.RetryAfter != time.Second || c.MaxWaiters != idempotency.DefaultMaxWaiters ||
		len(c.Methods) != 2 || len(c.StoredHeaders) != len(idempotency.DefaultStoredHeaders) {
		t.Fatalf("defaults not filled in: %+v", c)
	}
	if _, err := idempotency.NewCleaner(idempotency.CleanerConfig{Schema: "x-y", BatchSize: -1}); err == nil ||
		!strings.Contains(err.Error(), "Pool") || !strings.Contains(err.Error(), "Schema") || !strings.Contains(err.Error(), "BatchSize") {
		t.Fatalf("NewCleaner with three problems: %v", err)
	}
}
