package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

func sqlbrokerCmd(t *testing.T, env map[string]string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = run(context.Background(), args, &out, &errb, func(k string) string { return env[k] })
	return code, out.String(), errb.String()
}

func TestRedactURL(t *testing.T) {
	for _, c := range []struct{ in, secret string }{
		{"postgres://bob:hunter2@db:5432/app?sslmode=require", "hunter2"},
		{"libpq+postgres://bob:p%40ss%2Fw@db/app", "p%40ss%2Fw"},
		{"postgres://bob:p@ss/w#rd@db/app", "p@ss/w#rd"},
		{"postgres://bob@db/app?sslmode=verify-full&sslpassword=keypass&x=1", "keypass"},
		{"postgres://bob@db/app?password=inquery", "inquery"},
		{"host=db user=bob password=hunter2 dbname=app", "hunter2"},
		{"host=db user=bob password = 'two words' dbname=app", "two words"},
		{"host=db sslpassword=keypass password=pw2", "keypass"},
	} {
		got := redactURL(c.in)
		assert.NotContains(t, got, c.secret, c.in)
		assert.Contains(t, got, "xxxxx", c.in)
		assert.Contains(t, got, "db", c.in)
	}
	assert.Equal(t, "postgres://bob@db/app", redactURL("postgres://bob@db/app"))
	// Decoded forms echoed by a driver are removed as well.
	assert.Equal(t, "auth failed for xxxxx", redact("auth failed for p@ss/w", "postgres://bob:p%40ss%2Fw@db/app"))
}

// Errors name the topic or group and never print the password.
func TestCommand_errorsHideThePassword(t *testing.T) {
	code, _, stderr := sqlbrokerCmd(t, map[string]string{"DATABASE_URL": "postgres://bob:hunter2@127.0.0.1:1/app?sslmode=disable&connect_timeout=2"}, "inspect")
	assert.Equal(t, 1, code)
	assert.NotContains(t, stderr, "hunter2")
	assert.Contains(t, stderr, "bob:xxxxx@127.0.0.1:1")

	code, _, stderr = sqlbrokerCmd(t, nil, "group", "delete", "no-such-topic-x", "g", "-url", testdb.URL())
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, `"no-such-topic-x"`)

	code, _, stderr = sqlbrokerCmd(t, nil, "group", "reset", "t", "g", "-url", testdb.URL())
	assert.Equal(t, 2, code, "neither -offset nor -time")
	assert.Contains(t, stderr, "-offset")
}

// inspect shows every group of the topic with the figures Admin reads, as a table and as JSON.
func TestCommand_inspect(t *testing.T) {
	t.Parallel()
	f := testdb.NewFixture(t)
	env := map[string]string{"SQLBROKER_URL": testdb.URL()}
	code, out, stderr := sqlbrokerCmd(t, env, "inspect", "-topic", f.Topic)
	require.Equal(t, 0, code, stderr)
	lines := strings.Split(out, "\n")
	require.GreaterOrEqual(t, len(lines), 3)
	assert.Equal(t, []string{"TOPIC", "GROUP", "OFFSET", "LAG", "IN", "WORK", "WAITING", "DUE", "PARKED", "HELD", "BACK", "OLDEST", "UNSETTLED", "MOVED"}, strings.Fields(lines[0]))
	ahead := strings.Fields(lines[1])
	behind := strings.Fields(lines[2])
	assert.Equal(t, []string{f.Topic, "ahead", "6", "4", "3", "1", "2"}, ahead[:7])
	assert.Equal(t, []string{f.Topic, "behind", "0", "10", "0", "0", "0"}, behind[:7])
	assert.Contains(t, out, "leased until")
	assert.Contains(t, out, "nacked, due again in")
	assert.Contains(t, out, "lease ran out")
	assert.Contains(t, out, "xmin horizon:")

	code, out, stderr = sqlbrokerCmd(t, env, "inspect", "-topic", f.Topic, "-json", "-claims", "0")
	require.Equal(t, 0, code, stderr)
	var ins sqlbroker.Inspection
	require.NoError(t, json.Unmarshal([]byte(out), &ins))
	require.Len(t, ins.Topics, 1)
	require.Len(t, ins.Topics[0].Groups, 2)
	assert.Equal(t, int64(10), ins.Topics[0].Groups[1].Lag)
	assert.Equal(t, int64(3), ins.Topics[0].Groups[0].InWork)
}

