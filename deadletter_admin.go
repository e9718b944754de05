package sqlbroker

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/listen"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/wake"
)

// MetadataRedrives is the metadata key that counts how many times Admin.Redrive moved a
// message back from a dead-letter topic. It stays with the message: a message that fails
// again and lands in the dead-letter topic once more shows it there.
const MetadataRedrives = "sqlbroker_redrives"

// Defaults of ListOptions and RedriveOptions.
const (
	DefaultListLimit    = 100
	DefaultRedriveBatch = 100
)

// ListOptions says which messages of a topic DeadLetters and Peek read: up to Limit
// (DefaultListLimit when 0) from offset Offset on, in offset order.
type ListOptions struct {
	Offset int64
	Limit  int
}

func (o *ListOptions) check() error {
	if o.Limit == 0 {
		o.Limit = DefaultListLimit
	}
	if o.Limit < 0 {
		return &ConfigError{Field: "Limit", Value: o.Limit, Reason: "must not be negative"}
	}
	if o.Offset < 0 {
		return &ConfigError{Field: "Offset", Value: o.Offset, Reason: "must not be negative"}
	}
	return nil
}

// StoredMessage is a message as its topic's table holds it.
type StoredMessage struct {
	Offset int64  `json:"offset"`
	UUID   string `json:"uuid"`
	// PublishedAt is when it was written to this topic (for a dead letter: when it was moved
	// there).
	PublishedAt time.Time `json:"published_at"`
	// DeliverAt is, for a delayed message, the time before which no group receives it.
	DeliverAt time.Time         `json:"deliver_at,omitzero"`
	Metadata  map[string]string `json:"metadata"`
	Payload   []byte            `json:"payload"`
}

// DeadLetter is a message of a dead-letter topic, with what is known of why it is there.
type DeadLetter struct {
	StoredMessage
	// OriginalTopic is the topic it was moved from: MetadataDeadLetterTopic, or, for a
	// message that Watermill's PoisonQueue middleware published, its topic_poisoned
	// metadata. Empty when unknown.
	OriginalTopic string `json:"original_topic,omitempty"`
	// Group is the consumer group that gave up on it (MetadataDeadLetterGroup).
	Group string `json:"consumer_group,omitempty"`
	// Attempts is how many times that group's handlers failed it (MetadataDeadLetterAttempts).
	Attempts int64 `json:"attempts,omitempty"`
	// OriginalOffset is its offset in OriginalTopic (MetadataDeadLetterOffset).
	OriginalOffset int64 `json:"original_offset,omitempty"`
	// LastError is the handler's error where it is known: the reason_poisoned metadata of
	// Watermill's PoisonQueue middleware. A message that MaxAttempts moved carries none: a
	// Nack says no why.
	LastError string `json:"last_error,omitempty"`
	// Redrives counts the earlier redrives of the message (MetadataRedrives).
	Redrives int `json:"redrives,omitempty"`
}

// DeadLetterList is what DeadLetters read.
type DeadLetterList struct {
	Topic string `json:"topic"`
	// Total counts every message of the topic.
	Total   int64        `json:"total"`
	Letters []DeadLetter `json:"dead_letters"`
}

