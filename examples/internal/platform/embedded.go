package platform

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/onceflow/onceflow/internal/embedded"
	"github.com/onceflow/onceflow/onceflowtest"
)

// The only file of the examples that starts embedded servers, through onceflowtest — the
// package a user's own tests use: a throwaway PostgreSQL cluster from the installed binaries
// (as the postgres user when running as root) and kfake. `make demo-ha`'s primary and standby
// come from internal/embedded, as internal/hatest's do: onceflowtest has no standby.

// Embedded is what StartEmbedded started.
type Embedded struct {
	// DatabaseURL is DATABASE_URL, or a throwaway database on an embedded cluster.
	DatabaseURL string
	// Brokers are KAFKA_BROKERS, or the in-process Kafka's.
	Brokers []string
	// StartedDB and StartedKafka say which of them were started here.
	StartedDB, StartedKafka bool

	env              *onceflowtest.Env
	primary, standby *embedded.Postgres // StartEmbeddedPair's
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

// StartEmbeddedPair is StartEmbedded with PostgreSQL as a highly available pair: a primary
// and a synchronous streaming standby (pg_basebackup -R; a commit is acknowledged once the
// standby has it, as with Patroni's synchronous_mode), and DatabaseURL naming both with
// target_session_attrs=read-write, so that clients follow Failover by reconnecting. It refuses
// DATABASE_URL: a failover of a server it did not start is not its to cause.
func StartEmbeddedPair(ctx context.Context) (*Embedded, error) {
	if os.Getenv("DATABASE_URL") != "" {
		return nil, errors.New("DATABASE_URL is set: the HA demo starts its own primary and standby to fail over; unset it")
	}
	primary, err := embedded.StartPostgres(ctx, embedded.PostgresOptions{CrashSafe: true})
	if err != nil {
		return nil, err
	}
	e := &Embedded{primary: primary, StartedDB: true}
	if e.standby, err = primary.StartStandby(ctx, embedded.StandbyOptions{Name: "standby"}); err != nil {
		e.Stop()
		return nil, err
	}
	if err := primary.SetSynchronousStandby(ctx, "standby"); err != nil {
		e.Stop()
		return nil, err
	}
	e.DatabaseURL = embedded.MultiHostURL(primary, e.standby)
	if e.Brokers = splitBrokers(os.Getenv("KAFKA_BROKERS")); e.Brokers != nil {
		return e, nil
	}
	if e.env, err = onceflowtest.Start(ctx, onceflowtest.Options{NoDB: true, Kafka: onceflowtest.KafkaOptions{Partitions: Partitions}}); err != nil {
		e.Stop()
		return nil, err
	}
	e.Brokers, e.StartedKafka = e.env.Brokers, true
	return e, nil
}

// Failover kills StartEmbeddedPair's primary (pg_ctl stop -m immediate: no checkpoint, its
// connections cut) and promotes the standby, as Patroni would after its leader key expired;
// clients on DatabaseURL reconnect to the new primary. The old primary is not started again.
func (e *Embedded) Failover(ctx context.Context) error {
	if e.primary == nil || e.standby == nil {
		return errors.New("no standby to fail over to: start the servers with StartEmbeddedPair")
	}
	if err := e.primary.Halt(ctx); err != nil {
		return err
	}
	return e.standby.Promote(ctx)
}

// Stop stops the embedded servers, if any.
func (e *Embedded) Stop() {
	if e.env != nil {
		if err := e.env.Close(); err != nil {
			fmt.Fprintln(os.Stderr, "stop the embedded servers:", err)
		}
		e.env = nil
	}
	for _, pg := range []*embedded.Postgres{e.standby, e.primary} {
		if pg != nil {
			if err := pg.Stop(); err != nil {
				fmt.Fprintln(os.Stderr, "stop the embedded PostgreSQL:", err)
			}
		}
	}
	e.primary, e.standby = nil, nil
}

// splitBrokers splits a comma-separated broker list; nil when it is empty.
func splitBrokers(s string) []string {
	if s == "" {
		return nil
	}
	return strings.Split(s, ",")
}