// group reset moves the group's position, group delete drops it, retention then deletes what
// it held back; schema prints the library's DDL.
func TestCommand_groupResetDeleteRetention(t *testing.T) {
	t.Parallel()
	f := testdb.NewFixture(t)
	url := []string{"-url", testdb.URL()}
	position := func(group string) int64 {
		return f.Int(t, `SELECT last_offset FROM `+f.Tables.Groups+` WHERE consumer_group = $1`, group)
	}

	code, out, stderr := sqlbrokerCmd(t, nil, append([]string{"group", "reset", f.Topic, "ahead", "-offset", "2"}, url...)...)
	require.Equal(t, 0, code, stderr)
	assert.Contains(t, out, "offset 2")
	assert.Equal(t, int64(1), position("ahead"))
	assert.Equal(t, int64(0), f.Int(t, `SELECT count(*) FROM `+f.Tables.Claims))

	code, _, stderr = sqlbrokerCmd(t, nil, append([]string{"group", "reset", f.Topic, "nobody", "-offset", "2"}, url...)...)
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, `consumer group "nobody"`)
	assert.Contains(t, stderr, f.Topic)

	code, out, stderr = sqlbrokerCmd(t, nil, append([]string{"retention", f.Topic, "-json", "-older-than", "0"}, url...)...)
	require.Equal(t, 0, code, stderr)
	assert.Contains(t, out, `"deleted": 0`, "the behind group holds every message")

	code, out, stderr = sqlbrokerCmd(t, nil, append([]string{"group", "delete", f.Topic, "behind"}, url...)...)
	require.Equal(t, 0, code, stderr)
	assert.Contains(t, out, `consumer group "behind" deleted`)

	code, out, stderr = sqlbrokerCmd(t, nil, append([]string{"retention", f.Topic, "-older-than", "0"}, url...)...)
	require.Equal(t, 0, code, stderr)
	assert.Equal(t, []string{f.Topic, "1"}, strings.Fields(strings.Split(out, "\n")[1]), "offset 1, which the ahead group passed")
	assert.Equal(t, int64(9), f.Int(t, `SELECT count(*) FROM `+f.Tables.Messages))

	code, out, _ = sqlbrokerCmd(t, nil, "schema", f.Topic)
	require.Equal(t, 0, code)
	ddl, err := sqlbroker.SchemaSQL(f.Topic, "", "")
	require.NoError(t, err)
	assert.Equal(t, ddl, out)
}

// retention without -older-than would delete every settled message of every topic: it is
// refused, naming the flag, and deletes nothing.
func TestCommand_retentionWantsOlderThan(t *testing.T) {
	t.Parallel()
	f := testdb.NewFixture(t)
	_, err := f.Pool.Exec(context.Background(), `DELETE FROM `+f.Tables.Groups+` WHERE consumer_group = 'behind'`)
	require.NoError(t, err)
	before := f.Int(t, `SELECT count(*) FROM `+f.Tables.Messages)
	for _, args := range [][]string{{"retention"}, {"retention", f.Topic}} {
		code, _, stderr := sqlbrokerCmd(t, nil, append(args, "-url", testdb.URL())...)
		assert.Equal(t, 2, code, args)
		assert.Contains(t, stderr, "-older-than", args)
	}
	assert.Equal(t, before, f.Int(t, `SELECT count(*) FROM `+f.Tables.Messages), "nothing deleted")
}

// inspect of a topic that does not exist fails and says so, instead of a raw SQL error.
func TestCommand_inspectNoSuchTopic(t *testing.T) {
	t.Parallel()
	code, _, stderr := sqlbrokerCmd(t, nil, "inspect", "-topic", "nosuch-topic-x", "-url", testdb.URL())
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, `no such topic "nosuch-topic-x"`)
	assert.NotContains(t, stderr, "does not exist")
}

// migrate-watermill-sql wants its group, and names watermill-sql's table when it is missing.
func TestCommand_migrateWatermillSQLErrors(t *testing.T) {
	t.Parallel()
	code, _, stderr := sqlbrokerCmd(t, nil, "migrate-watermill-sql", "orders", "-url", testdb.URL())
	assert.Equal(t, 2, code)
	assert.Contains(t, stderr, "-group")

	code, _, stderr = sqlbrokerCmd(t, nil, "migrate-watermill-sql", "nosuch-wsql-topic", "-group", "g", "-dry-run", "-url", testdb.URL())
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, `"watermill_nosuch-wsql-topic"`)
	assert.Contains(t, stderr, "no such table")
}
