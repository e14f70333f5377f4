package main

import (
	"context"
	"fmt"
	"log/slog"
	"sort"
	"time"

	"github.com/onceflow/onceflow/outbox/fromforwarder"
)

// runFromForwarder is `onceflow migrate from-forwarder`: fromforwarder.Move with flags.
func (c *cli) runFromForwarder(ctx context.Context, args []string) error {
	fs := c.newFlagSet("migrate from-forwarder", "migrate from-forwarder [flags]\n\n"+
		"  Move the messages still pending in a Watermill forwarder's watermill-sql table into\n"+
		"  onceflow's outbox: same UUIDs, payloads, metadata and destination topics, partition\n"+
		"  keys from the envelope's metadata, in the forwarder's order; batch by batch, each in\n"+
		"  one transaction that also advances the forwarder's offset (or acks the queue rows),\n"+
		"  so it can be killed and rerun without moving a row twice. Stop the forwarder first:\n"+
		"  it refuses to run while another session uses the forwarder's tables (--force to\n"+
		"  override): a session reading its offsets table, or the table's scan counters\n"+
		"  (pg_stat_all_tables) rising over --check-window. Exit status 0 when the table is drained, 1 on errors (rerun continues).\n"+
		"  See docs/operations.md, \"Moving from Watermill's forwarder to the relay\".")
	db := c.addDBFlags(fs)
	var cfg fromforwarder.Config
	fs.StringVar(&cfg.Adapter, "adapter", fromforwarder.AdapterDefault, "watermill-sql schema adapter of the forwarder's table: default (DefaultPostgreSQLSchema) or queue (PostgreSQLQueueSchema)")
	fs.StringVar(&cfg.Topic, "topic", fromforwarder.DefaultTopic, "the forwarder's SQL topic (forwarder.Config.ForwarderTopic); names the default tables")
	fs.StringVar(&cfg.Table, "table", "", "messages `table` as written in SQL, when the forwarder set GenerateMessagesTableName (default \"watermill_<topic>\")")
	fs.StringVar(&cfg.OffsetsTable, "offsets-table", "", "offsets `table` of the default adapter (default \"watermill_offsets_<topic>\")")
	fs.StringVar(&cfg.ConsumerGroup, "consumer-group", "", "the forwarder subscriber's consumer group (default adapter)")
	fs.StringVar(&cfg.PartitionKeyMetadata, "partition-key-metadata", "partition_key", "envelope metadata `key` holding the message's Kafka key")
	fs.IntVar(&cfg.BatchSize, "batch-size", fromforwarder.DefaultBatchSize, "rows per transaction (1-10000)")
	fs.BoolVar(&cfg.Delete, "delete", false, "queue adapter: delete moved rows instead of marking them acked (no rollback then)")
	fs.BoolVar(&cfg.DryRun, "dry-run", false, "print what would be moved and change nothing")
	fs.BoolVar(&cfg.Force, "force", false, "skip the check for a running forwarder")
	fs.DurationVar(&cfg.CheckWindow, "check-window", fromforwarder.DefaultCheckWindow,
		"how long to watch the forwarder's table for a polling subscriber before moving")
	fs.DurationVar(&cfg.WaitOpenTransactions, "wait-open-transactions", fromforwarder.DefaultWaitOpenTxns,
		"how long to wait for transactions open at the start (they may still commit rows into the table); negative: do not wait")
	verbose := fs.Bool("v", false, "log each batch on stderr")
	if err := parse(fs, args); err != nil {
		return err
	}
	cfg.Schema = db.schema
	if *verbose {
		cfg.Logger = slog.New(slog.NewTextHandler(c.stderr, nil))
	}
	pool, err := db.connectMigrated(ctx, "onceflow-migrate-from-forwarder")
	if err != nil {
		return err
	}
	defer pool.Close()
	start := time.Now()
	res, err := fromforwarder.Move(ctx, pool, cfg)
	verb := "moved"
	if cfg.DryRun {
		verb = "would move"
	}
	fmt.Fprintf(c.stdout, "%s %d messages in %d batches (%s) into schema %q", verb, res.Moved, res.Batches, time.Since(start).Round(time.Millisecond), db.schema)
	if res.Moved > 0 {
		fmt.Fprintf(c.stdout, ", %d partition keys, first uuid %s, last uuid %s", res.Keys, res.FirstID, res.LastID)
	}
	fmt.Fprintln(c.stdout)
	if res.TotalMoved > 0 {
		fmt.Fprintf(c.stdout, "moved from this table so far, over every run: %d messages\n", res.TotalMoved)
	}
	if res.HeldBack > 0 {
		fmt.Fprintf(c.stdout, "%d more rows wait behind transactions still open (the move waits up to --wait-open-transactions for them)\n", res.HeldBack)
	}
	topics := make([]string, 0, len(res.Topics))
	for t := range res.Topics {
		topics = append(topics, t)
	}
	sort.Strings(topics)
	for _, t := range topics {
		fmt.Fprintf(c.stdout, "  %-40s %d\n", t, res.Topics[t])
	}
	if (cfg.Adapter == fromforwarder.AdapterDefault || cfg.Adapter == "") && res.Start.TransactionID != "" {
		fmt.Fprintf(c.stdout, "forwarder position: before the first move (transaction %s, offset %d), now (transaction %s, offset %d)\n",
			res.Start.TransactionID, res.Start.Offset, res.End.TransactionID, res.End.Offset)
	}
	if res.RollbackSQL != "" && res.TotalMoved > 0 {
		fmt.Fprintf(c.stdout, "way back to the forwarder (docs/operations.md, Rollback): stop the relays, then\n  %s\n", res.RollbackSQL)
	}
	return err
}
