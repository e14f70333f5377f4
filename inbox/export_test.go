package inbox

// WaitingForConn is the number of messages waiting for a connection slot of the inbox's pool.
func WaitingForConn(ib *Inbox) int { return int(ib.slots.waiting.Load()) }

// SeenManySQL is the statement SeenManyTx runs.
func SeenManySQL(ib *Inbox) string { return ib.seenManySQL }
