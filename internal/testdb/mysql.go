package testdb

import (
	"database/sql"
	"net/url"
	"os"
	"sync"
	"testing"

	"github.com/go-sql-driver/mysql" // the MySQL driver under test
)

// DefaultMySQLDSN is the MySQL or MariaDB test database when SQLBROKER_TEST_MYSQL_DSN is not
// set (the driver's DSN form).
const DefaultMySQLDSN = "root@tcp(127.0.0.1:3306)/test?interpolateParams=true"

// MySQLDSN is the MySQL test database's DSN; "off" skips the MySQL tests (.ci/testenv.sh sets
// it when no server answers at the default address, outside CI).
func MySQLDSN() string {
	if d := os.Getenv("SQLBROKER_TEST_MYSQL_DSN"); d != "" {
		return d
	}
	return DefaultMySQLDSN
}

var (
	mysqlOnce sync.Once
	mysqlDB   *sql.DB
	mysqlErr  error
)

// MySQL returns a pool of the MySQL test database shared by the tests of a package (closed
// by Close).
func MySQL(t testing.TB) *sql.DB {
	t.Helper()
	if MySQLDSN() == "off" {
		t.Skip("SQLBROKER_TEST_MYSQL_DSN=off: no MySQL test database")
	}
	mysqlOnce.Do(func() { mysqlDB, mysqlErr = openShared("mysql", MySQLDSN(), 60) })
	if mysqlErr != nil {
		t.Fatalf("MySQL test database %s: %v (start it, or set SQLBROKER_TEST_MYSQL_DSN)", MySQLDSN(), mysqlErr)
	}
	return mysqlDB
}

// MySQLURL is the MySQL test database as a mysql:// URL for Open.
func MySQLURL(t testing.TB) string {
	t.Helper()
	d := MySQLDSN()
	if d == "off" {
		t.Skip("SQLBROKER_TEST_MYSQL_DSN=off: no MySQL test database")
	}
	cfg, err := mysql.ParseDSN(d)
	if err != nil {
		t.Fatalf("SQLBROKER_TEST_MYSQL_DSN: %v", err)
	}
	u := url.URL{Scheme: "mysql", Host: cfg.Addr, Path: "/" + cfg.DBName}
	if cfg.Passwd != "" {
		u.User = url.UserPassword(cfg.User, cfg.Passwd)
	} else {
		u.User = url.User(cfg.User)
	}
	return u.String()
}
