package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/onceflow/onceflow/console"
)

const uiSynopsis = `ui [flags]

Serves the operator console (package console) over HTTP: is anything stuck, sagas with their
timelines, the outbox and its parked rows, inbox poison messages, idempotency keys.

Read-only unless --actions is given (saga retry and compensate, replay of parked rows,
deletion of poison rows; each POST carries a CSRF token and is logged with the user's name).

Credentials come from the environment, never from flags (flags show in ps):
  ONCEFLOW_UI_USER and ONCEFLOW_UI_PASSWORD  an operator's HTTP basic authentication
  ONCEFLOW_UI_TOKEN                          an operator's "Authorization: Bearer <token>" (or basic-auth password)
  ONCEFLOW_UI_VIEWER_USER and ONCEFLOW_UI_VIEWER_PASSWORD, ONCEFLOW_UI_VIEWER_TOKEN
                                             the same for viewers: they read every page and change nothing
Without them the console serves only a loopback address (127.0.0.1, ::1, localhost), for an
SSH tunnel or a kubectl port-forward; any other address is refused. --actions on any other
address needs an operator's credential. Serve it over TLS (a
reverse proxy) when it leaves the host.

It answers only requests for the hosts it serves (the Host header): its listen address,
localhost on a loopback address, the machine's addresses when it listens on all of them, and
the names given with --host (the name a reverse proxy passes on). Others get 421: a page of
another site that rebinds its name to this address (DNS rebinding) reads and posts nothing.`

func (c *cli) runUI(ctx context.Context, args []string) error {
	fs := c.newFlagSet("ui", uiSynopsis)
	db := c.addDBFlags(fs)
	addr := fs.String("addr", c.envOr("ONCEFLOW_UI_ADDR", "127.0.0.1:8080"), "listen `address`; a non-loopback one needs a credential [ONCEFLOW_UI_ADDR]")
	actions := fs.Bool("actions", false, "switch on the buttons that change something (default: read-only)")
	refresh := fs.Duration("refresh", 10*time.Second, "how often the overview reloads itself (0: never)")
	extraHosts := fs.String("host", c.envOr("ONCEFLOW_UI_HOSTS", ""),
		"comma-separated host names (or host:port) it also answers, e.g. the name a reverse proxy passes on as Host [ONCEFLOW_UI_HOSTS]")
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	creds := console.Credentials{User: c.getenv("ONCEFLOW_UI_USER"), Password: c.getenv("ONCEFLOW_UI_PASSWORD"), Token: c.getenv("ONCEFLOW_UI_TOKEN")}
	viewer := console.Credentials{User: c.getenv("ONCEFLOW_UI_VIEWER_USER"), Password: c.getenv("ONCEFLOW_UI_VIEWER_PASSWORD"),
		Token: c.getenv("ONCEFLOW_UI_VIEWER_TOKEN"), Role: console.Viewer}
	for _, s := range []string{creds.Password, creds.Token, viewer.Password, viewer.Token} {
		c.secrets.addLiteral(s)
	}
	hasOperator := creds.Token != "" || creds.User != "" || creds.Password != ""
	hasViewer := viewer.Token != "" || viewer.User != "" || viewer.Password != ""
	hasCreds := hasOperator || hasViewer
	host, _, err := net.SplitHostPort(*addr)
	if err != nil {
		return fmt.Errorf("--addr %q is not host:port (e.g. 127.0.0.1:8080): %w", *addr, err)
	}
	switch {
	case !hasCreds && !isLoopback(host):
		return fmt.Errorf("--addr %q is reachable from other hosts, and no credential is set: set ONCEFLOW_UI_TOKEN, "+
			"or ONCEFLOW_UI_USER and ONCEFLOW_UI_PASSWORD, in the environment (not as flags: they show in ps), or listen on 127.0.0.1", *addr)
	case *actions && !hasOperator && !isLoopback(host):
		return fmt.Errorf("--actions on %q, reachable from other hosts, needs an operator's credential: set ONCEFLOW_UI_TOKEN, "+
			"or ONCEFLOW_UI_USER and ONCEFLOW_UI_PASSWORD (ONCEFLOW_UI_VIEWER_* only read), or drop --actions", *addr)
	}
	r := *refresh
	if r == 0 {
		r = -1 // console.Config: negative is never, 0 the default
	}
	var named []string
	for _, h := range strings.Split(*extraHosts, ",") {
		if h = strings.TrimSpace(h); h != "" {
			named = append(named, h)
		}
	}
	pool, err := db.connectMigrated(ctx, "onceflow-ui")
	if err != nil {
		return err
	}
	defer pool.Close()
	ln, err := (&net.ListenConfig{}).Listen(ctx, "tcp", *addr)
	if err != nil {
		return err
	}
	defer ln.Close()
	hosts, err := servedHosts(host, ln.Addr().(*net.TCPAddr))
	if err != nil {
		return err
	}
	logger := slog.New(slog.NewTextHandler(c.stderr, nil))
	h, err := console.New(console.Config{DB: pool, Schema: db.schema, Actions: *actions, Refresh: r, Logger: logger, Hosts: append(hosts, named...)})
	if err != nil {
		return fmt.Errorf("%w (--host)", err)
	}
	var handler http.Handler = h
	if hasCreds {
		var all []console.Credentials
		if hasOperator {
			all = append(all, creds)
		}
		if hasViewer {
			all = append(all, viewer)
		}
		if handler, err = console.RequireCredentials(h, all[0], all[1:]...); err != nil {
			return fmt.Errorf("%w (set ONCEFLOW_UI_USER and ONCEFLOW_UI_PASSWORD together, or ONCEFLOW_UI_TOKEN; the same for ONCEFLOW_UI_VIEWER_*)", err)
		}
	}
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: 30 * time.Second,
		WriteTimeout: time.Minute, IdleTimeout: 2 * time.Minute, ErrorLog: slog.NewLogLogger(logger.Handler(), slog.LevelWarn)}
	mode, auth := "read-only", "no credential (loopback only)"
	if *actions {
		mode = "actions on"
	}
	if hasCreds {
		auth = "credential required"
	}
	fmt.Fprintf(c.stdout, "onceflow ui: schema %q at http://%s/ (%s, %s); Ctrl-C stops it\n", db.schema, ln.Addr(), mode, auth)
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		return err
	}
	if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// isLoopback reports whether host names only this machine. An empty host (":8080") is every
// interface, so not loopback.
func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// servedHosts are the Host values a console listening at addr (asked for as host, e.g.
// "localhost") answers: the address with its port; on a loopback address also localhost and
// the loopback addresses; on all interfaces, the machine's addresses and localhost.
func servedHosts(host string, addr *net.TCPAddr) ([]string, error) {
	port := strconv.Itoa(addr.Port)
	out := []string{net.JoinHostPort(addr.IP.String(), port)}
	if host != "" {
		out = append(out, net.JoinHostPort(host, port))
	}
	switch {
	case addr.IP.IsLoopback():
		out = append(out, net.JoinHostPort("localhost", port), net.JoinHostPort("127.0.0.1", port), net.JoinHostPort("::1", port))
	case addr.IP.IsUnspecified():
		addrs, err := net.InterfaceAddrs()
		if err != nil {
			return nil, fmt.Errorf("list this machine's addresses for the Host check: %w; listen on one address with --addr", err)
		}
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok {
				out = append(out, net.JoinHostPort(n.IP.String(), port))
			}
		}
		out = append(out, net.JoinHostPort("localhost", port))
	}
	return out, nil
}
