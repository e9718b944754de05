//go:build !race

package tests

// raceEnabled is true when the tests run under the race detector.
const raceEnabled = false
