//go:build race

package relay_test

// raceEnabled tells process tests to build the onceflow binary with -race too: the race
// runtime's packages are already compiled for this test binary, and the child then checks
// the relay for data races under real crashes as well.
const raceEnabled = true
