package platform

import (
	"context"
	"fmt"
	"os"
	"strings"

	"github.com/onceflow/onceflow/onceflowtest"
)

// The only file of the examples that starts embedded servers, through onceflowtest — the
// package a user's own tests use: a throwaway PostgreSQL cluster from the installed binaries
// (as the postgres user when running as root) and kfake.

// Embedded is what StartEmbedded started.
type Embedded struct {
	// DatabaseURL is DATABASE_URL, or a throwaway database on an embedded cluster.
	DatabaseURL string
	// Brokers are KAFKA_BROKERS, or the in-process Kafka's.
	Brokers []string
	// StartedDB and StartedKafka say which of them were started here.
	StartedDB, StartedKafka bool

	env *onceflowtest.Env
}

// StartEmbedded uses DATABASE_URL and KAFKA_BROKERS when they are set (as they are, with no
// database or topic of its own) and starts what is missing: a throwaway PostgreSQL and an
// in-process Kafka whose topics get Partitions partitions (the examples create theirs, as in
// production). Stop removes what it started.
func StartEmbedded(ctx context.Context) (*Embedded, error) {
	e := &Embedded{DatabaseURL: os.Getenv("DATABASE_URL"), Brokers: splitBrokers(os.Getenv("KAFKA_BROKERS"))}
	e.StartedDB, e.StartedKafka = e.DatabaseURL == "", e.Brokers == nil
	if !e.StartedDB && !e.StartedKafka {
		return e, nil
	}
	env, err := onceflowtest.Start(ctx, onceflowtest.Options{
		NoDB:    !e.StartedDB,
		NoKafka: !e.StartedKafka,
		Kafka:   onceflowtest.KafkaOptions{Partitions: Partitions},
	})
	if err != nil {
		return nil, err
	}
	e.env = env
	if e.StartedDB {
		e.DatabaseURL = env.DatabaseURL
	}
	if e.StartedKafka {
		e.Brokers = env.Brokers
	}
	return e, nil
}

// Stop stops the embedded servers, if any.
func (e *Embedded) Stop() {
	if e.env == nil {
		return
	}
	if err := e.env.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "stop the embedded servers:", err)
	}
	e.env = nil
}

// splitBrokers splits a comma-separated broker list; nil when it is empty.
func splitBrokers(s string) []string {
	if s == "" {
		return nil
	}
	return strings.Split(s, ",")
}
