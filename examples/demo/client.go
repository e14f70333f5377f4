package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/onceflow/onceflow/outbox"
)

// shopper is a customer's buying habits.
type shopper struct {
	id   string
	skus []string // picked at random
	max  int      // most units per order
}

// shoppers: frank buys lamps by the three and goes over his limit at the payment provider;
// the others buy small things, now and then the scarce poster.
var shoppers = []shopper{
	{"alice", []string{"book", "mug", "book", "mug", "poster"}, 2},
	{"bob", []string{"mug", "book", "mug", "book", "poster"}, 2},
	{"carol", []string{"book", "book", "mug", "mug", "poster"}, 1},
	{"dave", []string{"mug", "mug", "book", "book", "poster"}, 1},
	{"erin", []string{"book", "mug", "mug", "book", "poster"}, 2},
	{"frank", []string{"lamp"}, 3},
}

// client is the shop's customers, as the orders API sees them: every order has its own
// Idempotency-Key, and the client retries the way real ones do.
type client struct {
	base string
	http *http.Client

	mu   sync.Mutex
	keys map[string]map[string]bool // customer + key → order ids answered with 201

	accepted, replays, retries, inflight, dropped, reuses, reuseRefused, errors atomic.Int64
}

func newClient(addr string) *client {
	return &client{base: "http://" + addr, http: &http.Client{Timeout: 10 * time.Second}, keys: map[string]map[string]bool{}}
}

type orderResp struct {
	ID     string `json:"id"`
	Status string `json:"status"`
}

// shop places n orders for s, one every interval on average, until ctx ends.
func (c *client) shop(ctx context.Context, s shopper, n int, interval time.Duration, seed uint64) {
	rnd := mrand.New(mrand.NewPCG(seed, uint64(time.Now().UnixNano())))
	for range n {
		if ctx.Err() != nil {
			return
		}
		body := fmt.Sprintf(`{"sku":%q,"quantity":%d}`, s.skus[rnd.IntN(len(s.skus))], 1+rnd.IntN(s.max))
		key := outbox.NewUUID()
		switch r := rnd.Float64(); {
		case r < 0.10:
			// A client that retried while its first request was still in flight: both copies
			// at once. One runs; the other gets 409 while it does, and then the stored answer.
			var wg sync.WaitGroup
			for range 2 {
				wg.Go(func() { c.place(ctx, s.id, key, body) })
			}
			wg.Wait()
		case r < 0.20:
			// The connection drops after the request was sent: the client never sees the
			// answer, and sends the same request with the same key again.
			c.sendAndHangUp(s.id, key, body)
			c.place(ctx, s.id, key, body)
		default:
			c.place(ctx, s.id, key, body)
		}
		if rnd.Float64() < 0.15 {
			c.place(ctx, s.id, key, body) // a retry after the answer was lost on the way back
		}
		if rnd.Float64() < 0.05 {
			c.reuse(ctx, s.id, key, fmt.Sprintf(`{"sku":"mug","quantity":%d}`, 5+rnd.IntN(5)))
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Duration(float64(interval) * (0.5 + rnd.Float64()))):
		}
	}
}

// place POSTs the order and retries with the same key until it gets an answer that is not
// "try again" (409 in flight, 5xx, a network error).
func (c *client) place(ctx context.Context, customer, key, body string) {
	for attempt := 0; ctx.Err() == nil; attempt++ {
		if attempt > 0 {
			c.retries.Add(1)
			time.Sleep(100 * time.Millisecond) // sooner than Retry-After, to keep the demo short
		}
		status, hdr, b, err := c.post(ctx, customer, key, body)
		switch {
		case err != nil || status >= 500:
			c.errors.Add(1)
			continue
		case status == http.StatusConflict:
			c.inflight.Add(1)
			continue
		case status != http.StatusCreated:
			fmt.Printf("  ✗ unexpected %d for a valid order: %s\n", status, b)
			c.errors.Add(1)
			return
		}
		var o orderResp
		if err := json.Unmarshal(b, &o); err != nil || o.ID == "" {
			c.errors.Add(1)
			return
		}
		if hdr.Get("Idempotent-Replayed") == "true" {
			c.replays.Add(1)
		}
		c.mu.Lock()
		ids := c.keys[customer+" "+key]
		if ids == nil {
			ids = map[string]bool{}
			c.keys[customer+" "+key] = ids
		}
		if len(ids) == 0 {
			c.accepted.Add(1)
		}
		ids[o.ID] = true
		c.mu.Unlock()
		return
	}
}

// reuse sends a different order under a key already used: it must be refused (422) and
// change nothing.
func (c *client) reuse(ctx context.Context, customer, key, body string) {
	c.reuses.Add(1)
	status, _, b, err := c.post(ctx, customer, key, body)
	if err == nil && status == http.StatusUnprocessableEntity && bytes.Contains(b, []byte("key-reused")) {
		c.reuseRefused.Add(1)
	}
}

func (c *client) post(ctx context.Context, customer, key, body string) (int, http.Header, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+"/orders", bytes.NewBufferString(body))
	if err != nil {
		return 0, nil, nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Customer-ID", customer)
	req.Header.Set("Idempotency-Key", key)
	resp, err := c.http.Do(req)
	if err != nil {
		return 0, nil, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, b, err
}

// sendAndHangUp writes the request on a raw connection and closes it without reading.
func (c *client) sendAndHangUp(customer, key, body string) {
	c.dropped.Add(1)
	conn, err := net.Dial("tcp", c.base[len("http://"):])
	if err != nil {
		return
	}
	fmt.Fprintf(conn, "POST /orders HTTP/1.1\r\nHost: orders\r\nContent-Type: application/json\r\n"+
		"X-Customer-ID: %s\r\nIdempotency-Key: %s\r\nContent-Length: %d\r\n\r\n%s", customer, key, len(body), body)
	_ = conn.Close()
}

// keysWithTwoOrders counts keys that were answered with more than one order id.
func (c *client) keysWithTwoOrders() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, ids := range c.keys {
		if len(ids) > 1 {
			n++
		}
	}
	return n
}
