package relaykafka

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

// Settings a topic needs so that an acknowledged write survives the loss of a broker; see
// CheckDurability.
const (
	// MinReplicationFactor is the replication factor a topic needs to keep accepting writes
	// (with MinInSyncReplicas) while one broker is down.
	MinReplicationFactor = 3
	// MinInSyncReplicas is the min.insync.replicas a topic needs so that acks=all means "on
	// at least two brokers": with 1, a leader whose followers fell out of sync acknowledges
	// alone, and losing it loses the acknowledged rows, already deleted from the outbox.
	MinInSyncReplicas = 2
)

// durabilityCheckTimeout bounds the check the sink starts for each new topic.
const durabilityCheckTimeout = 10 * time.Second

// CheckDurability reads what a client without admin rights may read about topics — their
// replication factor (metadata) and their min.insync.replicas and
// unclean.leader.election.enable (DescribeConfigs on the topic) — and returns one warning per
// setting under which an acknowledged row can be lost when a broker fails, or writes stop,
// each naming the fix. Development clusters of one broker have replication factor 1, so these
// are warnings, not refusals: the sink logs them once per topic, after the topic's first
// acknowledged write (Config.Logger). A topic that does not exist and configs the broker does
// not let the relay read are reported as warnings too. The error is for a cluster that does
// not answer. It creates a client of its own for the check, and never creates a topic.
func (s *Sink) CheckDurability(ctx context.Context, topics ...string) ([]string, error) {
	// A client of its own: the producer's asks the broker to create the topics it looks up.
	cl, err := kgo.NewClient(s.adminOpts...)
	if err != nil {
		return nil, fmt.Errorf("relaykafka: %w", err)
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	td, err := adm.ListTopics(ctx, topics...)
	if err != nil {
		return nil, fmt.Errorf("relaykafka: read the topics' metadata: %w", err)
	}
	var warns []string
	var existing []string
	for _, t := range topics {
		d, ok := td[t]
		switch {
		case !ok || errors.Is(d.Err, kerr.UnknownTopicOrPartition):
			warns = append(warns, fmt.Sprintf("topic %s does not exist: create it with replication factor %d and min.insync.replicas=%d (onceflow topics create)", t, MinReplicationFactor, MinInSyncReplicas))
			continue
		case d.Err != nil:
			warns = append(warns, fmt.Sprintf("topic %s: metadata not readable (%v): check its replication factor (≥ %d) yourself", t, d.Err, MinReplicationFactor))
			continue
		}
		existing = append(existing, t)
		rf := -1
		for _, p := range d.Partitions {
			if rf < 0 || len(p.Replicas) < rf {
				rf = len(p.Replicas)
			}
		}
		if rf >= 0 && rf < MinReplicationFactor {
			warns = append(warns, fmt.Sprintf("topic %s has replication factor %d: with fewer than %d replicas, losing a broker loses acknowledged events or stops writes to the topic; reassign its partitions to %d replicas (kafka-reassign-partitions.sh)", t, rf, MinReplicationFactor, MinReplicationFactor))
		}
	}
	if len(existing) == 0 {
		return warns, nil
	}
	rcs, err := adm.DescribeTopicConfigs(ctx, existing...)
	if err != nil && len(rcs) == 0 {
		for _, t := range existing {
			warns = append(warns, fmt.Sprintf("topic %s: configs not readable (%v): check min.insync.replicas ≥ %d and unclean.leader.election.enable=false yourself", t, err, MinInSyncReplicas))
		}
		return warns, nil
	}
	for _, rc := range rcs {
		if rc.Err != nil {
			warns = append(warns, fmt.Sprintf("topic %s: configs not readable (%v): check min.insync.replicas ≥ %d and unclean.leader.election.enable=false yourself", rc.Name, rc.Err, MinInSyncReplicas))
			continue
		}
		for _, c := range rc.Configs {
			if c.Value == nil {
				continue
			}
			switch c.Key {
			case "min.insync.replicas":
				if n, err := strconv.Atoi(*c.Value); err == nil && n < MinInSyncReplicas {
					warns = append(warns, fmt.Sprintf("topic %s has min.insync.replicas=%d: acks=all is then satisfied by the leader alone, and losing it loses acknowledged events; set it to %d (kafka-configs.sh --alter --entity-type topics --entity-name %s --add-config min.insync.replicas=%d)", rc.Name, n, MinInSyncReplicas, rc.Name, MinInSyncReplicas))
				}
			case "unclean.leader.election.enable":
				if strings.EqualFold(*c.Value, "true") {
					warns = append(warns, fmt.Sprintf("topic %s has unclean.leader.election.enable=true: a replica that missed acknowledged events can become leader and drop them; set it to false", rc.Name))
				}
			}
		}
	}
	return warns, nil
}

// checkNewTopics starts a durability check of each topic the sink has not checked yet, in the
// background; its warnings go to Config.Logger. Close stops and waits for the checks.
func (s *Sink) checkNewTopics(topics map[string]bool) {
	for t := range topics {
		if _, done := s.checked.LoadOrStore(t, true); done {
			continue
		}
		s.bg.Go(func() {
			ctx, cancel := context.WithTimeout(s.bgCtx, durabilityCheckTimeout)
			defer cancel()
			warns, err := s.CheckDurability(ctx, t)
			if err != nil {
				s.logger.Debug("relaykafka: topic durability not checked", "topic", t, "err", err)
				s.checked.Delete(t) // try again with a later batch
				return
			}
			for _, w := range warns {
				s.logger.Warn("Kafka topic settings can lose acknowledged events", "topic", t, "problem", w)
			}
		})
	}
}
