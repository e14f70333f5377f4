package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/relay/relaykafka"
)

const topicsSynopsis = `topics create|list [flags] [TOPIC...]

  create  create the topics the outbox publishes to; a topic that exists already is
          reported, not an error, unless its partition count is not the one asked for
  list    list topics with their partitions and replication factor (all, or those named)

The relay does not create topics (unless the brokers auto-create them): rows for a topic that
does not exist wait in the outbox. Flags may come before or after the topics.`

// topicsClientID is the client id of the topics command, so broker logs tell it from a relay.
const topicsClientID = "onceflow-topics"

func (c *cli) runTopics(ctx context.Context, args []string) error {
	if len(args) == 0 {
		c.topicsUsage(c.stderr)
		return errUsage
	}
	switch args[0] {
	case "create":
		return c.topicsCreate(ctx, args[1:])
	case "list":
		return c.topicsList(ctx, args[1:])
	case "-h", "-help", "--help", "help":
		c.topicsUsage(c.stdout)
		return flag.ErrHelp
	default:
		fmt.Fprintf(c.stderr, "onceflow topics: unknown action %q\n\n", args[0])
		c.topicsUsage(c.stderr)
		return errUsage
	}
}

// topicsUsage prints the actions; each action has its own -h with its flags.
func (c *cli) topicsUsage(w io.Writer) {
	fmt.Fprintf(w, "Usage: onceflow %s\n\nRun 'onceflow topics <action> -h' for the flags of an action.\n", topicsSynopsis)
}

// configFlag is a repeatable --config name=value.
type configFlag map[string]*string

func (f configFlag) String() string { return "" }

func (f configFlag) Set(s string) error {
	name, value, ok := strings.Cut(s, "=")
	if name = strings.TrimSpace(name); !ok || name == "" {
		return fmt.Errorf("%q is not name=value, e.g. retention.ms=604800000", s)
	}
	f[name] = &value
	return nil
}

