package sqlbroker

import (
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/ident"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// ClaimMode says how a subscriber holds a message while a handler works on it.
type ClaimMode int

const (
	// ClaimLease marks a claimed message with a lease deadline and a fencing token, and
	// extends the lease while the handler runs. A consumer that dies leaves leases that run
	// out; the messages then return to the queue. No connection is held while handlers run.
	ClaimLease ClaimMode = iota
	// ClaimAdvisoryLock holds a claimed message with a PostgreSQL session advisory lock on a
	// connection the subscriber keeps for that purpose. A consumer that dies drops its
	// connection, PostgreSQL frees its locks at once, and the messages are claimed again
	// without waiting for a timeout. It needs session connections: not through a
	// transaction-mode pooler such as PgBouncer.
	ClaimAdvisoryLock
)

func (m ClaimMode) String() string {
	switch m {
	case ClaimLease:
		return "lease"
	case ClaimAdvisoryLock:
		return "advisory_lock"
	default:
		return "unknown"
	}
}

// Defaults of the configuration fields.
const (
	DefaultTablePrefix        = "sqlbroker_"
	DefaultConsumerGroup      = "default"
	DefaultMaxInFlight        = 64
	DefaultBatchSize          = 100
	DefaultPollInterval       = 100 * time.Millisecond
	DefaultIdlePollInterval   = time.Second
	DefaultLeaseTTL           = 30 * time.Second
	DefaultRetryInterval      = time.Second
	DefaultCloseTimeout       = 30 * time.Second
	DefaultLockCheckInterval  = time.Second
	DefaultLockWaitTimeout    = 2 * time.Second
	DefaultMaxPayloadBytes    = 64 << 20
	DefaultNotifyDebounce     = 5 * time.Millisecond
	DefaultMaxGroupRows       = 1000
	DefaultMaxStatementBytes  = 64 << 20
	DefaultGroupTimeout       = 30 * time.Second
	DefaultNackBackoff        = time.Second
	DefaultMaxNackBackoff     = time.Minute
	DefaultDeadLetterSuffix   = ".dead-letter"
	maxTablePrefixLength      = 24
	maxSchemaNameLength       = ident.MaxIdentifierLength
	minLeaseTTL               = 100 * time.Millisecond
	defaultLeaseRenewFraction = 3
)

// MaxStatementBytesLimit is the largest PublisherConfig.MaxStatementBytes. PostgreSQL refuses a
// protocol message of 1 GiB or more, and a driver that sends bytes as hex text (lib/pq) doubles
// them: 256 MiB of rows stays well under the limit on every driver.
const MaxStatementBytesLimit = 256 << 20

// NoBackoff, as SubscriberConfig.NackBackoff, makes a nacked message claimable again at once.
const NoBackoff time.Duration = -1

// PublisherConfig configures a Publisher.
type PublisherConfig struct {
	// InitializeSchema creates a topic's tables on its first Publish. Defaults to false.
	InitializeSchema bool

	// Schema is the PostgreSQL schema of the tables. Defaults to "" (the search_path).
	Schema string

	// TablePrefix starts every table name. Defaults to DefaultTablePrefix.
	TablePrefix string

	// MaxPayloadBytes refuses messages with a larger payload. Defaults to DefaultMaxPayloadBytes.
	MaxPayloadBytes int

	// OrderKey, when set, computes each message's order key (see
	// SubscriberConfig.OrderByKey), which is stored in its metadata under MetadataOrderKey;
	// "" leaves the message without one. An error fails the publish, naming the message.
	// Messages that already carry MetadataOrderKey keep theirs. Defaults to nil: a message's
	// key is its MetadataOrderKey, if any.
	OrderKey func(topic string, msg *message.Message) (string, error)

	// NotifyDebounce is the shortest time between two NOTIFYs of one topic from this
	// publisher: NOTIFY wakes subscribers in other processes at once, but takes a lock shared
	// by the whole cluster when its transaction commits. A publish inside the debounce time
	// is followed by one NOTIFY at its end. Defaults to DefaultNotifyDebounce.
	NotifyDebounce time.Duration

	// DisableNotify turns NOTIFY off: subscribers in other processes find new messages at
	// their next poll. Defaults to false.
	DisableNotify bool

	// DisableGroupInsert turns off the grouping of concurrent publishes. With grouping (on a
	// pool; a publisher inside the caller's transaction never groups), a Publish to a topic
	// that arrives while a statement of this publisher for the topic runs waits for it to
	// end, and then goes, with every other call that queued meanwhile, into the next
	// statement (up to MaxGroupRows rows and MaxStatementBytes bytes): one multi-row INSERT,
	// or COPY for large ones. A call's messages always go into one transaction together (all
	// or none). A database error fails every call of that statement, except an error the
	// server gives for the values it carries (a data exception, a constraint or a size
	// limit): then each call runs again alone, so that no call fails for another's messages.
	// An idle publisher adds no wait: a call that finds no statement running starts one at
	// once. Without grouping, every call runs its own statement, under its messages'
	// contexts, and concurrent calls use as many connections. Defaults to false.
	DisableGroupInsert bool

	// MaxGroupRows bounds the rows of one grouped statement. A call with more messages is
	// never grouped: it runs alone, in one statement or one transaction. At most
	// 10,000 (the rows one statement takes). On SQLite a statement takes 8,191 rows when one
	// of them is delayed: a larger group is written in one transaction of two statements,
	// all or none as well. Defaults to DefaultMaxGroupRows.
	MaxGroupRows int

	// MaxStatementBytes bounds the bytes (payloads, UUIDs and metadata, plus a few bytes per
	// row) of one INSERT statement. A grouped statement takes no call that would take it past
	// the bound: that call goes into the next statement. A call whose rows are larger writes
	// them in several INSERT statements of one transaction (all or none); a single message
	// larger than the bound goes in a statement of its own. COPY, which streams its rows, is
	// not bounded by it. At most MaxStatementBytesLimit: PostgreSQL refuses a statement of
	// 1 GiB or more. Defaults to DefaultMaxStatementBytes.
	MaxStatementBytes int

	// GroupTimeout bounds a grouped statement, the wait for a pool connection included. It
	// runs under a context of its own, not cancelled by the contexts of the calls in it (one
	// caller giving up must not fail the others), so this is what stops a statement stuck on
	// a lock: past it, the statement is cancelled on the server and its calls fail, nothing
	// written. Defaults to DefaultGroupTimeout.
	GroupTimeout time.Duration

	// CloseTimeout bounds Close: how long it waits for the publishes already running to
	// commit or fail before it cancels those still running on the server. Defaults to
	// DefaultCloseTimeout.
	CloseTimeout time.Duration
}

func (c *PublisherConfig) setDefaults() {
	if c.TablePrefix == "" {
		c.TablePrefix = DefaultTablePrefix
	}
	if c.MaxPayloadBytes == 0 {
		c.MaxPayloadBytes = DefaultMaxPayloadBytes
	}
	if c.NotifyDebounce == 0 {
		c.NotifyDebounce = DefaultNotifyDebounce
	}
	if c.MaxGroupRows == 0 {
		c.MaxGroupRows = DefaultMaxGroupRows
	}
	if c.MaxStatementBytes == 0 {
		c.MaxStatementBytes = DefaultMaxStatementBytes
	}
	if c.GroupTimeout == 0 {
		c.GroupTimeout = DefaultGroupTimeout
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = DefaultCloseTimeout
	}
}

func (c *PublisherConfig) validate() error {
	if err := validateIdentifier("Schema", c.Schema, maxSchemaNameLength, true); err != nil {
		return err
	}
	if err := validateIdentifier("TablePrefix", c.TablePrefix, maxTablePrefixLength, false); err != nil {
		return err
	}
	if c.MaxPayloadBytes < 0 {
		return &ConfigError{Field: "MaxPayloadBytes", Value: c.MaxPayloadBytes, Reason: "must not be negative"}
	}
	if c.NotifyDebounce < 0 {
		return &ConfigError{Field: "NotifyDebounce", Value: c.NotifyDebounce, Reason: "must not be negative"}
	}
	if c.MaxGroupRows < 0 || c.MaxGroupRows > offsets.MaxRowsPerStatement() {
		return &ConfigError{Field: "MaxGroupRows", Value: c.MaxGroupRows, Reason: fmt.Sprintf("must be between 1 and %d", offsets.MaxRowsPerStatement())}
	}
	if c.MaxStatementBytes < 0 || c.MaxStatementBytes > MaxStatementBytesLimit {
		return &ConfigError{Field: "MaxStatementBytes", Value: c.MaxStatementBytes, Reason: fmt.Sprintf("must be between 1 and %d", MaxStatementBytesLimit)}
	}
	if c.GroupTimeout < 0 {
		return &ConfigError{Field: "GroupTimeout", Value: c.GroupTimeout, Reason: "must not be negative"}
	}
	if c.CloseTimeout < 0 {
		return &ConfigError{Field: "CloseTimeout", Value: c.CloseTimeout, Reason: "must not be negative"}
	}
	return nil
}

// SubscriberConfig configures a Subscriber.
type SubscriberConfig struct {
	// ConsumerGroup names the group this subscriber consumes for. Every group receives every
	// message of a topic; within a group each message is worked by one consumer at a time.
	// Defaults to DefaultConsumerGroup.
	ConsumerGroup string

	// ClaimMode says how a claimed message is held while its handler runs. Defaults to
	// ClaimLease.
	ClaimMode ClaimMode

	// InitializeSchema creates a topic's tables on Subscribe. Without it, Subscribe checks
	// that they exist and fails with a MissingTableError naming the table. Defaults to false.
	InitializeSchema bool

	// Schema is the PostgreSQL schema of the tables. Defaults to "" (the search_path).
	Schema string

	// TablePrefix starts every table name. Defaults to DefaultTablePrefix.
	TablePrefix string

	// StartAtNewest makes a consumer group that does not exist yet start after the messages
	// already committed, instead of at the oldest message kept. Defaults to false.
	StartAtNewest bool

	// MaxInFlight bounds the messages of one subscription that are in handlers at once. A
	// subscription also holds up to BatchSize more claimed ahead, handed out as handler slots
	// free (and given back at once when it stops), and acks waiting for their batched
	// statement. In advisory mode each of those claims holds a lock, and an ack keeps its
	// message's until its statement has run: a subscription holds at most
	// 2 x MaxInFlight + BatchSize advisory locks, besides those of messages settled within
	// the last few milliseconds (the next claim drops them) and, for a moment during an
	// orphan search, the locks of up to 256 orphans, dropped at once. With 1, and one
	// subscriber in the group, messages arrive in the commit order of their publishers, and
	// nothing is claimed ahead. A handler that never returns keeps its place and (in lease
	// mode, extended) its claim until Shutdown: the library cannot stop a goroutine, freeing
	// its place would run more than MaxInFlight handlers, and dropping its claim while it runs
	// would hand the message to a second consumer at the same time; bound handlers with their
	// message's context (Watermill's middleware.Timeout sets its deadline) and make them honour
	// it. Defaults to DefaultMaxInFlight.
	MaxInFlight int

	// OrderByKey keeps the order of messages with the same order key (MetadataOrderKey, or
	// PublisherConfig.OrderKey) within the consumer group, across all its subscribers and
	// processes: a message is handed to a handler only once every message of its key before
	// it in the group's order is settled (acked, or moved to the dead-letter topic), and never
	// beside another message of its key. Messages of different keys, and messages without a
	// key, run in parallel up to MaxInFlight. A nack, a lost lease or a delayed message holds
	// its key's later messages back until it is settled, so a message that keeps failing
	// blocks its key until MaxAttempts moves it to the dead-letter topic. Every subscriber of
	// a group must set it alike. The lease mode only, on PostgreSQL and SQLite; see the
	// README's "Ordering".
	OrderByKey bool

	// BatchSize bounds the messages claimed in one round trip; with MaxInFlight above 1 it is
	// also how many a subscription holds claimed ahead of its handlers. Defaults to
	// DefaultBatchSize. It is never more than MaxInFlight: a larger value, given or the
	// default, is lowered to MaxInFlight (NewSubscriber logs it at Info when it was given).
	BatchSize int

	// PollInterval is, while a subscription finds messages, how often it also looks for
	// claims due again that it cannot know of (claims other consumers released, in the
	// advisory mode claims whose consumer is gone; leases of other consumers that ran out are
	// looked for every IdlePollInterval, as that look reads every claim of the group); and,
	// while the pool cannot deliver notifications (database/sql, or pgx while its LISTEN
	// connection is down), how often the process looks for work for its idle subscriptions.
	// That look is one
	// statement per pool for up to 64 idle subscriptions, not one per subscription: a service
	// with 50 handlers on database/sql pays 10 statements a second at the default, whatever
	// the number of handlers up to 64, and a message published elsewhere reaches it within
	// about 100 ms. On SQLite it is how often each process looks whether the file changed,
	// which wakes its idle subscriptions, so another process's commit is seen within it.
	// Defaults to DefaultPollInterval.
	PollInterval time.Duration

	// IdlePollInterval is how often a busy subscription looks for leases of other consumers
	// that ran out, and how often, while the pool's LISTEN connection delivers
	// notifications (pgx), the process looks for work its idle subscriptions are not told of:
	// a lease of another consumer that ran out, a message the xmin horizon held back when its
	// notification came, in the advisory mode a claim whose consumer is gone, a message written
	// with notifications disabled. A new message wakes a subscription through its
	// notification at once; an idle subscription otherwise sleeps until one of its own claims
	// comes due (a nack's backoff, a lost lease, the time of a delayed message its claims
	// passed) or this shared look finds work for it, and
	// runs a claim of its own only every 30 IdlePollIntervals besides. The look is one
	// statement per pool for up to 64 idle subscriptions: a service with 50 handlers pays one
	// statement a second at the default, where polling each subscription every PollInterval
	// would cost 500. On SQLite an idle subscription claims by itself this often, for leases
	// of other processes that ran out (they change nothing in the file). Defaults to
	// DefaultIdlePollInterval, or PollInterval if that is longer.
	IdlePollInterval time.Duration

	// LeaseTTL is how long a claim stays with this subscriber without being extended (lease
	// mode). A consumer that dies leaves its messages for this long. Defaults to
	// DefaultLeaseTTL.
	LeaseTTL time.Duration

	// LeaseRenewInterval is how often the leases of messages in work are extended. An
	// extension that cannot run meanwhile (blocked on a table lock, a slow server) is
	// cancelled on the server once this long has passed, and tried again at the next
	// interval; a lease whose deadline has passed before an extension succeeded is lost: the
	// message's context is cancelled with ErrLeaseLost, and its settlement is refused if
	// another consumer took the message. Defaults to LeaseTTL/3.
	LeaseRenewInterval time.Duration

	// NackBackoff is how long a message nacked at its first attempt waits before it can be
	// claimed again. Each further attempt doubles the wait, up to MaxNackBackoff, and a random
	// part of up to a fifth more is added, so that the subscribers of a group that fail
	// together do not come back together. A handler that fails on every message thus waits
	// 1 s, 2 s, 4 s, ... between attempts instead of spinning. NoBackoff redelivers a nacked
	// message at once. Defaults to DefaultNackBackoff.
	NackBackoff time.Duration

	// MaxNackBackoff caps the wait of a nacked message. It must not be shorter than
	// NackBackoff. Defaults to DefaultMaxNackBackoff (or NackBackoff, if that is longer).
	MaxNackBackoff time.Duration

	// MaxAttempts, when above 0, bounds the deliveries of a message within the consumer
	// group: a message nacked at its MaxAttempts-th attempt, or claimed again after that many
	// (its leases lost, its consumers gone), is moved to DeadLetterTopic instead, in the same
	// statement that settles its claim (on SQLite, the same write transaction): it is never
	// both there and due again, and never lost. Defaults to 0: no bound, a message is delivered until it is acked (Watermill's
	// PoisonQueue middleware then does the same in the Router).
	MaxAttempts int

	// DeadLetterTopic is where MaxAttempts moves a message, with its original topic, consumer
	// group, attempts and offset in its metadata (MetadataDeadLetterTopic and the keys
	// beside it). Defaults to the subscribed topic followed by DefaultDeadLetterSuffix
	// ("orders" moves to "orders.dead-letter"). Its tables are created on Subscribe with
	// InitializeSchema, and must exist otherwise.
	DeadLetterTopic string

	// RetryInterval is how long a subscription waits after a database error before it tries
	// again. Defaults to DefaultRetryInterval.
	RetryInterval time.Duration

	// CloseTimeout bounds Close, which runs Shutdown with it. Defaults to DefaultCloseTimeout.
	CloseTimeout time.Duration

	// Retention deletes messages that every consumer group of the topic has settled once
	// they are older than this; each subscription prunes its topic every Retention/10 (at
	// least every second, at most every minute). On PostgreSQL messages go a partition of
	// the messages table at a time (at least 100,000 offsets): a partition is dropped once
	// every group has passed every message in it, no claim holds any of them and all are
	// older than Retention, which needs the tables' owner; the partition being filled stays.
	// A consumer group that is no longer used still counts: delete its row of the groups
	// table to stop it holding messages back. Defaults to 0: messages are kept, so that a new
	// consumer group can read the topic from its oldest message.
	Retention time.Duration

	// SynchronousCommit makes claims, lease extensions, acks and nacks wait for their WAL
	// record to reach disk, like any other transaction. By default they commit with
	// synchronous_commit = off, for their own transaction only: they then cost no disk flush
	// each, and a server crash can forget the last fraction of a second of them (up to three
	// times wal_writer_delay), whose messages are then delivered again, as at-least-once
	// delivery allows. Published messages are always committed synchronously. Defaults to
	// false.
	SynchronousCommit bool

	// LockCheckInterval is how often the advisory mode pings an idle lock connection, to find
	// out that it died (and its locks with it) and open it again. Defaults to
	// DefaultLockCheckInterval.
	LockCheckInterval time.Duration

	// LockWaitTimeout is how long a statement on the advisory mode's lock connection waits for
	// a table or row lock that another session holds (a migration's ALTER TABLE, a CREATE
	// INDEX without CONCURRENTLY, a VACUUM FULL) before the server ends it: the session's
	// lock_timeout. A claim ended so takes nothing and is tried again after RetryInterval; the
	// lock connection and the locks of the deliveries in work stay. Defaults to
	// DefaultLockWaitTimeout.
	LockWaitTimeout time.Duration
}

func (c *SubscriberConfig) setDefaults() {
	if c.ConsumerGroup == "" {
		c.ConsumerGroup = DefaultConsumerGroup
	}
	if c.TablePrefix == "" {
		c.TablePrefix = DefaultTablePrefix
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = DefaultMaxInFlight
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.BatchSize > c.MaxInFlight && c.MaxInFlight > 0 {
		c.BatchSize = c.MaxInFlight
	}
	if c.PollInterval == 0 {
		c.PollInterval = DefaultPollInterval
	}
	if c.IdlePollInterval == 0 {
		c.IdlePollInterval = max(DefaultIdlePollInterval, c.PollInterval)
	}
	if c.LeaseTTL == 0 {
		c.LeaseTTL = DefaultLeaseTTL
	}
	if c.LeaseRenewInterval == 0 {
		c.LeaseRenewInterval = c.LeaseTTL / defaultLeaseRenewFraction
	}
	if c.RetryInterval == 0 {
		c.RetryInterval = DefaultRetryInterval
	}
	if c.NackBackoff == 0 {
		c.NackBackoff = DefaultNackBackoff
	}
	if c.MaxNackBackoff == 0 {
		c.MaxNackBackoff = max(DefaultMaxNackBackoff, c.NackBackoff)
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = DefaultCloseTimeout
	}
	if c.LockCheckInterval == 0 {
		c.LockCheckInterval = DefaultLockCheckInterval
	}
	if c.LockWaitTimeout == 0 {
		c.LockWaitTimeout = DefaultLockWaitTimeout
	}
}

func (c *SubscriberConfig) validate() error {
	if err := validateName("ConsumerGroup", c.ConsumerGroup); err != nil {
		return err
	}
	if c.ClaimMode != ClaimLease && c.ClaimMode != ClaimAdvisoryLock {
		return &ConfigError{Field: "ClaimMode", Value: int(c.ClaimMode), Reason: "must be ClaimLease or ClaimAdvisoryLock"}
	}
	if err := validateIdentifier("Schema", c.Schema, maxSchemaNameLength, true); err != nil {
		return err
	}
	if err := validateIdentifier("TablePrefix", c.TablePrefix, maxTablePrefixLength, false); err != nil {
		return err
	}
	positive := []struct {
		name string
		v    int
	}{{"MaxInFlight", c.MaxInFlight}, {"BatchSize", c.BatchSize}, {"MaxAttempts", c.MaxAttempts}}
	for _, p := range positive {
		if p.v < 0 {
			return &ConfigError{Field: p.name, Value: p.v, Reason: "must not be negative"}
		}
	}
	durations := []struct {
		name string
		v    time.Duration
	}{
		{"PollInterval", c.PollInterval}, {"IdlePollInterval", c.IdlePollInterval}, {"LeaseTTL", c.LeaseTTL}, {"LeaseRenewInterval", c.LeaseRenewInterval},
		{"MaxNackBackoff", c.MaxNackBackoff}, {"RetryInterval", c.RetryInterval}, {"CloseTimeout", c.CloseTimeout},
		{"Retention", c.Retention},
		{"LockCheckInterval", c.LockCheckInterval}, {"LockWaitTimeout", c.LockWaitTimeout},
	}
	for _, d := range durations {
		if d.v < 0 {
			return &ConfigError{Field: d.name, Value: d.v, Reason: "must not be negative"}
		}
	}
	if c.DeadLetterTopic != "" {
		if err := validateName("DeadLetterTopic", c.DeadLetterTopic); err != nil {
			return err
		}
	}
	if c.NackBackoff < 0 && c.NackBackoff != NoBackoff {
		return &ConfigError{Field: "NackBackoff", Value: c.NackBackoff, Reason: "must not be negative (NoBackoff redelivers at once)"}
	}
	if c.NackBackoff > c.MaxNackBackoff {
		return &ConfigError{Field: "MaxNackBackoff", Value: c.MaxNackBackoff, Reason: "must not be shorter than NackBackoff (" + c.NackBackoff.String() + ")"}
	}
	if c.LeaseTTL < minLeaseTTL {
		return &ConfigError{Field: "LeaseTTL", Value: c.LeaseTTL, Reason: "must be at least " + minLeaseTTL.String()}
	}
	if c.LeaseRenewInterval >= c.LeaseTTL {
		return &ConfigError{Field: "LeaseRenewInterval", Value: c.LeaseRenewInterval, Reason: "must be shorter than LeaseTTL (" + c.LeaseTTL.String() + ")"}
	}
	if c.OrderByKey && c.ClaimMode == ClaimAdvisoryLock {
		return &ConfigError{Field: "OrderByKey", Value: true, Reason: "needs the lease mode (ClaimLease): the advisory-lock mode does not keep order by key yet"}
	}
	return nil
}

// validateOn checks the config against what the database of dialect d can do.
func (c *SubscriberConfig) validateOn(d dbx.Dialect) error {
	if c.OrderByKey && !d.OrderedClaims {
		return &ConfigError{Field: "OrderByKey", Value: true, Reason: "is not available on " + d.Name + " yet: keep order there with MaxInFlight 1 and one subscriber"}
	}
	if c.ClaimMode == ClaimAdvisoryLock && !d.AdvisoryLocks {
		return &ConfigError{Field: "ClaimMode", Value: c.ClaimMode.String(), Reason: "needs PostgreSQL's session advisory locks, which " + d.Name + " does not have: use ClaimLease (the lease mode) on " + d.Name}
	}
	return schemaOn(d, c.Schema)
}

// schemaOn refuses a Schema on a database that has no schemas.
func schemaOn(d dbx.Dialect, schema string) error {
	if schema != "" && !d.Schemas {
		return &ConfigError{Field: "Schema", Value: schema, Reason: "is PostgreSQL's: a " + d.Name + " database has no schemas, leave it empty"}
	}
	return nil
}

// ConsumerGroup is the consumer group the subscriber claims for (after defaults).
func (s *Subscriber) ConsumerGroup() string { return s.config.ConsumerGroup }

// ClaimMode is the subscriber's claim mode.
func (s *Subscriber) ClaimMode() ClaimMode { return s.config.ClaimMode }
