// Package chaos runs consumer processes of one consumer group as real OS processes, publishes
// to them, injects faults (SIGKILL and restart, pg_terminate_backend of the library's
// connections, a long transaction holding the xmin horizon back, a tiny pool, handlers that
// panic, time out and nack) and checks the totals: nothing lost, duplicates explained, no lock
// and no connection of the library left; in lease mode, a group ordered by key keeps its order
// (ordercheck_test.go). See chaos_test.go, and ordered_test.go for four ordered processes, one
// of them killed.
package chaos

import (
	"os"
	"testing"

	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

func TestMain(m *testing.M) {
	// The test binary is also the consumer program: TestChaos starts it again with this
	// variable set, and it then runs one consumer instead of the tests.
	if os.Getenv(envConsumer) != "" {
		os.Exit(runConsumer())
	}
	code := m.Run()
	testdb.Close()
	if code == 0 {
		if err := testdb.LeakCheck(); err != nil {
			os.Stderr.WriteString("goroutines leaked: " + err.Error() + "\n")
			code = 1
		}
	}
	os.Exit(code)
}
