package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// Scenario 7: the raw SQL limit. Each library's own statements, taken from its exported code
// (offsets.Store for this library; the schema and offsets adapters for watermill-sql), run in a
// tight loop on one pool, without Watermill and without the library's goroutines. The library's
// figure beside its scenario 1 and 5 figures shows how much of what its database allows it uses.
func scenarioRaw(ctx context.Context, b *bench, c contender) error {
	if c == advisory {
		b.results.setText("7a", c, "= lease")
		b.results.setText("7b", c, "= lease")
		b.results.setText("7c", c, "n/a")
		b.results.setText("7d", c, "= lease")
		b.results.note("advisory, scenario 7: the inserts are the lease mode's; the advisory claim statements are not exported yet (n/a)")
		return nil
	}
	e, err := openEnv(ctx, b.cfg, c)
	if err != nil {
		return err
	}
	defer e.close()
	r := newRawOps(e)

	// 7a: inserts of 100 rows, one goroutine; they also fill the table for 7c.
	topic := b.topic(c, "raw")
	defer b.dropTopic(c, topic)
	if err := e.createTopic(ctx, topic); err != nil {
		return err
	}
	msgs := newMessages(b.cfg.rawN, b.payload)
	elapsed, err := r.insertEach(ctx, topic, msgs, 100)
	if err != nil {
		return err
	}
	b.results.set("7a", c, rate(int64(len(msgs)), elapsed))

	// 7c: claim 100 and ack them, one goroutine, until the table is drained.
	start := time.Now()
	n, err := r.drain(ctx, topic, len(msgs))
	if err != nil {
		return fmt.Errorf("claim+ack (%d of %d done): %w", n, len(msgs), err)
	}
	b.results.set("7c", c, rate(int64(n), time.Since(start)))

	// 7b: one row per statement from many goroutines, on a fresh topic.
	topic2 := b.topic(c, "rawsingle")
	defer b.dropTopic(c, topic2)
	if err := e.createTopic(ctx, topic2); err != nil {
		return err
	}
	msgs = newMessages(b.cfg.rawSingleN, b.payload)
	elapsed, err = parallel(ctx, b.cfg.publishWorkers, len(msgs), func(i int) error {
		return r.insert(ctx, topic2, msgs[i:i+1])
	})
	if err != nil {
		return err
	}
	b.results.set("7b", c, rate(int64(len(msgs)), elapsed))

	// 7d: one row per statement, one goroutine: what a call costs whatever it carries (a round
	// trip and a commit that waits for its WAL flush). Scenario 5a pays it once a batch of 100.
	msgs = newMessages(max(b.cfg.rawSingleN/10, 100), b.payload)
	if elapsed, err = r.insertEach(ctx, topic2, msgs, 1); err != nil {
		return err
	}
	b.results.set("7d", c, rate(int64(len(msgs)), elapsed))
	return nil
}

// insertEach inserts msgs in statements of size rows, one after another, and returns the
// wall time.
func (r *rawOps) insertEach(ctx context.Context, topic string, msgs []*message.Message, size int) (time.Duration, error) {
	start := time.Now()
	for i := 0; i < len(msgs); i += size {
		if err := ctx.Err(); err != nil {
			return 0, context.Cause(ctx)
		}
		if err := r.insert(ctx, topic, msgs[i:min(i+size, len(msgs))]); err != nil {
			return 0, fmt.Errorf("insert at %d: %w", i, err)
		}
	}
	return time.Since(start), nil
}

// rawOps are one contender's statements, run directly on its pool.
type rawOps struct {
	e      *env
	mu     sync.Mutex
	stores map[string]*offsets.Store
}

func newRawOps(e *env) *rawOps { return &rawOps{e: e, stores: map[string]*offsets.Store{}} }

// store returns topic's statements, built once per topic as the library's publisher and
// subscriber build them: building them costs about as much as a single-row INSERT, and would
// otherwise be timed with every statement.
func (r *rawOps) store(topic string) *offsets.Store {
	r.mu.Lock()
	defer r.mu.Unlock()
	s, ok := r.stores[topic]
	if !ok {
		s = offsets.NewStore(r.e.tables(topic), true)
		r.stores[topic] = s
	}
	return s
}

func (r *rawOps) insert(ctx context.Context, topic string, msgs []*message.Message) error {
	if r.e.c.isWatermillSQL() {
		schema, _ := r.e.c.wsqlAdapters()
		q, err := schema.InsertQuery(wsql.InsertQueryParams{Topic: topic, Msgs: msgs})
		if err != nil {
			return err
		}
		_, err = r.e.wsqlDB().ExecContext(ctx, q.Query, q.Args...)
		return err
	}
	rows := make([]offsets.Row, len(msgs))
	for i, m := range msgs {
		rows[i] = offsets.Row{UUID: m.UUID, Payload: m.Payload, Metadata: "{}"}
	}
	return r.store(topic).Insert(ctx, r.e.db, rows, "")
}

