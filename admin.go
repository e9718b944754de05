package sqlbroker

import (
	"context"
	"fmt"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/advisory"
	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// Defaults of AdminConfig.
const (
	DefaultAdminMaxTopics        = 100
	DefaultAdminMaxGroups        = 100
	DefaultAdminCountCap         = 10000
	DefaultAdminStatementTimeout = 5 * time.Second
)

// ErrNoGroup says that a consumer group has no row in its topic's groups table: it never
// subscribed, or was deleted.
var ErrNoGroup = offsets.ErrNoGroup

// AdminConfig configures an Admin.
type AdminConfig struct {
	// Schema is the PostgreSQL schema of the tables, as the publishers and subscribers are
	// configured. Defaults to "" (the search_path).
	Schema string

	// TablePrefix starts every table name. Defaults to DefaultTablePrefix.
	TablePrefix string

	// MaxTopics bounds the topics Inspect reads when it lists them from the catalog.
	// Defaults to DefaultAdminMaxTopics.
	MaxTopics int

	// MaxGroups bounds the consumer groups Inspect reads per topic. Defaults to
	// DefaultAdminMaxGroups.
	MaxGroups int

	// CountCap bounds every count Inspect makes of one group (its lag, claims and held-back
	// messages): past it, the lag is estimated from offsets. Defaults to
	// DefaultAdminCountCap.
	CountCap int

	// StatementTimeout bounds each statement, on the server (statement_timeout), and how long
	// it waits for a table lock (lock_timeout). Defaults to DefaultAdminStatementTimeout.
	StatementTimeout time.Duration
}

func (c *AdminConfig) setDefaults() {
	if c.TablePrefix == "" {
		c.TablePrefix = DefaultTablePrefix
	}
	if c.MaxTopics == 0 {
		c.MaxTopics = DefaultAdminMaxTopics
	}
	if c.MaxGroups == 0 {
		c.MaxGroups = DefaultAdminMaxGroups
	}
	if c.CountCap == 0 {
		c.CountCap = DefaultAdminCountCap
	}
	if c.StatementTimeout == 0 {
		c.StatementTimeout = DefaultAdminStatementTimeout
	}
}

func (c *AdminConfig) validate() error {
	if err := validateIdentifier("Schema", c.Schema, maxSchemaNameLength, true); err != nil {
		return err
	}
	if err := validateIdentifier("TablePrefix", c.TablePrefix, maxTablePrefixLength, false); err != nil {
		return err
	}
	for _, f := range []struct {
		name string
		v    int
	}{{"MaxTopics", c.MaxTopics}, {"MaxGroups", c.MaxGroups}, {"CountCap", c.CountCap}} {
		if f.v < 0 {
			return &ConfigError{Field: f.name, Value: f.v, Reason: "must not be negative"}
		}
	}
	if c.StatementTimeout < time.Millisecond {
		return &ConfigError{Field: "StatementTimeout", Value: c.StatementTimeout, Reason: "must be at least 1ms"}
	}
	return nil
}

// Admin reads the state of topics and consumer groups, and moves or deletes groups: what an
// operator needs (the sqlbroker command and the Prometheus collector are built on it). It
// shares nothing with the publishers and subscribers of the process, and waits on none of
// them: every call runs its own statements on db, bounded on the server by StatementTimeout.
type Admin struct {
	db      dbx.Pool
	config  AdminConfig
	dialect dbx.Dialect
}

// NewAdmin builds an Admin on db, which must wrap a pool (Pgx, StdSQL, SQLite or MySQL). Every
// method runs on SQLite too, except MigrateWatermillSQL (watermill-sql's tables are
// PostgreSQL's): there Inspect reports what has a meaning on SQLite and marks the rest not
// applicable (see Horizon.NotApplicable).
func NewAdmin(db DB, config AdminConfig) (*Admin, error) {
	if err := db.refused(); err != nil {
		return nil, err
	}
	if db.pool == nil {
		return nil, &ConfigError{Field: "db", Value: "not a pool", Reason: "must wrap a pool: use sqlbroker.Pgx, sqlbroker.StdSQL, sqlbroker.SQLite or sqlbroker.MySQL"}
	}
	config.setDefaults()
	if err := config.validate(); err != nil {
		return nil, err
	}
	if err := schemaOn(db.dialect(), config.Schema); err != nil {
		return nil, err
	}
	return &Admin{db: db.pool, config: config, dialect: db.dialect()}, nil
}

// inspects refuses, on a database without the operator statements, a method that needs them.
func (a *Admin) inspects(method string) error {
	if offsets.Inspects(a.dialect) {
		return nil
	}
	return &ConfigError{Field: "db", Value: a.dialect.Name, Reason: "Admin." + method + " has no statements for this database"}
}

// Inspection is the state of topics, as Inspect read it.
type Inspection struct {
	Topics []TopicState `json:"topics"`
	// MoreTopics says that the catalog holds more topics than MaxTopics.
	MoreTopics bool `json:"more_topics,omitempty"`
	// Horizon is the oldest transaction of the cluster that holds an xid. Messages written
	// after it started are delivered only once it ends. On SQLite it is not applicable.
	Horizon Horizon `json:"horizon"`
}

// Horizon is the oldest transaction of the cluster that holds a transaction id. While it
// runs, no message committed by a transaction that started after it is delivered: the
// library reads messages only below the oldest running transaction, so that a message
// committed late is never skipped.
type Horizon struct {
	// Age is how long that transaction has been running; 0 when none runs.
	Age time.Duration `json:"age_ns"`
	// PID is its server process (0 for a prepared transaction).
	PID int64 `json:"pid,omitempty"`
	// Prepared says it is a prepared transaction waiting for COMMIT PREPARED (its gid is
	// in Application).
	Prepared bool `json:"prepared,omitempty"`
	// Application, State and Database are its application_name, state and database, as
	// pg_stat_activity shows them to this role ("" where it may not see them: grant
	// pg_read_all_stats).
	Application string `json:"application,omitempty"`
	State       string `json:"state,omitempty"`
	Database    string `json:"database,omitempty"`
	// NotApplicable says that the database has no such horizon: on SQLite offsets commit in
	// order and no transaction holds a message back. The other fields are then zero, and so
	// is every GroupState.HeldBack.
	NotApplicable bool `json:"not_applicable,omitempty"`
}

// TopicState is the state of one topic.
type TopicState struct {
	Topic string `json:"topic"`
	// Table is the topic's messages table, as the library names it in SQL.
	Table  string       `json:"table"`
	Groups []GroupState `json:"groups"`
	// Claims lists claims of the topic, when Inspect was asked for them.
	Claims []ClaimState `json:"claims,omitempty"`
	// Error says why the topic could not be read (its other fields are then empty).
	Error string `json:"error,omitempty"`
}

// GroupState is the state of one consumer group of a topic.
type GroupState struct {
	Group string `json:"consumer_group"`
	// Offset is the offset of the last message handed out to the group.
	Offset int64 `json:"offset"`
	// Lag counts the messages after the group's position: not yet handed out. It is exact up
	// to CountCap; past it LagEstimated is set and Lag is the newest offset minus the
	// group's (offsets of rolled-back publishes and deleted messages count too).
	Lag          int64 `json:"lag"`
	LagEstimated bool  `json:"lag_estimated,omitempty"`
	// InWork counts claims held by a consumer now: leased, or held by an advisory lock.
	InWork int64 `json:"in_work"`
	// Waiting counts nacked messages waiting for their backoff to pass.
	Waiting int64 `json:"waiting"`
	// Parked counts messages of a group ordered by key (SubscriberConfig.OrderByKey) that
	// wait behind an earlier message of their key.
	Parked int64 `json:"parked"`
	// Due counts messages any consumer of the group may claim again now: nacked or given
	// back, or whose lease ran out.
	Due int64 `json:"due"`
	// HeldBack counts messages after the group's position that the oldest running
	// transaction holds back (see Horizon); 0 where Horizon.NotApplicable.
	HeldBack int64 `json:"held_back"`
	// OldestUnsettled is the age of the oldest message the group has not settled (its claim
	// with the lowest offset, or the next message after its position); 0 when there is none.
	OldestUnsettled time.Duration `json:"oldest_unsettled_ns"`
	// SinceMoved is how long ago the group's position last moved.
	SinceMoved time.Duration `json:"since_moved_ns"`
}

// ClaimState is one claim of a consumer group: a message handed out and not settled, or
// nacked and waiting.
type ClaimState struct {
	Group    string `json:"consumer_group"`
	Offset   int64  `json:"offset"`
	Attempts int64  `json:"attempts"`
	// Advisory says the claim is held by an advisory lock; HolderPID is then the server
	// process holding the lock, 0 when no session holds it (its consumer is gone: the next
	// claim of the group takes it over).
	Advisory  bool  `json:"advisory,omitempty"`
	HolderPID int64 `json:"holder_pid,omitempty"`
	// Parked says the message waits behind an earlier message of its key, in a group ordered
	// by key (SubscriberConfig.OrderByKey).
	Parked bool `json:"parked,omitempty"`
	// Deadline is, for a leased claim, the end of its lease, and for a nacked one the end of
	// its backoff; zero for an advisory claim and a parked one.
	Deadline time.Time `json:"deadline,omitzero"`
	// Waiting says the claim was nacked or given back (no consumer holds it).
	Waiting bool `json:"waiting,omitempty"`
}

// InspectOptions says what Inspect reads.
type InspectOptions struct {
	// Topics are the topics to read; nil reads every topic found in the catalog (up to
	// MaxTopics).
	Topics []string
	// Claims lists up to this many claims per topic, with the server process holding each
	// advisory claim's lock. On PostgreSQL that reads pg_locks, a copy of the server's whole
	// lock table: leave it 0 where Inspect runs often.
	Claims int
}

// Topics lists the topics whose tables exist under the Admin's schema and prefix, up to
// MaxTopics, and reports whether there are more. A topic whose table names were shortened
// (long names) and whose tables were created before this version of the library appears
// under its shortened name, which ends with '#' and a hash.
func (a *Admin) Topics(ctx context.Context) ([]string, bool, error) {
	if err := a.inspects("Topics"); err != nil {
		return nil, false, err
	}
	found, more, err := offsets.FindTopics(ctx, a.db, a.config.Schema, a.config.TablePrefix, a.config.MaxTopics)
	if err != nil {
		return nil, false, fmt.Errorf("sqlbroker: listing topics: %w", err)
	}
	out := make([]string, len(found))
	for i, f := range found {
		out[i] = f.Topic
	}
	return out, more, nil
}

// Inspect reads the state of topics and their consumer groups, and the transaction holding
// the xmin horizon. Each topic is read in one statement, on PostgreSQL in a read-only
// transaction of its own bounded by StatementTimeout (on SQLite outside a transaction, so
// that it takes no write lock); a topic that cannot be read carries its Error and the
// others are still read. ctx bounds the whole call.
func (a *Admin) Inspect(ctx context.Context, opts InspectOptions) (Inspection, error) {
	var ins Inspection
	if err := a.inspects("Inspect"); err != nil {
		return ins, err
	}
	var tables []offsets.Tables
	if opts.Topics == nil {
		found, more, err := offsets.FindTopics(ctx, a.db, a.config.Schema, a.config.TablePrefix, a.config.MaxTopics)
		if err != nil {
			return ins, fmt.Errorf("sqlbroker: listing topics: %w", err)
		}
		ins.MoreTopics = more
		for _, f := range found {
			tables = append(tables, f.Tables)
		}
	} else {
		for _, topic := range opts.Topics {
			t, err := a.tables(topic)
			if err != nil {
				return ins, err
			}
			tables = append(tables, t)
		}
	}
	var holders map[[2]int32]int64
	if opts.Claims > 0 {
		var err error
		if holders, err = a.advisoryHolders(ctx); err != nil {
			return ins, fmt.Errorf("sqlbroker: reading advisory locks: %w", err)
		}
	}
	for _, t := range tables {
		ts := TopicState{Topic: t.Topic, Table: t.Messages, Groups: []GroupState{}}
		err := a.read(ctx, func(q dbx.Querier) error {
			gs, err := t.Inspect(ctx, q, a.config.CountCap, a.config.MaxGroups)
			if err != nil {
				return err
			}
			for _, g := range gs {
				ts.Groups = append(ts.Groups, GroupState{
					Group: g.Group, Offset: g.Offset, Lag: g.Lag, LagEstimated: g.LagEstimated,
					InWork: g.InWork, Waiting: g.Waiting, Due: g.Due, Parked: g.Parked, HeldBack: g.HeldBack,
					OldestUnsettled: seconds(g.OldestUnsettledAge), SinceMoved: seconds(g.SinceMoved),
				})
			}
			if opts.Claims == 0 {
				return nil
			}
			cs, err := t.ListClaims(ctx, q, opts.Claims)
			if err != nil {
				return err
			}
			now := time.Now()
			for _, c := range cs {
				st := ClaimState{Group: c.Group, Offset: c.Offset, Attempts: c.Attempts, Advisory: c.Advisory, Parked: c.Parked, Waiting: c.Token == 0 && !c.Parked}
				switch {
				case c.Advisory:
					st.HolderPID = holders[[2]int32{advisory.Key1(t.Messages, c.Group), advisory.Key2(c.Offset)}]
				case c.Parked: // no deadline: it waits for its key
				default:
					st.Deadline = now.Add(seconds(c.In)).Truncate(time.Millisecond)
				}
				ts.Claims = append(ts.Claims, st)
			}
			return nil
		})
		if err != nil {
			if ctx.Err() != nil {
				return ins, fmt.Errorf("sqlbroker: topic %q: %w", t.Topic, err)
			}
			ts.Error = err.Error()
		}
		ins.Topics = append(ins.Topics, ts)
	}
	err := a.read(ctx, func(q dbx.Querier) error {
		h, err := offsets.ReadHorizon(ctx, q)
		ins.Horizon = Horizon{Age: seconds(h.Age), PID: h.PID, Prepared: h.Prepared, Application: h.Application, State: h.State, Database: h.Database, NotApplicable: h.NotApplicable}
		return err
	})
	if err != nil {
		return ins, fmt.Errorf("sqlbroker: reading the oldest transaction: %w", err)
	}
	return ins, nil
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// readOnly runs fn in a read-only transaction whose statements are bounded by the server
// (statement_timeout, lock_timeout: a migration's table lock makes a read fail, not wait).
// A read-only transaction takes no transaction id, so it never holds delivery back itself.
func (a *Admin) readOnly(ctx context.Context, fn func(dbx.Querier) error) error {
	return dbx.InTx(ctx, a.db, func(tx dbx.Tx) error {
		if err := a.limits(ctx, tx, true); err != nil {
			return err
		}
		return fn(tx)
	})
}

// limits bounds the statements of tx by StatementTimeout where the database can (elsewhere
// ctx bounds them), and sets its access mode.
func (a *Admin) limits(ctx context.Context, tx dbx.Querier, readOnly bool) error {
	access := dbx.TxAccessReadWrite
	if readOnly {
		access = dbx.TxAccessReadOnly
	}
	return dbx.SetTxTimeouts(ctx, tx, a.config.StatementTimeout.Milliseconds(), access)
}

func (a *Admin) advisoryHolders(ctx context.Context) (map[[2]int32]int64, error) {
	out := map[[2]int32]int64{}
	err := a.read(ctx, func(q dbx.Querier) error {
		hs, err := offsets.AdvisoryHolders(ctx, q, advisory.NamespaceFirst, advisory.NamespaceLast)
		for _, h := range hs {
			out[[2]int32{h.Key1, h.Key2}] = h.PID
		}
		return err
	})
	return out, err
}

// tables validates topic and names its tables.
func (a *Admin) tables(topic string) (offsets.Tables, error) {
	if err := validateName("topic", topic); err != nil {
		return offsets.Tables{}, err
	}
	return tablesOn(a.dialect, a.config.Schema, a.config.TablePrefix, topic), nil
}

// group validates topic and group, and checks that the topic's tables exist.
func (a *Admin) group(ctx context.Context, topic, group string) (offsets.Tables, error) {
	t, err := a.tables(topic)
	if err != nil {
		return t, err
	}
	if err := validateName("consumer group", group); err != nil {
		return t, err
	}
	if err := t.Check(ctx, a.db); err != nil {
		return t, publicErr(fmt.Errorf("sqlbroker: %w", err))
	}
	return t, nil
}

// ResetGroup moves the consumer group of topic so that the next message it receives is the
// first one kept whose offset is offset or more; the messages after it follow in the order
// the library delivers them. It drops the group's claims: deliveries in work when it runs
// are refused as stale when they settle, and nacked messages waiting for redelivery are not
// delivered again unless they lie after the new position. When no message is kept at or
// after offset, the group is placed after every message kept and receives the next one
// published, whatever its offset: an offset above the highest kept is not waited for. It
// returns the offset of the first message the group will receive; when that message is still
// to be published, the lowest offset it can have, one above the highest kept (it has that
// offset unless an insert failed or rolled back meanwhile). Stop the group's subscribers
// first for an exact cut.
func (a *Admin) ResetGroup(ctx context.Context, topic, group string, offset int64) (int64, error) {
	return a.reset(ctx, topic, group, offset, time.Time{}, false)
}

// ResetGroupToTime is ResetGroup to the first message kept that was published at or after
// at. It reads the messages table in offset order up to that message.
func (a *Admin) ResetGroupToTime(ctx context.Context, topic, group string, at time.Time) (int64, error) {
	return a.reset(ctx, topic, group, 0, at, true)
}

func (a *Admin) reset(ctx context.Context, topic, group string, offset int64, at time.Time, byTime bool) (int64, error) {
	if err := a.inspects("ResetGroup"); err != nil {
		return 0, err
	}
	t, err := a.group(ctx, topic, group)
	if err != nil {
		return 0, err
	}
	first, err := t.ResetGroup(ctx, a.bounded(), group, offset, at, byTime)
	if err != nil {
		return 0, fmt.Errorf("sqlbroker: topic %q, consumer group %q: reset: %w", topic, group, err)
	}
	return first, nil
}

// DeleteGroup deletes the consumer group of topic and its claims, so that it stops holding
// retention back, and returns how many claims it dropped. A subscriber of the group that
// still runs stops receiving; one that subscribes later starts the group anew (at the
// oldest message kept, or at the newest with StartAtNewest).
func (a *Admin) DeleteGroup(ctx context.Context, topic, group string) (int64, error) {
	if err := a.inspects("DeleteGroup"); err != nil {
		return 0, err
	}
	t, err := a.group(ctx, topic, group)
	if err != nil {
		return 0, err
	}
	n, err := t.DeleteGroup(ctx, a.bounded(), group)
	if err != nil {
		return 0, fmt.Errorf("sqlbroker: topic %q, consumer group %q: delete: %w", topic, group, err)
	}
	return n, nil
}

// Prune runs one retention pass on topic, as a subscriber with Retention does, and returns
// how many messages it deleted. On PostgreSQL it adds partitions to the messages table ahead
// of the publishers, and drops the partitions whose messages every consumer group has passed,
// no claim holds, and were all written more than olderThan ago (detached without making
// claims or publishes wait); it needs the tables' owner. A partition filled since the last
// pass is known complete once the transactions running when the pass starts have ended: the
// pass waits for them up to StatementTimeout. On SQLite it deletes such messages one by one,
// in statements of up to 10,000 rows. A topic without any consumer group keeps every message.
func (a *Admin) Prune(ctx context.Context, topic string, olderThan time.Duration) (int64, error) {
	t, err := a.tables(topic)
	if err != nil {
		return 0, err
	}
	if err := t.Check(ctx, a.db); err != nil {
		return 0, publicErr(fmt.Errorf("sqlbroker: %w", err))
	}
	store := offsets.NewStore(t, false)
	var res offsets.MaintainResult
	err = a.onConn(ctx, func(c dbx.Conn) error {
		var err error
		res, err = store.Maintain(ctx, c, offsets.MaintainOptions{Drop: true, OlderThan: olderThan, Wait: a.config.StatementTimeout})
		return err
	})
	if err != nil {
		return res.Messages, fmt.Errorf("sqlbroker: topic %q: retention: %w", topic, err)
	}
	return res.Messages, nil
}

// onConn runs fn on a connection of the pool, outside a transaction, with its statements
// bounded by StatementTimeout; the connection goes back to the pool with its setting as it
// was, or is closed.
func (a *Admin) onConn(ctx context.Context, fn func(dbx.Conn) error) error {
	c, err := a.db.Acquire(ctx)
	if err != nil {
		return err
	}
	if !a.dialect.StatementTimeouts {
		defer c.Release()
		return fn(c)
	}
	was, err := dbx.SetSessionStatementTimeout(ctx, c, a.config.StatementTimeout.Milliseconds())
	if err != nil {
		c.Destroy()
		return err
	}
	err = fn(c)
	rctx, cancel := dbx.CleanupContext(ctx)
	defer cancel()
	if rerr := dbx.RestoreSessionStatementTimeout(rctx, c, was); rerr != nil {
		c.Destroy()
		return err
	}
	c.Release()
	return err
}

// addPartitions reports whether err refused a row for want of a partition of a messages
// table (PostgreSQL) and it then added partitions for n more rows to each of stores: the
// statement may run again.
func (a *Admin) addPartitions(ctx context.Context, err error, n int, stores map[string]*offsets.Store) bool {
	if dbx.SQLState(err) != dbx.CodeCheckViolation {
		return false
	}
	for _, s := range stores {
		if s.AddPartitions(ctx, a.db, n) != nil {
			return false
		}
	}
	return true
}

// bounded is the Admin's pool, whose transactions start with the Admin's limits.
func (a *Admin) bounded() dbx.Beginner { return boundedBeginner{a} }

type boundedBeginner struct{ a *Admin }

func (b boundedBeginner) Begin(ctx context.Context) (dbx.Tx, error) {
	tx, err := b.a.db.Begin(ctx)
	if err != nil {
		return nil, err
	}
	if err := b.a.limits(ctx, tx, false); err != nil {
		rctx, cancel := dbx.CleanupContext(ctx)
		defer cancel()
		_ = tx.Rollback(rctx)
		return nil, err
	}
	return tx, nil
}
