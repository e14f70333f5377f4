package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

const kafkaSecret = "Kq7-sasl-Zt9x" // the SASL password of the secured test clusters

// securedKafka is a kfake cluster that wants mutual TLS and SASL/SCRAM-SHA-512, with the
// files a relay needs to reach it.
type securedKafka struct {
	brokers      string
	pki          *kafkatest.PKI
	passwordFile string
}

func newSecuredKafka(t *testing.T) *securedKafka {
	t.Helper()
	pki := kafkatest.NewPKI(t, "kafka.test")
	k := kafkatest.Fake(t, 1, kfake.TLS(pki.ServerConfig(true)), kfake.EnableSASL(), kfake.Superuser(relaykafka.SASLScramSHA512, "relay", kafkaSecret))
	pwFile := filepath.Join(t.TempDir(), "password")
	if err := os.WriteFile(pwFile, []byte(kafkaSecret+"\n"), 0o600); err != nil { // as echo writes it
		t.Fatal(err)
	}
	return &securedKafka{brokers: strings.Join(k.Brokers(), ","), pki: pki, passwordFile: pwFile}
}

// flags are the relay's flags for the cluster, the password from the file.
func (s *securedKafka) flags() []string {
	return []string{"--kafka-brokers", s.brokers, "--kafka-tls-ca-file", s.pki.CAFile, "--kafka-tls-server-name", s.pki.ServerName,
		"--kafka-tls-cert-file", s.pki.ClientCertFile, "--kafka-tls-key-file", s.pki.ClientKeyFile,
		"--kafka-sasl-mechanism", "SCRAM-SHA-512", "--kafka-sasl-user", "relay", "--kafka-sasl-password-file", s.passwordFile}
}

// env is the same configuration from environment variables, the password itself included.
func (s *securedKafka) env() map[string]string {
	return map[string]string{"KAFKA_BROKERS": s.brokers, "ONCEFLOW_KAFKA_TLS_CA_FILE": s.pki.CAFile, "ONCEFLOW_KAFKA_TLS_SERVER_NAME": s.pki.ServerName,
		"ONCEFLOW_KAFKA_TLS_CERT_FILE": s.pki.ClientCertFile, "ONCEFLOW_KAFKA_TLS_KEY_FILE": s.pki.ClientKeyFile,
		"ONCEFLOW_KAFKA_SASL_MECHANISM": "scram-sha-512", "ONCEFLOW_KAFKA_SASL_USER": "relay", "ONCEFLOW_KAFKA_SASL_PASSWORD": kafkaSecret,
		"ONCEFLOW_KAFKA_COMPRESSION": "lz4", "ONCEFLOW_KAFKA_CLIENT_ID": "relay-from-env"}
}

func (s *securedKafka) config() relaykafka.Config {
	return relaykafka.Config{Brokers: strings.Split(s.brokers, ","),
		TLS:  relaykafka.TLSConfig{CAFile: s.pki.CAFile, ServerName: s.pki.ServerName, CertFile: s.pki.ClientCertFile, KeyFile: s.pki.ClientKeyFile},
		SASL: relaykafka.SASLConfig{Mechanism: relaykafka.SASLScramSHA512, User: "relay", Password: kafkaSecret}}
}

// readTopic reads n records of topic from the secured cluster.
func (s *securedKafka) readTopic(t *testing.T, topic string, n int) []*kgo.Record {
	t.Helper()
	opts, err := s.config().ClientOpts()
	if err != nil {
		t.Fatal(err)
	}
	cl, err := kgo.NewClient(append(opts, kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))...)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var recs []*kgo.Record
	for len(recs) < n {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("read %d of %d records of %s: %v", len(recs), n, topic, ctx.Err())
		}
		recs = append(recs, fs.Records()...)
	}
	return recs
}

