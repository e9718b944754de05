package sqlbroker_test

import (
	"os"
	"testing"

	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

func TestMain(m *testing.M) {
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
