package platform

import (
	"context"
	"fmt"
	"os"

	"github.com/onceflow/onceflow/internal/embedded"
)

// The only file of the examples that starts embedded servers: a throwaway PostgreSQL cluster
// from the installed binaries (as the postgres user when running as root) and kfake.

// StartPostgres starts a durable throwaway cluster and returns its URL and a stop function
// that removes it.
func StartPostgres(ctx context.Context) (string, func(), error) {
	pg, err := embedded.StartPostgres(ctx, embedded.PostgresOptions{Durable: true})
	if err != nil {
		return "", nil, err
	}
	return pg.URL(), func() {
		if err := pg.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "stop embedded postgres:", err)
		}
	}, nil
}

// StartKafka starts kfake with Partitions partitions per auto-created topic and returns its
// broker addresses and a stop function.
func StartKafka() ([]string, func(), error) {
	k, err := embedded.StartKafka(Partitions)
	if err != nil {
		return nil, nil, err
	}
	return k.Brokers(), k.Stop, nil
}