// parseInterspersed parses flags that may come before, between or after the positional
// arguments (kafka-topics.sh users write the topic first), and returns the positional ones.
// After "--" everything is positional.
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := parse(fs, args); err != nil {
			return nil, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		if consumed := len(args) - len(rest); consumed > 0 && args[consumed-1] == "--" {
			return append(pos, rest...), nil
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

// adminSession is a connected admin client and the context its requests run under.
type adminSession struct {
	adm    *kadm.Client
	cfg    relaykafka.Config
	ctx    context.Context
	cancel context.CancelFunc
}

func (s *adminSession) close() { s.cancel(); s.adm.Close() }

// openAdmin checks the command's settings — problems found so far, --timeout and the Kafka
// flags — and reports every bad one at once, or connects an admin client whose requests are
// bounded by timeout (and warns about PLAIN without TLS).
func (c *cli) openAdmin(ctx context.Context, k *kafkaFlags, problems []string, timeout time.Duration) (*adminSession, error) {
	if timeout <= 0 {
		problems = append(problems, fmt.Sprintf("--timeout %s: use a positive duration", timeout))
	}
	cfg, kproblems := k.config()
	opts, err := cfg.ClientOpts()
	problems = appendProblems(append(problems, kproblems...), err)
	if len(problems) > 0 {
		return nil, fmt.Errorf("invalid settings:\n  - %s", strings.Join(problems, "\n  - "))
	}
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return nil, fmt.Errorf("create Kafka client: %w", err)
	}
	if k.plainWithoutTLS() {
		fmt.Fprintln(c.stderr, "warning: "+plainWithoutTLSWarning)
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	return &adminSession{adm: kadm.NewClient(cl), cfg: cfg, ctx: ctx, cancel: cancel}, nil
}

func (c *cli) topicsCreate(ctx context.Context, args []string) error {
	fs := c.newFlagSet("topics create", `topics create [flags] TOPIC...

Creates the topics with the partitions, replication factor and configs given. A topic that
exists already is reported and left as it is; if its partition count is not --partitions,
that is an error (exit 1): the partition a key maps to depends on the count. Choose the count
up front: it bounds how many consumers of a group share the topic, and adding partitions
later moves keys to other partitions.`)
	env := envParser{getenv: c.getenv}
	kafka := c.addKafkaFlags(fs, &env, topicsClientID)
	partitions := fs.Int("partitions", -1, "partitions per topic (default: the brokers' num.partitions)")
	replication := fs.Int("replication-factor", -1, "replicas of every partition, at most the number of brokers; 3 for production (default: the brokers' default.replication.factor)")
	configs := configFlag{}
	fs.Var(configs, "config", "topic config `name=value`, repeatable, e.g. --config retention.ms=604800000 --config min.insync.replicas=2")
	timeout := fs.Duration("timeout", 30*time.Second, "how long to wait for the brokers")
	topics, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	topics = dedupe(topics)
	problems := env.problems
	if len(topics) == 0 {
		problems = append(problems, "no topic given: onceflow topics create [flags] TOPIC...")
	}
	if *partitions == 0 || *partitions < -1 || *partitions > math.MaxInt32 {
		problems = append(problems, fmt.Sprintf("--partitions %d: use 1 or more (or -1 for the brokers' default)", *partitions))
	}
	if *replication == 0 || *replication < -1 || *replication > math.MaxInt16 {
		problems = append(problems, fmt.Sprintf("--replication-factor %d: use 1 to the number of brokers (or -1 for the brokers' default)", *replication))
	}
	sess, err := c.openAdmin(ctx, kafka, problems, *timeout)
	if err != nil {
		return err
	}
	defer sess.close()
	adm, cfg, ctx := sess.adm, sess.cfg, sess.ctx

	resps, err := adm.CreateTopics(ctx, int32(*partitions), int16(*replication), configs, topics...)
	if err != nil {
		return fmt.Errorf("create topics: %w", cfg.Explain(err))
	}
	var existing []string
	for _, r := range resps {
		if errors.Is(r.Err, kerr.TopicAlreadyExists) {
			existing = append(existing, r.Topic)
		}
	}
	var details kadm.TopicDetails
	if len(existing) > 0 {
		if details, err = adm.ListTopics(ctx, existing...); err != nil {
			return fmt.Errorf("describe the existing topics: %w", cfg.Explain(err))
		}
	}

	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	var failed []string
	for _, t := range topics {
		r, ok := resps[t]
		switch {
		case !ok:
			failed = append(failed, fmt.Sprintf("%s: the brokers did not answer for it; run the command again", t))
		case r.Err == nil && r.NumPartitions <= 0: // brokers before Kafka 2.4 do not say
			fmt.Fprintf(tw, "created\t%s\t\n", t)
		case r.Err == nil:
			fmt.Fprintf(tw, "created\t%s\t%s\n", t, shape(int(r.NumPartitions), int(r.ReplicationFactor)))
		case errors.Is(r.Err, kerr.TopicAlreadyExists):
			d := details[t]
			if d.Err != nil {
				failed = append(failed, fmt.Sprintf("%s exists, but describing it failed: %v", t, d.Err))
				continue
			}
			parts, rf := len(d.Partitions), replicationFactor(d)
			fmt.Fprintf(tw, "exists\t%s\t%s\n", t, shape(parts, rf))
			if *partitions > 0 && parts != *partitions {
				failed = append(failed, fmt.Sprintf("%s exists with %d partitions, not %d: Kafka cannot remove partitions, and adding some moves keys to other partitions (order is kept per partition); keep %d, or create a topic with another name", t, parts, *partitions, parts))
			}
			if *replication > 0 && rf != *replication {
				fmt.Fprintf(c.stderr, "note: %s exists with replication factor %d, not %d; this command changes nothing about an existing topic\n", t, rf, *replication)
			}
		default:
			msg := r.Err.Error()
			if r.ErrMessage != "" {
				msg += " (" + r.ErrMessage + ")"
			}
			failed = append(failed, fmt.Sprintf("%s not created: %s%s", t, msg, createHint(r.Err)))
		}
	}
	_ = tw.Flush() // a closed stdout: nothing left to tell
	if len(failed) > 0 {
		return fmt.Errorf("%d of %d topics not as asked:\n  - %s", len(failed), len(topics), strings.Join(failed, "\n  - "))
	}
	return nil
}

// createHint says what to do about a topic the brokers refused to create.
func createHint(err error) string {
	switch {
	case errors.Is(err, kerr.InvalidReplicationFactor):
		return "; use at most as many replicas as there are brokers (--replication-factor)"
	case errors.Is(err, kerr.InvalidPartitions):
		return "; use --partitions 1 or more"
	case errors.Is(err, kerr.InvalidTopicException):
		return "; topic names are 1 to 249 ASCII letters, digits, '.', '_' and '-'"
	case errors.Is(err, kerr.InvalidConfig):
		return "; check the --config names and values"
	case errors.Is(err, kerr.TopicAuthorizationFailed), errors.Is(err, kerr.ClusterAuthorizationFailed):
		return "; the user needs the CREATE permission on the topic or the cluster"
	}
	return ""
}

func (c *cli) topicsList(ctx context.Context, args []string) error {
	fs := c.newFlagSet("topics list", `topics list [flags] [TOPIC...]

Lists the topics (all but Kafka's internal ones, or those named) with their partition count
and replication factor. A named topic that does not exist is listed as missing (exit 1).`)
	env := envParser{getenv: c.getenv}
	kafka := c.addKafkaFlags(fs, &env, topicsClientID)
	timeout := fs.Duration("timeout", 30*time.Second, "how long to wait for the brokers")
	topics, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	problems := env.problems
	sess, err := c.openAdmin(ctx, kafka, problems, *timeout)
	if err != nil {
		return err
	}
	defer sess.close()
	adm, cfg, ctx := sess.adm, sess.cfg, sess.ctx
	details, err := adm.ListTopics(ctx, topics...)
	if err != nil {
		return fmt.Errorf("list topics: %w", cfg.Explain(err))
	}
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "TOPIC\tPARTITIONS\tREPLICATION")
	var missing []string
	for _, name := range details.Names() {
		d := details[name]
		switch {
		case errors.Is(d.Err, kerr.UnknownTopicOrPartition):
			missing = append(missing, name)
			fmt.Fprintf(tw, "%s\tmissing\t\n", name)
		case d.Err != nil:
			fmt.Fprintf(tw, "%s\t%v\t\n", name, d.Err)
		default:
			fmt.Fprintf(tw, "%s\t%d\t%d\n", name, len(d.Partitions), replicationFactor(d))
		}
	}
	_ = tw.Flush() // a closed stdout: nothing left to tell
	if len(missing) > 0 {
		return fmt.Errorf("%d topics do not exist: %s; create them with onceflow topics create", len(missing), strings.Join(missing, ", "))
	}
	return nil
}

// replicationFactor is the replica count of the topic's first partition (Kafka gives every
// partition of a topic the same count unless someone reassigned them by hand).
func replicationFactor(d kadm.TopicDetail) int {
	for _, p := range d.Partitions.Sorted() {
		return len(p.Replicas)
	}
	return 0
}

func shape(partitions, replication int) string {
	return fmt.Sprintf("%d partitions, replication factor %d", partitions, replication)
}

// dedupe keeps the first occurrence of every name, in order.
func dedupe(names []string) []string {
	seen := map[string]bool{}
	var out []string
	for _, n := range names {
		if !seen[n] {
			seen[n] = true
			out = append(out, n)
		}
	}
	return out
}
