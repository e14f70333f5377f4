package saga

// ResultSQL is the statement a participant reads its actions' results with.
func ResultSQL(p *Participant) string { return p.resultSQL }

// ParkedClaimSQL is the statement an orchestrator claims parked replies with.
func ParkedClaimSQL(o *Orchestrator) string { return o.st.park.claim }

// TimerClaimSQL is the statement an orchestrator claims due timers with.
func TimerClaimSQL(o *Orchestrator) string { return o.st.claimTimers }
