package relaykafka_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

const testPassword = "s3cret-Kp4ss" // never to be printed

// deliver publishes n messages through a sink made from cfg and reads them back with a
// client made from cfg.ClientOpts, returning the records read.
func deliver(t *testing.T, cfg relaykafka.Config, topic string, n int) []*kgo.Record {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sink, err := relaykafka.NewSink(cfg)
	if err != nil {
		t.Fatalf("NewSink: %v", err)
	}
	defer func() { _ = sink.Close() }()
	if err := sink.Ping(ctx); err != nil {
		t.Fatalf("Ping: %v", err)
	}
	msgs := make([]*relay.Message, n)
	for i := range msgs {
		// Compressible payloads, so the codec is used (a batch is compressed only if it shrinks).
		msgs[i] = &relay.Message{ID: int64(i + 1), EventID: fmt.Sprintf("ev-%d", i), Topic: topic, Key: "k",
			Payload: bytes.Repeat([]byte(fmt.Sprintf("payload %d ", i)), 50)}
	}
	errs := make([]error, n)
	sink.Publish(ctx, msgs, errs)
	for i, err := range errs {
		if err != nil {
			t.Fatalf("message %d not delivered: %v", i, err)
		}
	}
	opts, err := cfg.ClientOpts()
	if err != nil {
		t.Fatalf("ClientOpts: %v", err)
	}
	cl, err := kgo.NewClient(append(opts, kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))...)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	var got []*kgo.Record
	for len(got) < n {
		fs := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			t.Fatalf("read back %d of %d records: %v", len(got), n, err)
		}
		fs.EachError(func(_ string, _ int32, err error) { t.Fatalf("consume: %v", err) })
		got = append(got, fs.Records()...)
	}
	for i, r := range got {
		if want := fmt.Sprintf("ev-%d", i); string(r.Headers[0].Value) != want {
			t.Fatalf("record %d carries event id %q, want %q", i, r.Headers[0].Value, want)
		}
	}
	return got
}

// The sink authenticates with each SASL mechanism, and the client options it shares
// (ClientOpts) authenticate the same way.
func TestSinkDeliversOverSASL(t *testing.T) {
	t.Parallel()
	for _, mech := range []string{relaykafka.SASLPlain, relaykafka.SASLScramSHA256, relaykafka.SASLScramSHA512} {
		t.Run(mech, func(t *testing.T) {
			t.Parallel()
			k := kafkatest.Fake(t, 1, kfake.EnableSASL(), kfake.Superuser(mech, "relay", testPassword))
			// The mechanism is accepted in any case.
			cfg := relaykafka.Config{Brokers: k.Brokers(), SASL: relaykafka.SASLConfig{Mechanism: strings.ToLower(mech), User: "relay", Password: testPassword}}
			deliver(t, cfg, "sasl", 3)
		})
	}
}

// A wrong password, or no credentials for a cluster that wants them, gives an error that
// says to check the SASL credentials, and never shows the password.
func TestSASLWrongPasswordIsExplained(t *testing.T) {
	t.Parallel()
	k := kafkatest.Fake(t, 1, kfake.EnableSASL(), kfake.Superuser(relaykafka.SASLScramSHA256, "relay", "the-right-one"))
	plain := kafkatest.Fake(t, 1)
	for _, c := range []struct {
		name    string
		brokers []string
		sasl    relaykafka.SASLConfig
		want    string
	}{
		{"SASL to a listener without it", plain.Brokers(), relaykafka.SASLConfig{Mechanism: relaykafka.SASLPlain, User: "relay", Password: testPassword}, "has no SASL"},
		{"wrong password", nil, relaykafka.SASLConfig{Mechanism: relaykafka.SASLScramSHA256, User: "relay", Password: testPassword}, "SASL authentication"},
		{"unknown user", nil, relaykafka.SASLConfig{Mechanism: relaykafka.SASLScramSHA512, User: "nobody", Password: testPassword}, "wrong user or password"},
		{"no SASL", nil, relaykafka.SASLConfig{}, "--kafka-sasl-mechanism"},
	} {
		t.Run(c.name, func(t *testing.T) {
			brokers := c.brokers
			if brokers == nil {
				brokers = k.Brokers()
			}
			sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: brokers, SASL: c.sasl})
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = sink.Close() }()
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			err = sink.Ping(ctx)
			var ce *relaykafka.ConnectionError
			if !errors.As(err, &ce) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Ping = %v, want a *ConnectionError mentioning %q", err, c.want)
			}
			if strings.Contains(err.Error(), testPassword) {
				t.Fatalf("the error shows the password: %v", err)
			}
		})
	}
}

