package inbox

// WaitingForConn is the number of messages waiting for a connection slot of the inbox's pool.
func WaitingForConn(ib *Inbox) int { return int(ib.slots.waiting.Load()) }
