package main

import (
	"context"
	"regexp"
	"strings"
	"testing"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/internal/kafkatest"
)

// line matches an output line made of the given fields separated by white space.
func line(fields ...string) *regexp.Regexp {
	for i, f := range fields {
		fields[i] = regexp.QuoteMeta(f)
	}
	return regexp.MustCompile(`(?m)^` + strings.Join(fields, `\s+`) + `\s*$`)
}

// topics create is idempotent: it creates what is missing with the partitions, replication
// factor and configs asked, reports what exists, and fails only for an existing topic whose
// partition count is not the one asked; topics list shows them.
func TestTopicsCreateAndList(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	k := kafkatest.Fake(t, 4, kfake.NumBrokers(3))
	env := map[string]string{"KAFKA_BROKERS": strings.Join(k.Brokers(), ",")}

	r := runCmd(ctx, env, "topics", "create", "--partitions", "6", "--replication-factor", "3",
		"--config", "retention.ms=3600000", "--config", "cleanup.policy=compact,delete", "orders", "payments", "orders").expect(t, "create", 0)
	for _, topic := range []string{"orders", "payments"} {
		if !line("created", topic, "6 partitions, replication factor 3").MatchString(r.stdout) {
			t.Errorf("create does not report %s as created:\n%s", topic, r.stdout)
		}
	}
	if strings.Count(r.stdout, "orders") != 1 {
		t.Errorf("a topic named twice is reported twice:\n%s", r.stdout)
	}
	// The configs were applied.
	cl, err := kgo.NewClient(kgo.SeedBrokers(k.Brokers()...))
	if err != nil {
		t.Fatal(err)
	}
	adm := kadm.NewClient(cl)
	defer adm.Close()
	rcs, err := adm.DescribeTopicConfigs(ctx, "orders")
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, c := range rcs[0].Configs {
		got[c.Key] = c.MaybeValue()
	}
	if got["retention.ms"] != "3600000" || got["cleanup.policy"] != "compact,delete" {
		t.Errorf("configs of orders: retention.ms=%q cleanup.policy=%q", got["retention.ms"], got["cleanup.policy"])
	}

	// Again, with flags after the topics and one new topic: the existing ones are reported.
	r = runCmd(ctx, env, "topics", "create", "orders", "payments", "refunds", "--partitions", "6").expect(t, "create again", 0)
	if !line("exists", "orders", "6 partitions, replication factor 3").MatchString(r.stdout) || !line("created", "refunds", "6 partitions, replication factor 3").MatchString(r.stdout) {
		t.Errorf("create again:\n%s", r.stdout)
	}
	// Another replication factor is a note: nothing changes.
	r = runCmd(ctx, env, "topics", "create", "--replication-factor", "2", "orders").expect(t, "create with another replication factor", 0)
	if !strings.Contains(r.stderr, "orders exists with replication factor 3, not 2") {
		t.Errorf("no note about the replication factor:\n%s", r.stderr)
	}
	// Another partition count is an error that says why.
	r = runCmd(ctx, env, "topics", "create", "--partitions", "3", "orders", "payments", "shipments").expect(t, "create with another partition count", 1)
	for _, want := range []string{"2 of 3 topics not as asked", "orders exists with 6 partitions, not 3", "payments exists with 6 partitions, not 3"} {
		if !strings.Contains(r.stderr, want) {
			t.Errorf("the error does not say %q:\n%s", want, r.stderr)
		}
	}
	if !line("created", "shipments", "3 partitions, replication factor 3").MatchString(r.stdout) {
		t.Errorf("the topic that could be created was not:\n%s", r.stdout)
	}
	// The brokers' defaults (4 partitions, a replica on each of the 3 brokers in this cluster)
	// when nothing is asked.
	r = runCmd(ctx, env, "topics", "create", "defaults").expect(t, "create with the defaults", 0)
	if !line("created", "defaults", "4 partitions, replication factor 3").MatchString(r.stdout) {
		t.Errorf("create with the defaults:\n%s", r.stdout)
	}
	// What the brokers refuse, with a hint.
	r = runCmd(ctx, env, "topics", "create", "--replication-factor", "5", "toomany").expect(t, "create with too many replicas", 1)
	if !strings.Contains(r.stderr, "toomany not created") || !strings.Contains(r.stderr, "at most as many replicas as there are brokers") {
		t.Errorf("too many replicas:\n%s", r.stderr)
	}

	r = runCmd(ctx, env, "topics", "list").expect(t, "list", 0)
	for _, want := range []*regexp.Regexp{line("TOPIC", "PARTITIONS", "REPLICATION"), line("orders", "6", "3"), line("refunds", "6", "3"), line("defaults", "4", "3")} {
		if !want.MatchString(r.stdout) {
			t.Errorf("list does not show %s:\n%s", want, r.stdout)
		}
	}
	r = runCmd(ctx, env, "topics", "list", "orders", "nope").expect(t, "list with a missing topic", 1)
	if !line("orders", "6", "3").MatchString(r.stdout) || !line("nope", "missing").MatchString(r.stdout) || !strings.Contains(r.stderr, "onceflow topics create") {
		t.Errorf("list with a missing topic:\nstdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	}
}

// The topics command reaches a secured cluster with the relay's flags.
func TestTopicsOverSecuredKafka(t *testing.T) {
	t.Parallel()
	s := newSecuredKafka(t)
	ctx := context.Background()
	r := runCmd(ctx, nil, append([]string{"topics", "create", "--partitions", "2", "secured"}, s.flags()...)...).expect(t, "create over mTLS and SCRAM", 0)
	if !line("created", "secured", "2 partitions, replication factor 1").MatchString(r.stdout) {
		t.Errorf("create:\n%s", r.stdout)
	}
	env := s.env()
	runCmd(ctx, env, "topics", "list", "secured").expect(t, "list over mTLS and SCRAM, from the environment", 0)

	env["ONCEFLOW_KAFKA_SASL_PASSWORD"] = "wrong-" + kafkaSecret
	r = runCmd(ctx, env, "topics", "list", "--timeout", "5s").expect(t, "list with a wrong password", 1)
	if !strings.Contains(r.stderr, "wrong user or password") || strings.Contains(r.stderr, kafkaSecret) {
		t.Errorf("list with a wrong password:\n%s", r.stderr)
	}
}

// SASL PLAIN without TLS works (a trusted network) but is warned about.
func TestTopicsWarnsAboutPlainWithoutTLS(t *testing.T) {
	t.Parallel()
	k := kafkatest.Fake(t, 1, kfake.EnableSASL(), kfake.Superuser("PLAIN", "relay", kafkaSecret))
	env := map[string]string{"KAFKA_BROKERS": strings.Join(k.Brokers(), ","), "ONCEFLOW_KAFKA_SASL_PASSWORD": kafkaSecret}
	r := runCmd(context.Background(), env, "topics", "create", "--kafka-sasl-mechanism", "plain", "--kafka-sasl-user", "relay", "plain").expect(t, "create over SASL PLAIN", 0)
	if !strings.Contains(r.stderr, "sends the Kafka password unencrypted") {
		t.Errorf("no warning about PLAIN without TLS:\n%s", r.stderr)
	}
}

func TestTopicsBadUsage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r := runCmd(ctx, nil, "topics", "create", "--partitions", "0", "--replication-factor", "-3", "--kafka-sasl-user", "u").expect(t, "create with bad settings", 1)
	for _, want := range []string{"no topic given", "--partitions 0", "--replication-factor -3", "no Kafka brokers", "no SASL.Mechanism"} {
		if !strings.Contains(r.stderr, want) {
			t.Errorf("the error does not mention %q:\n%s", want, r.stderr)
		}
	}
	runCmd(ctx, nil, "topics", "create", "--config", "novalue", "t").expect(t, "a config without a value", 2)
	runCmd(ctx, nil, "topics").expect(t, "no action", 2)
	runCmd(ctx, nil, "topics", "drop").expect(t, "unknown action", 2)
	// "--" ends the flags: what follows is a topic, even if it looks like a flag.
	fs := (&cli{stdout: &strings.Builder{}, stderr: &strings.Builder{}, getenv: func(string) string { return "" }}).newFlagSet("x", "x")
	fs.Int("partitions", 0, "")
	got, err := parseInterspersed(fs, []string{"a", "--partitions", "2", "b", "--", "-c", "--partitions"})
	if err != nil || strings.Join(got, " ") != "a b -c --partitions" {
		t.Errorf("parseInterspersed = %q, %v", got, err)
	}
}
