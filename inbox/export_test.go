package inbox

// WaitingForConn is the number of transactions waiting for a connection slot of the inbox's pool.
func WaitingForConn(ib *Inbox) int { return ib.run.WaitingForSlot() }