// drain claims and acks batches of 100 until want messages were settled. An empty claim while
// messages remain means a transaction elsewhere in the cluster holds the xmin horizon back (both
// libraries read only below it): it waits a little, bounded.
func (r *rawOps) drain(ctx context.Context, topic string, want int) (int, error) {
	claimOnce, err := r.claimAcker(ctx, topic)
	if err != nil {
		return 0, err
	}
	done := 0
	idleSince := time.Time{}
	for done < want {
		if err := ctx.Err(); err != nil {
			return done, context.Cause(ctx)
		}
		n, err := claimOnce()
		if err != nil {
			return done, err
		}
		done += n
		if n > 0 {
			idleSince = time.Time{}
			continue
		}
		if idleSince.IsZero() {
			idleSince = time.Now()
		} else if time.Since(idleSince) > 30*time.Second {
			return done, errors.New("no message claimable for 30s while some remain")
		}
		time.Sleep(time.Millisecond)
	}
	return done, nil
}

// claimAcker returns one claim+ack round: for the library, Store.Claim of 100 then Store.Ack of
// what it claimed (two statements, no transaction, as the library runs them); for
// watermill-sql, its select, its consumed mark of each row (MySQL's offsets adapter has one)
// and its offset ack in one transaction at its schema's isolation level (REPEATABLE READ on
// PostgreSQL, SERIALIZABLE on MySQL), as its subscriber runs them.
func (r *rawOps) claimAcker(ctx context.Context, topic string) (func() (int, error), error) {
	if r.e.c.isWatermillSQL() {
		sa, oa := r.e.c.wsqlAdapters()
		db := r.e.wsqlDB()
		before, err := oa.BeforeSubscribingQueries(wsql.BeforeSubscribingQueriesParams{Topic: topic, ConsumerGroup: group})
		if err != nil {
			return nil, err
		}
		for _, q := range before {
			if _, err := db.ExecContext(ctx, q.Query, q.Args...); err != nil {
				return nil, err
			}
		}
		sel, err := sa.SelectQuery(wsql.SelectQueryParams{Topic: topic, ConsumerGroup: group, OffsetsAdapter: oa})
		if err != nil {
			return nil, err
		}
		opts := &sql.TxOptions{Isolation: sa.SubscribeIsolationLevel()}
		return func() (int, error) {
			tx, err := db.BeginTx(ctx, opts)
			if err != nil {
				return 0, err
			}
			defer tx.Rollback() // after Commit, a no-op
			rows, err := tx.QueryContext(ctx, sel.Query, sel.Args...)
			if err != nil {
				return 0, err
			}
			var got []wsql.Row
			for rows.Next() {
				row, err := sa.UnmarshalMessage(wsql.UnmarshalMessageParams{Row: rows})
				if err != nil {
					_ = rows.Close()
					return 0, err
				}
				got = append(got, row)
			}
			_ = rows.Close()
			// wsql.Rows has no Err; the rows of both its adapters (pgx's, database/sql's) do.
			if err := rows.(interface{ Err() error }).Err(); err != nil {
				return 0, err
			}
			if len(got) == 0 {
				return 0, tx.Commit()
			}
			for _, row := range got {
				q, err := oa.ConsumedMessageQuery(wsql.ConsumedMessageQueryParams{Topic: topic, Row: row, ConsumerGroup: group})
				if err != nil {
					return 0, err
				}
				if q.IsZero() {
					continue
				}
				if _, err := tx.ExecContext(ctx, q.Query, q.Args...); err != nil {
					return 0, err
				}
			}
			ack, err := oa.AckMessageQuery(wsql.AckMessageQueryParams{Topic: topic, LastRow: got[len(got)-1], Rows: got, ConsumerGroup: group})
			if err != nil {
				return 0, err
			}
			if _, err := tx.ExecContext(ctx, ack.Query, ack.Args...); err != nil {
				return 0, err
			}
			return len(got), tx.Commit()
		}, nil
	}

	store := r.store(topic)
	gid, err := store.EnsureGroup(ctx, r.e.db, group, false)
	if err != nil {
		return nil, err
	}
	buf := make([]offsets.Claimed, 0, 100)
	fs := make([]offsets.Fenced, 0, 100)
	var token int64
	var nextDue time.Time
	return func() (int, error) {
		token++
		// As the subscriber does while it drains a backlog: the whole due step once a poll
		// interval.
		due := offsets.DueNone
		if !time.Now().Before(nextDue) {
			due = offsets.DueAll
			nextDue = time.Now().Add(sqlbroker.DefaultPollInterval)
		}
		claimed, err := store.Claim(ctx, r.e.db, gid, token, 30*time.Second, 100, due, buf[:0])
		if err != nil || len(claimed) == 0 {
			return 0, err
		}
		fs = fs[:0]
		for _, c := range claimed {
			fs = append(fs, offsets.Fenced{Offset: c.Offset, Token: token})
		}
		acked, err := store.Ack(ctx, r.e.db, gid, fs)
		if err != nil {
			return 0, err
		}
		if len(acked) != len(fs) {
			return 0, fmt.Errorf("ack applied %d of %d", len(acked), len(fs))
		}
		return len(claimed), nil
	}, nil
}
