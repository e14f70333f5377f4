// Package hatest holds onceflow's tests on a highly available PostgreSQL: a primary and a
// streaming standby (testdb.NewPair), every component on one multi-host URL
// (target_session_attrs=read-write), the primary killed under load and the standby promoted.
// It has no code of its own; see failover_test.go for what is asserted and measured.
package hatest