// runRelayUntilDrained runs the relay until the outbox is empty, then stops it (exit 0).
func runRelayUntilDrained(t *testing.T, db *testdb.DB, env map[string]string, args ...string) *invocation {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	inv := start(ctx, env, append([]string{"relay", "--database-url", db.URL, "--schema", db.Schema}, args...)...)
	deadline := time.Now().Add(60 * time.Second)
	for {
		var left int
		if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+db.Table("outbox")).Scan(&left); err != nil {
			t.Fatal(err)
		}
		if left == 0 {
			break
		}
		select {
		case code := <-inv.done:
			t.Fatalf("relay exited %d with %d rows left:\n%s", code, left, inv.stderr.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("relay did not drain the outbox within 60s (%d rows left):\n%s", left, inv.stderr.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	cancel()
	if code := <-inv.done; code != 0 {
		t.Fatalf("relay exited %d:\n%s", code, inv.stderr.String())
	}
	return inv
}

func insertRows(t *testing.T, db *testdb.DB, topic string, n int) {
	t.Helper()
	for range n {
		if _, err := db.Pool.Exec(context.Background(), `INSERT INTO `+db.Table("outbox")+` (event_id, topic, key_hash, payload) VALUES (gen_random_uuid(), $1, 1, 'x')`, topic); err != nil {
			t.Fatal(err)
		}
	}
}

// onceflow relay reaches a cluster that wants mutual TLS (private CA, server name, client
// certificate) and SASL/SCRAM, configured by flags with the password in a file, or by
// environment variables with the password in one.
func TestRelayCommandReachesSecuredKafka(t *testing.T) {
	t.Parallel()
	s := newSecuredKafka(t)
	db := testdb.New(t)

	insertRows(t, db, "secured-flags", 3)
	inv := runRelayUntilDrained(t, db, nil, append(s.flags(), "--kafka-compression", "gzip", "--kafka-client-id", "relay-from-flags")...)
	recs := s.readTopic(t, "secured-flags", 3)
	if strings.Contains(inv.stderr.String(), kafkaSecret) {
		t.Errorf("the relay printed the password:\n%s", inv.stderr.String())
	}
	if strings.Contains(inv.stderr.String(), "does not answer") {
		t.Errorf("the relay warned that Kafka does not answer:\n%s", inv.stderr.String())
	}
	if len(recs) != 3 {
		t.Fatalf("%d records, want 3", len(recs))
	}

	insertRows(t, db, "secured-env", 3)
	inv = runRelayUntilDrained(t, db, s.env())
	s.readTopic(t, "secured-env", 3)
	if strings.Contains(inv.stderr.String(), kafkaSecret) {
		t.Errorf("the relay printed the password:\n%s", inv.stderr.String())
	}
}

// A wrong password: the relay says at start that the SASL credentials are the likely cause,
// without showing the password, and the rows stay in the outbox.
func TestRelayCommandWrongKafkaPassword(t *testing.T) {
	t.Parallel()
	s := newSecuredKafka(t)
	db := testdb.New(t)
	insertRows(t, db, "wrong-password", 1)
	env := s.env()
	env["ONCEFLOW_KAFKA_SASL_PASSWORD"] = "not-" + kafkaSecret
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	inv := start(ctx, env, "relay", "--database-url", db.URL, "--schema", db.Schema)
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(inv.stderr.String(), "does not answer") {
		if time.Now().After(deadline) {
			t.Fatalf("no warning within 30s:\n%s", inv.stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	<-inv.done
	out := inv.stderr.String()
	for _, want := range []string{"SASL authentication", `user \"relay\"`, "SCRAM-SHA-512", "wrong user or password"} {
		if !strings.Contains(out, want) {
			t.Errorf("the warning does not say %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, kafkaSecret) {
		t.Errorf("the relay printed the password:\n%s", out)
	}
	var left int
	if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+db.Table("outbox")).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 1 {
		t.Errorf("%d rows left, want 1", left)
	}
}

// Every mistake in the Kafka settings is reported at once, before connecting, and the
// password has no flag.
func TestKafkaFlagsReportEveryProblem(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	empty := filepath.Join(dir, "empty")
	if err := os.WriteFile(empty, []byte("\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"DATABASE_URL": "postgres://u@127.0.0.1:1/db", "ONCEFLOW_KAFKA_SASL_PASSWORD": kafkaSecret, "ONCEFLOW_KAFKA_TLS": "maybe"}
	r := runCmd(context.Background(), env, "relay", "--kafka-brokers", "127.0.0.1:1", "--kafka-sasl-mechanism", "GSSAPI",
		"--kafka-sasl-password-file", empty, "--kafka-tls-cert-file", empty, "--kafka-compression", "brotli").expect(t, "relay with bad Kafka settings", 1)
	for _, want := range []string{"ONCEFLOW_KAFKA_TLS=\"maybe\"", "given twice", "is empty", `"GSSAPI"`, "needs SASL.User", "without TLS.KeyFile", `"brotli"`} {
		if !strings.Contains(r.stderr, want) {
			t.Errorf("the error does not mention %q:\n%s", want, r.stderr)
		}
	}
	if strings.Contains(r.stdout+r.stderr, kafkaSecret) {
		t.Errorf("the password was printed:\n%s", r.stderr)
	}
	r = runCmd(context.Background(), env, "relay", "--kafka-sasl-password-file", filepath.Join(dir, "missing")).expect(t, "a missing password file", 1)
	if !strings.Contains(r.stderr, "--kafka-sasl-password-file: open") {
		t.Errorf("a missing password file is not reported:\n%s", r.stderr)
	}
	runCmd(context.Background(), nil, "relay", "--kafka-sasl-password", kafkaSecret).expect(t, "a password flag", 2)
}

func TestReadPasswordFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for content, want := range map[string]string{"pw": "pw", "pw\n": "pw", "pw\r\n": "pw", " pw with spaces \n\n": " pw with spaces "} {
		path := filepath.Join(dir, "f")
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		if got, err := readPasswordFile(path); err != nil || got != want {
			t.Errorf("file %q: %q, %v; want %q", content, got, err, want)
		}
	}
	big := filepath.Join(dir, "big")
	if err := os.WriteFile(big, make([]byte, maxPasswordFile+1), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := readPasswordFile(big); err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Errorf("a large file: %v", err)
	}
}
