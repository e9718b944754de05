package sqlbroker_test

import (
	"testing"

	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m, closeTakeAwayPool) }
