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
		"  so it can be killed and rerun without moving a row twice. A Watermill id that is not a\n"+
		"  UUID gets a deterministic UUIDv5 event id (the original kept in metadata); a row that\n"+
		"  cannot be moved stops the move with its offset, or is set aside with --skip-unmovable.\n"+
		"  Stop the forwarder first:\n"+
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
	fs.IntVar(&cfg.MaxPayloadBytes, "max-payload-bytes", fromforwarder.DefaultMaxPayloadBytes,
		"largest message payload moved, in `bytes` (the relay's sink must accept it too: relay --max-message-bytes)")
	fs.BoolVar(&cfg.SkipUnmovable, "skip-unmovable", false,
		"set rows that cannot be moved (not a forwarder envelope, payload over --max-payload-bytes) aside in the forwarder_move_skipped table and go on, instead of stopping at the first")
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
	if res.Remapped > 0 {
		fmt.Fprintf(c.stdout, "%d messages had a Watermill UUID that is not a canonical UUID: their event id is derived from it (UUIDv5), the original is in their metadata as %q\n",
			res.Remapped, fromforwarder.MetadataOriginalUUID)
	}
	if res.Largest > 1<<20 {
		fmt.Fprintf(c.stdout, "the largest moved payload has %d bytes: run the relay with --max-message-bytes above it (and the topic's max.message.bytes), or it parks those rows\n", res.Largest)
	}
	if len(res.Skipped) > 0 {
		verb := "set aside"
		if cfg.DryRun {
			verb = "would be set aside (--skip-unmovable) or stop the move"
		}
		fmt.Fprintf(c.stdout, "%d rows %s, kept whole in %s.forwarder_move_skipped:\n", len(res.Skipped), verb, db.schema)
		for _, sk := range res.Skipped {
			fmt.Fprintf(c.stdout, "  offset %d uuid %s: %s\n", sk.Offset, sk.UUID, sk.Reason)
		}
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