// TLS with a private CA and a server name that differs from the address dialled (the
// certificate names only the server name, not 127.0.0.1), and mutual TLS with a client
// certificate; the mistakes an operator makes get errors that name the setting to fix.
func TestSinkDeliversOverTLS(t *testing.T) {
	t.Parallel()
	pki := kafkatest.NewPKI(t, "kafka.test")
	tlsK := kafkatest.Fake(t, 1, kfake.TLS(pki.ServerConfig(false)))
	mtlsK := kafkatest.Fake(t, 1, kfake.TLS(pki.ServerConfig(true)))
	plainK := kafkatest.Fake(t, 1)

	t.Run("CA file and server name", func(t *testing.T) {
		t.Parallel()
		deliver(t, relaykafka.Config{Brokers: tlsK.Brokers(), TLS: relaykafka.TLSConfig{CAFile: pki.CAFile, ServerName: pki.ServerName}}, "tls", 3)
	})
	t.Run("mutual TLS", func(t *testing.T) {
		t.Parallel()
		deliver(t, relaykafka.Config{Brokers: mtlsK.Brokers(), TLS: relaykafka.TLSConfig{
			CAFile: pki.CAFile, ServerName: pki.ServerName, CertFile: pki.ClientCertFile, KeyFile: pki.ClientKeyFile,
		}}, "mtls", 3)
	})
	t.Run("SASL over TLS", func(t *testing.T) {
		t.Parallel()
		k := kafkatest.Fake(t, 1, kfake.TLS(pki.ServerConfig(false)), kfake.EnableSASL(), kfake.Superuser(relaykafka.SASLPlain, "relay", testPassword))
		deliver(t, relaykafka.Config{Brokers: k.Brokers(),
			TLS:  relaykafka.TLSConfig{Enabled: true, CAFile: pki.CAFile, ServerName: pki.ServerName},
			SASL: relaykafka.SASLConfig{Mechanism: relaykafka.SASLPlain, User: "relay", Password: testPassword},
		}, "sasl-tls", 3)
	})

	for _, c := range []struct {
		name    string
		brokers []string
		tls     relaykafka.TLSConfig
		want    string
	}{
		{"untrusted CA", tlsK.Brokers(), relaykafka.TLSConfig{CAFile: pki.OtherCAFile, ServerName: pki.ServerName}, "--kafka-tls-ca-file"},
		{"system roots", tlsK.Brokers(), relaykafka.TLSConfig{Enabled: true, ServerName: pki.ServerName}, "--kafka-tls-ca-file"},
		{"no server name", tlsK.Brokers(), relaykafka.TLSConfig{CAFile: pki.CAFile}, "--kafka-tls-server-name"},
		{"no client certificate", mtlsK.Brokers(), relaykafka.TLSConfig{CAFile: pki.CAFile, ServerName: pki.ServerName}, "--kafka-tls-cert-file"},
		{"TLS to a plaintext listener", plainK.Brokers(), relaykafka.TLSConfig{CAFile: pki.CAFile, ServerName: pki.ServerName}, "TLS listener"},
		{"plaintext to a TLS listener", tlsK.Brokers(), relaykafka.TLSConfig{}, "--kafka-tls"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: c.brokers, TLS: c.tls})
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = sink.Close() }()
			// Most mistakes fail at once; TLS to a plaintext listener waits for an answer.
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			err = sink.Ping(ctx)
			var ce *relaykafka.ConnectionError
			if !errors.As(err, &ce) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Ping = %v, want a *ConnectionError mentioning %q", err, c.want)
			}
		})
	}
}

