package sqlbrokerprom_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	_ "modernc.org/sqlite"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
	"github.com/sqlbroker/watermill-sqlbroker/sqlbrokerprom"
)

// On a SQLite file, a scrape reports for the same state the figures it reports on
// PostgreSQL: lag, claims in work, waiting and due, positions, the oldest unsettled message's
// age. The held-back messages and the xmin horizon, which have no meaning on SQLite, are not
// exported there, and the scrape is no error. The collector reads the file through the pool
// of the broker that serves it (Broker.DB).
func TestCollector_sqliteMatchesPostgres(t *testing.T) {
	t.Parallel()
	topic, dead := testdb.Topic(t, ""), testdb.Topic(t, "")
	pgStart := time.Now()
	testdb.NewState(t, dbx.NewPgxPool(testdb.Pgx(t)), topic, dead)
	testdb.WaitHorizon(t, context.Background(), dbx.NewPgxPool(testdb.Pgx(t)), offsets.NewTables("", "sqlbroker_", topic).Messages)

	path := testdb.SQLitePath(t)
	db, err := sql.Open("sqlite", "file:"+path)
	require.NoError(t, err)
	defer db.Close()
	liteStart := time.Now()
	testdb.NewState(t, dbx.NewSQLitePool(db), topic, dead)
	broker, err := sqlbroker.Open("sqlite:"+path, sqlbroker.BrokerConfig{}, nil)
	require.NoError(t, err)
	defer broker.Close()

	opts := sqlbrokerprom.Options{Topics: []string{topic, dead}}
	pgc := sqlbrokerprom.NewCollector(sqlbroker.Pgx(testdb.Pgx(t)), opts)
	litec := sqlbrokerprom.NewCollector(broker.DB(), opts)
	problems, err := testutil.CollectAndLint(litec)
	require.NoError(t, err)
	assert.Empty(t, problems)
	pg, lite := scrape(t, pgc), scrape(t, litec)

	for _, group := range []string{"ahead", "behind"} {
		l := labels(topic, group)
		for _, name := range []string{
			"sqlbroker_group_lag_messages", "sqlbroker_group_lag_estimated", "sqlbroker_group_claims_in_work",
			"sqlbroker_group_claims_waiting", "sqlbroker_group_claims_due", "sqlbroker_group_position_offset",
		} {
			require.Contains(t, lite[name], l, name)
			assert.Equal(t, pg[name][l], lite[name][l], "%s of %s", name, group)
		}
		age := "sqlbroker_group_oldest_unsettled_age_seconds"
		assert.InDelta(t, time.Since(pgStart).Seconds(), pg[age][l], 3, group)
		assert.InDelta(t, time.Since(liteStart).Seconds(), lite[age][l], 3, group)
		assert.Positive(t, lite[age][l])
		assert.Contains(t, pg["sqlbroker_group_held_back_messages"], l)
		assert.Equal(t, 0.0, pg["sqlbroker_group_held_back_messages"][l])
	}
	ahead, behind := labels(topic, "ahead"), labels(topic, "behind")
	assert.Equal(t, []float64{2, 3, 1, 2, 8}, []float64{lite["sqlbroker_group_lag_messages"][ahead], lite["sqlbroker_group_claims_in_work"][ahead],
		lite["sqlbroker_group_claims_waiting"][ahead], lite["sqlbroker_group_claims_due"][ahead], lite["sqlbroker_group_position_offset"][ahead]})
	assert.Equal(t, 10.0, lite["sqlbroker_group_lag_messages"][behind])

	assert.NotContains(t, lite, "sqlbroker_group_held_back_messages", "not applicable on SQLite")
	assert.NotContains(t, lite, "sqlbroker_xmin_horizon_age_seconds", "not applicable on SQLite")
	assert.Contains(t, pg, "sqlbroker_xmin_horizon_age_seconds")
	for _, c := range []map[string]map[string]float64{pg, lite} {
		assert.Equal(t, 0.0, c["sqlbroker_scrape_error"][""])
		assert.Equal(t, 0.0, c["sqlbroker_topic_scrape_error"]["topic="+topic+","])
		assert.Equal(t, 0.0, c["sqlbroker_topic_scrape_error"]["topic="+dead+","])
	}
}
