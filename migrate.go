package sqlbroker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// DefaultMigrateBatchSize is the default of MigrateOptions.BatchSize.
const DefaultMigrateBatchSize = 1000

// MigrateOptions says how MigrateWatermillSQL reads watermill-sql's tables.
type MigrateOptions struct {
	// MessagesTable is watermill-sql's messages table of the topic, as its
	// DefaultPostgreSQLSchema names it. Defaults to "watermill_" followed by the topic.
	MessagesTable string

	// OffsetsTable is watermill-sql's offsets table of the topic, as its
	// DefaultPostgreSQLOffsetsAdapter names it. Defaults to "watermill_offsets_" followed by
	// the topic.
	OffsetsTable string

	// SourceSchema is the PostgreSQL schema of watermill-sql's tables. Defaults to "" (the
	// search_path, where watermill-sql creates them).
	SourceSchema string

	// BatchSize is the number of messages copied in one transaction. Defaults to
	// DefaultMigrateBatchSize.
	BatchSize int

	// DryRun counts the messages that would be copied and changes nothing.
	DryRun bool
}

// MigrateResult is what MigrateWatermillSQL did, or with DryRun would do.
type MigrateResult struct {
	// Migrated counts the messages copied into the topic (with DryRun: the messages the group
	// has not consumed, which a run would copy).
	Migrated int64 `json:"migrated"`
	// Batches counts the transactions that copied messages.
	Batches int `json:"batches"`
	// HeldBack counts the messages after the group's position that a transaction still
	// running holds back: watermill-sql's own order does not let them pass it. A run that
	// leaves some returns an error; run it again once that transaction has ended.
	HeldBack int64 `json:"held_back"`
}

// MigrateWatermillSQL copies the messages that the consumer group of watermill-sql
// (github.com/ThreeDotsLabs/watermill-sql, its default PostgreSQL schema and offsets adapters)
// has not consumed from topic's watermill-sql table into topic, in the order watermill-sql
// would have delivered them, keeping each message's UUID, payload and metadata. Every group
// of this library then receives them, before the messages published to topic afterwards.
//
// group is the watermill-sql consumer group as its subscribers named it ("" for its default
// group). Each batch is one transaction that inserts the messages and moves the watermill-sql
// group's position past them: a run that is interrupted (a crash, ctx, an error) leaves
// every message either copied and consumed on the watermill-sql side, or neither, and a run
// again resumes where it stopped, never copying a message twice. The watermill-sql
// consumers of the group should be stopped first (one still running takes some of the
// messages itself, and none twice). Publishers to the watermill-sql table may run meanwhile;
// what they write after the run is copied by the next run.
//
// It creates topic's tables when missing, with the Admin's Schema and TablePrefix. It is
// PostgreSQL's only. Each statement is bounded by StatementTimeout, the whole run by ctx.
func (a *Admin) MigrateWatermillSQL(ctx context.Context, topic, group string, opts MigrateOptions) (MigrateResult, error) {
	var res MigrateResult
	if !offsets.ReadsWatermillSQL(a.dialect) {
		return res, &ConfigError{Field: "db", Value: a.dialect.Name, Reason: "Admin.MigrateWatermillSQL reads watermill-sql's PostgreSQL tables and is PostgreSQL's only"}
	}
	src, err := newWatermillSource(topic, group, opts)
	if err != nil {
		return res, err
	}
	if opts.BatchSize == 0 {
		opts.BatchSize = DefaultMigrateBatchSize
	}
	if opts.BatchSize < 0 {
		return res, &ConfigError{Field: "BatchSize", Value: opts.BatchSize, Reason: "must not be negative"}
	}
	fail := func(err error) (MigrateResult, error) {
		return res, fmt.Errorf("sqlbroker: migrating topic %q, consumer group %q from watermill-sql: %w", topic, group, err)
	}
	if err := src.check(ctx, a.db); err != nil {
		return fail(err)
	}
	if opts.DryRun {
		err := a.readOnly(ctx, func(q dbx.Querier) error {
			pos, err := src.position(ctx, q, false)
			if err != nil {
				return err
			}
			res.Migrated, res.HeldBack, err = src.count(ctx, q, pos)
			return err
		})
		if err != nil {
			return fail(err)
		}
		return res, nil
	}
	for {
		var n int
		batch := func(tx dbx.Tx) error {
			var err error
			n, err = a.migrateBatch(ctx, tx, src, opts.BatchSize)
			return err
		}
		err := dbx.InTx(ctx, a.bounded(), batch)
		if err != nil {
			if t, terr := a.tables(topic); terr == nil && a.addPartitions(ctx, err, opts.BatchSize, map[string]*offsets.Store{topic: offsets.NewStore(t, false)}) {
				err = dbx.InTx(ctx, a.bounded(), batch)
			}
		}
		if err != nil {
			return fail(err)
		}
		if n == 0 {
			break
		}
		res.Migrated += int64(n)
		res.Batches++
	}
	err = a.readOnly(ctx, func(q dbx.Querier) error {
		pos, err := src.position(ctx, q, false)
		if err != nil {
			return err
		}
		_, res.HeldBack, err = src.count(ctx, q, pos)
		return err
	})
	if err != nil {
		return fail(err)
	}
	if res.HeldBack > 0 {
		return fail(fmt.Errorf("%d messages after the group's position were not copied: a transaction still running holds them back (sqlbroker inspect shows the oldest); run again once it has ended", res.HeldBack))
	}
	return res, nil
}

