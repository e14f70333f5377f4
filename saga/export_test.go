package saga

// ResultSQL is the statement a participant reads its actions' results with.
func ResultSQL(p *Participant) string { return p.resultSQL }