// Every codec is used for the batches (when compressing shrinks them), and the default is
// snappy, as before the setting existed.
func TestSinkCompression(t *testing.T) {
	t.Parallel()
	k := kafkatest.Fake(t, 1)
	for _, c := range []struct {
		name string
		want uint8 // the record batch's compression attribute
	}{{"", 2}, {"none", 0}, {"gzip", 1}, {"snappy", 2}, {"LZ4", 3}, {"zstd", 4}} {
		t.Run("codec="+c.name, func(t *testing.T) {
			t.Parallel()
			recs := deliver(t, relaykafka.Config{Brokers: k.Brokers(), Compression: c.name}, "compression-"+strings.ToLower(c.name), 5)
			if got := recs[0].Attrs.CompressionType(); got != c.want {
				t.Fatalf("batch compression %d, want %d", got, c.want)
			}
		})
	}
}

// NewSink and ClientOpts report every problem of the security settings at once, each naming
// what to change, without contacting a broker.
func TestSecurityConfigReportsEveryProblem(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	notPEM := filepath.Join(dir, "not.pem")
	if err := os.WriteFile(notPEM, []byte("hello"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := relaykafka.Config{
		Brokers:     []string{"127.0.0.1:1"},
		TLS:         relaykafka.TLSConfig{CAFile: notPEM, CertFile: filepath.Join(dir, "missing.pem")},
		SASL:        relaykafka.SASLConfig{Mechanism: "GSSAPI", Password: testPassword},
		Compression: "brotli",
	}
	_, err := relaykafka.NewSink(cfg)
	var ce *relay.ConfigError
	if !errors.As(err, &ce) {
		t.Fatalf("NewSink = %v, want a *relay.ConfigError", err)
	}
	for _, want := range []string{"holds no PEM certificate", "without TLS.KeyFile", `"GSSAPI"`, "needs SASL.User", `"brotli"`} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not mention %q: %v", want, err)
		}
	}
	if len(ce.Problems) != 5 {
		t.Errorf("%d problems, want 5: %v", len(ce.Problems), err)
	}
	if strings.Contains(err.Error(), testPassword) {
		t.Errorf("the error shows the password: %v", err)
	}
	// ClientOpts checks the connection settings only: not the codec.
	_, err = cfg.ClientOpts()
	if !errors.As(err, &ce) || len(ce.Problems) != 4 {
		t.Errorf("ClientOpts = %v, want the 4 connection problems", err)
	}

	for _, c := range []struct {
		sasl relaykafka.SASLConfig
		tls  relaykafka.TLSConfig
		want string
	}{
		{relaykafka.SASLConfig{User: "u", Password: "p"}, relaykafka.TLSConfig{}, "no SASL.Mechanism"},
		{relaykafka.SASLConfig{Mechanism: "SCRAM-SHA-256", User: "u"}, relaykafka.TLSConfig{}, "needs SASL.Password"},
		{relaykafka.SASLConfig{}, relaykafka.TLSConfig{KeyFile: notPEM}, "without TLS.CertFile"},
		{relaykafka.SASLConfig{}, relaykafka.TLSConfig{CAFile: filepath.Join(dir, "nope.pem")}, "no such file"},
		{relaykafka.SASLConfig{}, relaykafka.TLSConfig{CertFile: notPEM, KeyFile: notPEM}, "--kafka-tls-cert-file"},
	} {
		if _, err := (relaykafka.Config{Brokers: []string{"x:1"}, SASL: c.sasl, TLS: c.tls}).ClientOpts(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v %+v: %v, want an error mentioning %q", c.sasl, c.tls, err, c.want)
		}
	}
}

// Printing or logging a config does not show the SASL password.
func TestConfigHidesPassword(t *testing.T) {
	t.Parallel()
	cfg := relaykafka.Config{Brokers: []string{"b:9092"}, SASL: relaykafka.SASLConfig{Mechanism: relaykafka.SASLScramSHA512, User: "relay", Password: testPassword}}
	var logged bytes.Buffer
	slog.New(slog.NewTextHandler(&logged, nil)).Info("config", "sasl", cfg.SASL, "cfg", cfg)
	for _, s := range []string{fmt.Sprint(cfg), fmt.Sprintf("%+v", cfg), fmt.Sprintf("%#v", cfg), fmt.Sprintf("%v", cfg.SASL), logged.String()} {
		if strings.Contains(s, testPassword) {
			t.Errorf("the password is shown: %s", s)
		}
		if !strings.Contains(s, "relay") {
			t.Errorf("the user is not shown: %s", s)
		}
	}
}