// migrateBatch copies up to size messages in tx and moves the watermill-sql group past them.
func (a *Admin) migrateBatch(ctx context.Context, tx dbx.Tx, src watermillSource, size int) (int, error) {
	pos, err := src.position(ctx, tx, true)
	if err != nil {
		return 0, err
	}
	read, err := src.sql.Read(ctx, tx, pos, size)
	if err != nil {
		return 0, err
	}
	msgs := make([]*message.Message, 0, len(read))
	last := pos
	for _, r := range read {
		last = r.Pos
		if r.UUID == "" {
			return 0, fmt.Errorf("%s: the message of offset %d has an empty UUID, which this library refuses", src.sql.Messages, r.Pos.Offset)
		}
		msg := message.NewMessage(r.UUID, r.Payload)
		if r.Metadata != "" && r.Metadata != "null" {
			if err := json.Unmarshal([]byte(r.Metadata), &msg.Metadata); err != nil {
				return 0, fmt.Errorf("%s: the metadata of offset %d is not a JSON object of strings: %w", src.sql.Messages, r.Pos.Offset, err)
			}
		}
		msg.SetContext(ctx)
		msgs = append(msgs, msg)
	}
	if len(msgs) == 0 {
		return 0, nil
	}
	pub, err := NewPublisher(DB{tx: tx}, PublisherConfig{
		InitializeSchema: true,
		Schema:           a.config.Schema,
		TablePrefix:      a.config.TablePrefix,
		MaxPayloadBytes:  1 << 30, // PostgreSQL's own bound of a value
	}, nil)
	if err != nil {
		return 0, err
	}
	defer func() { _ = pub.Close() }()
	// One Publish refuses a repeated UUID, which watermill-sql allows: a repeat starts the
	// next call, in the same transaction and so in the same order.
	for start := 0; start < len(msgs); {
		seen := map[string]bool{}
		end := start
		for end < len(msgs) && !seen[msgs[end].UUID] {
			seen[msgs[end].UUID] = true
			end++
		}
		if err := pub.Publish(src.topic, msgs[start:end]...); err != nil {
			return 0, err
		}
		start = end
	}
	if err := src.sql.Advance(ctx, tx, src.group, last); err != nil {
		return 0, err
	}
	return len(msgs), nil
}

// watermillSource is a topic's tables in watermill-sql, and the consumer group migrated.
type watermillSource struct {
	topic, group string
	sql          offsets.WatermillSQL
}

func newWatermillSource(topic, group string, opts MigrateOptions) (watermillSource, error) {
	if err := validateName("topic", topic); err != nil {
		return watermillSource{}, err
	}
	if utf8.RuneCountInString(group) > 255 {
		// watermill-sql's consumer_group column is VARCHAR(255), and "" is its default group;
		// the name is only ever a bound parameter.
		return watermillSource{}, &NameError{Field: "consumer group", Value: group, Reason: "is longer than the 255 characters watermill-sql's offsets table holds"}
	}
	if opts.MessagesTable == "" {
		opts.MessagesTable = "watermill_" + topic
	}
	if opts.OffsetsTable == "" {
		opts.OffsetsTable = "watermill_offsets_" + topic
	}
	return watermillSource{
		topic: topic, group: group,
		sql: offsets.NewWatermillSQL(opts.SourceSchema, opts.MessagesTable, opts.OffsetsTable),
	}, nil
}

// errNoWatermillTable says that a table of watermill-sql is missing.
var errNoWatermillTable = errors.New("no such table")

func (s watermillSource) check(ctx context.Context, q dbx.Querier) error {
	t, err := s.sql.Missing(ctx, q)
	if err != nil {
		return err
	}
	if t != "" {
		return fmt.Errorf("watermill-sql's table %s: %w (check the topic, SourceSchema and the table names)", t, errNoWatermillTable)
	}
	return nil
}

// position reads the group's position; with lock, it locks the group's row, as watermill-sql's
// consumers do for as long as they handle a batch. A group without a row never subscribed (a
// watermill-sql subscriber writes it before its first read): most likely a typo, which would
// copy the whole table, so it is refused, naming the groups there are.
func (s watermillSource) position(ctx context.Context, q dbx.Querier, lock bool) (offsets.WatermillPosition, error) {
	pos, err := s.sql.Position(ctx, q, s.group, lock)
	if !errors.Is(err, dbx.ErrNoRows) {
		return pos, err
	}
	names, err := s.sql.Groups(ctx, q, 11)
	if err != nil {
		return pos, err
	}
	groups := make([]string, len(names))
	for i, g := range names {
		groups[i] = strconv.Quote(g)
	}
	if len(groups) > 10 {
		groups = append(groups[:10], "...")
	}
	if len(groups) == 0 {
		groups = []string{"none"}
	}
	return pos, fmt.Errorf("watermill-sql's consumer group %q has no row in %s (groups there: %s)", s.group, s.sql.Offsets, strings.Join(groups, ", "))
}

// count counts the messages after pos: those a batch may copy now, and those a running
// transaction holds back.
func (s watermillSource) count(ctx context.Context, q dbx.Querier, pos offsets.WatermillPosition) (due, heldBack int64, err error) {
	return s.sql.Count(ctx, q, pos)
}