// Peek reads the messages of topic (any topic) from opts.Offset on, as they are stored:
// metadata and payload. It changes nothing.
func (a *Admin) Peek(ctx context.Context, topic string, opts ListOptions) ([]StoredMessage, error) {
	if err := opts.check(); err != nil {
		return nil, err
	}
	t, err := a.existing(ctx, topic)
	if err != nil {
		return nil, err
	}
	var rows []offsets.Stored
	err = a.read(ctx, func(q dbx.Querier) error {
		rows, err = t.ReadMessages(ctx, q, opts.Offset, opts.Limit)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("sqlbroker: topic %q: peek: %w", topic, err)
	}
	out := make([]StoredMessage, 0, len(rows))
	for _, r := range rows {
		out = append(out, stored(r))
	}
	return out, nil
}

// DeadLetters lists the messages of the dead-letter topic topic (the subscribed topic
// followed by DefaultDeadLetterSuffix, unless SubscriberConfig.DeadLetterTopic names
// another), with the topic each came from, the consumer group that gave up on it, its
// attempts and, where known, its last error. It changes nothing.
func (a *Admin) DeadLetters(ctx context.Context, topic string, opts ListOptions) (DeadLetterList, error) {
	list := DeadLetterList{Topic: topic, Letters: []DeadLetter{}}
	if err := opts.check(); err != nil {
		return list, err
	}
	t, err := a.existing(ctx, topic)
	if err != nil {
		return list, err
	}
	var rows []offsets.Stored
	err = a.read(ctx, func(q dbx.Querier) error {
		if list.Total, err = t.CountMessages(ctx, q); err != nil {
			return err
		}
		rows, err = t.ReadMessages(ctx, q, opts.Offset, opts.Limit)
		return err
	})
	if err != nil {
		return list, fmt.Errorf("sqlbroker: topic %q: listing dead letters: %w", topic, err)
	}
	for _, r := range rows {
		list.Letters = append(list.Letters, deadLetter(stored(r)))
	}
	return list, nil
}

func deadLetter(m StoredMessage) DeadLetter {
	d := DeadLetter{StoredMessage: m, OriginalTopic: m.Metadata[MetadataDeadLetterTopic], Group: m.Metadata[MetadataDeadLetterGroup],
		LastError: m.Metadata[middleware.ReasonForPoisonedKey]}
	if d.OriginalTopic == "" {
		d.OriginalTopic = m.Metadata[middleware.PoisonedTopicKey]
	}
	d.Attempts, _ = strconv.ParseInt(m.Metadata[MetadataDeadLetterAttempts], 10, 64)
	d.OriginalOffset, _ = strconv.ParseInt(m.Metadata[MetadataDeadLetterOffset], 10, 64)
	d.Redrives, _ = strconv.Atoi(m.Metadata[MetadataRedrives])
	return d
}

func stored(r offsets.Stored) StoredMessage {
	m := StoredMessage{Offset: r.Offset, UUID: r.UUID, PublishedAt: time.UnixMilli(r.CreatedAtMS).UTC(), Payload: r.Payload, Metadata: map[string]string{}}
	if r.DeliverAtMS != 0 {
		m.DeliverAt = time.UnixMilli(r.DeliverAtMS).UTC()
	}
	var raw map[string]any
	if json.Unmarshal([]byte(r.Metadata), &raw) == nil {
		for k, v := range raw {
			if s, ok := v.(string); ok {
				m.Metadata[k] = s
			} else {
				b, _ := json.Marshal(v)
				m.Metadata[k] = string(b)
			}
		}
	}
	return m
}

// RedriveOptions says what Redrive moves.
type RedriveOptions struct {
	// To is the topic every message goes to. Empty: each goes back to the topic it came
	// from (see DeadLetter.OriginalTopic); a message whose topic is unknown stays.
	To string
	// Limit bounds the messages moved; 0 moves them all.
	Limit int
	// BatchSize is the number of messages moved per transaction. Defaults to
	// DefaultRedriveBatch.
	BatchSize int
	// DryRun reports what would move, and moves nothing.
	DryRun bool
}

// RedriveResult is what Redrive did, or with DryRun would do.
type RedriveResult struct {
	// Moved counts the messages moved (with DryRun: that would move).
	Moved int64 `json:"moved"`
	// Topics counts them per topic they went to.
	Topics map[string]int64 `json:"topics"`
	// Skipped counts the messages left in place: their topic is unknown (and To is empty),
	// or not a valid topic name.
	Skipped int64 `json:"skipped"`
	DryRun  bool  `json:"dry_run,omitempty"`
}

// Redrive moves the messages of the dead-letter topic topic back to the topic each came from
// (or to opts.To), in offset order, BatchSize messages per transaction: in one transaction
// the copies are written to their topic and the messages are deleted from the dead-letter
// topic, so a message is never in both and never lost, whenever the process stops. Calling it
// again after an interruption finishes the job.
//
// The copy keeps the message's UUID, payload and metadata, without the dead-letter keys
// (MetadataDeadLetterTopic, MetadataDeadLetterGroup, MetadataDeadLetterAttempts,
// MetadataDeadLetterOffset) and with MetadataRedrives counting this redrive. It is a new
// message of its topic, after every message there: its attempts start again from the first,
// and every consumer group of that topic receives it, not only the group that gave up on it
// (redrive to a topic of that group alone with To where that matters). A deduplicating
// handler keyed on the UUID drops it while the key is remembered.
//
// Deleted from the dead-letter topic means the row is gone, as retention deletes rows: a
// consumer group of the dead-letter topic that had not reached it never receives it, and a
// claim one held on it is dropped (its ack is refused as stale). The destination topics'
// tables must exist. On PostgreSQL, a concurrent Redrive of the same topic waits for the
// rows this one holds and skips them once moved.
func (a *Admin) Redrive(ctx context.Context, topic string, opts RedriveOptions) (RedriveResult, error) {
	res := RedriveResult{Topics: map[string]int64{}, DryRun: opts.DryRun}
	if opts.BatchSize == 0 {
		opts.BatchSize = DefaultRedriveBatch
	}
	if opts.BatchSize < 0 || opts.BatchSize > 10000 {
		return res, &ConfigError{Field: "BatchSize", Value: opts.BatchSize, Reason: "must be between 1 and 10000"}
	}
	if opts.Limit < 0 {
		return res, &ConfigError{Field: "Limit", Value: opts.Limit, Reason: "must not be negative"}
	}
	if opts.To != "" {
		if err := validateName("To", opts.To); err != nil {
			return res, err
		}
		if opts.To == topic {
			return res, &ConfigError{Field: "To", Value: opts.To, Reason: "is the dead-letter topic itself"}
		}
	}
	dl, err := a.existing(ctx, topic)
	if err != nil {
		return res, err
	}
	dests := map[string]*offsets.Store{}
	var after int64
	for opts.Limit == 0 || res.Moved < int64(opts.Limit) {
		n := opts.BatchSize
		if opts.Limit > 0 {
			n = min(n, opts.Limit-int(res.Moved))
		}
		var batch RedriveResult
		var last int64
		var empty bool
		run := func(q dbx.Querier) error {
			batch = RedriveResult{Topics: map[string]int64{}}
			var rows []offsets.Stored
			var err error
			if opts.DryRun {
				rows, err = dl.ReadMessages(ctx, q, after+1, n)
			} else {
				rows, err = dl.TakeMessages(ctx, q, after, n)
			}
			if err != nil || len(rows) == 0 {
				empty = true
				return err
			}
			last = rows[len(rows)-1].Offset
			byTopic := map[string][]offsets.Row{}
			var moved []int64
			for _, r := range rows {
				dest := opts.To
				m := stored(r)
				if dest == "" {
					dest = deadLetter(m).OriginalTopic
				}
				if dest == "" || dest == topic || validateName("topic", dest) != nil {
					batch.Skipped++
					continue
				}
				byTopic[dest] = append(byTopic[dest], offsets.Row{UUID: r.UUID, Payload: r.Payload, Metadata: redriven(m.Metadata)})
				moved = append(moved, r.Offset)
				batch.Topics[dest]++
				batch.Moved++
			}
			for _, dest := range sortedKeys(byTopic) {
				s := dests[dest]
				if s == nil {
					t, err := a.tables(dest)
					if err != nil {
						return err
					}
					if err := t.Check(ctx, q); err != nil {
						return publicErr(err)
					}
					s = offsets.NewStore(t, false)
					dests[dest] = s
				}
				if opts.DryRun {
					continue
				}
				if err := s.Insert(ctx, q, byTopic[dest], listen.Channel); err != nil {
					return fmt.Errorf("writing to topic %q: %w", dest, err)
				}
			}
			if opts.DryRun {
				return nil
			}
			deleted, err := dl.DeleteMessages(ctx, q, moved)
			if err == nil && deleted != int64(len(moved)) {
				err = fmt.Errorf("deleted %d of the %d messages taken: rolled back", deleted, len(moved))
			}
			return err
		}
		if opts.DryRun {
			err = a.read(ctx, run)
		} else {
			err = dbx.InTx(ctx, a.bounded(), func(tx dbx.Tx) error { return run(tx) })
			if err != nil && a.addPartitions(ctx, err, n, dests) {
				err = dbx.InTx(ctx, a.bounded(), func(tx dbx.Tx) error { return run(tx) })
			}
		}
		if err != nil {
			return res, fmt.Errorf("sqlbroker: topic %q: redrive: %w", topic, err)
		}
		if empty {
			break
		}
		after = last
		res.Moved += batch.Moved
		res.Skipped += batch.Skipped
		for k, v := range batch.Topics {
			res.Topics[k] += v
			if !opts.DryRun {
				wake.Notify(dests[k].T.Messages) // subscribers of this process
			}
		}
	}
	return res, nil
}

// redriven is the metadata of a redriven copy: without the dead-letter keys, with the
// redrive counted.
func redriven(md map[string]string) string {
	out := make(map[string]string, len(md)+1)
	for k, v := range md {
		out[k] = v
	}
	for _, k := range []string{MetadataDeadLetterTopic, MetadataDeadLetterGroup, MetadataDeadLetterAttempts, MetadataDeadLetterOffset} {
		delete(out, k)
	}
	n, _ := strconv.Atoi(md[MetadataRedrives])
	out[MetadataRedrives] = strconv.Itoa(n + 1)
	b, _ := json.Marshal(out)
	return string(b)
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// existing validates topic, names its tables and checks that they exist.
func (a *Admin) existing(ctx context.Context, topic string) (offsets.Tables, error) {
	t, err := a.tables(topic)
	if err != nil {
		return t, err
	}
	if err := t.Check(ctx, a.db); err != nil {
		return t, publicErr(fmt.Errorf("sqlbroker: %w", err))
	}
	return t, nil
}

// read runs fn on statements that only read: in a read-only transaction bounded by the
// server on PostgreSQL, on the pool on SQLite (whose transactions take the write lock).
func (a *Admin) read(ctx context.Context, fn func(dbx.Querier) error) error {
	if !a.dialect.StatementTimeouts {
		return fn(a.db)
	}
	return a.readOnly(ctx, fn)
}
