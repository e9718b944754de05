package sqlbroker_test

import (
	"context"
	"database/sql"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "modernc.org/sqlite" // the SQLite driver: the program imports it, as with database/sql

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
)

// A broker built from a URL owns its database handle; under a Router, the hook shuts the
// broker down when the Router closes, after the handlers have drained, and closes the handle
// last. The example runs on an in-memory SQLite database; a postgres:// URL works the same.
func ExampleOpen() {
	broker, err := sqlbroker.Open("sqlite::memory:", sqlbroker.BrokerConfig{}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	pub, _ := broker.NewPublisher(sqlbroker.PublisherConfig{InitializeSchema: true})
	sub, _ := broker.NewSubscriber(sqlbroker.SubscriberConfig{ConsumerGroup: "exporter", InitializeSchema: true})

	const closeTimeout = 10 * time.Second
	router, _ := message.NewRouter(message.RouterConfig{CloseTimeout: closeTimeout}, watermill.NopLogger{})
	hook := sqlbroker.NewRouterHook(broker, sqlbroker.RouterHookConfig{CloseTimeout: closeTimeout})
	router.AddPlugin(hook.Plugin)

	var mu sync.Mutex
	var got []string
	router.AddNoPublisherHandler("export", "exports", sub, func(msg *message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, string(msg.Payload))
		if len(got) == 3 {
			go router.Close() // all handled: stop the service
		}
		return nil
	})
	for _, p := range []string{"a", "b", "c"} {
		if err := pub.Publish("exports", message.NewMessage(watermill.NewUUID(), []byte(p))); err != nil {
			panic(err)
		}
	}
	if err := router.Run(context.Background()); err != nil {
		panic(err)
	}
	report, err := hook.Report()
	sort.Strings(got)
	fmt.Println("handled:", got)
	fmt.Println("subscriptions stopped:", report.Subscriptions, "error:", err)
	fmt.Println("publish after shutdown:", pub.Publish("exports", message.NewMessage(watermill.NewUUID(), nil)))
	// Output:
	// handled: [a b c]
	// subscriptions stopped: 1 error: <nil>
	// publish after shutdown: sqlbroker: closed
}

// NewPublisher and NewSubscriber take a database the caller owns (Pgx, StdSQL or SQLite),
// which the library never closes. Without a Router, Subscribe returns the channel of
// messages; each one is acked or nacked by the caller, and Shutdown returns a CloseReport.
func ExampleNewSubscriber() {
	broker, err := sqlbroker.Open("sqlite::memory:", sqlbroker.BrokerConfig{}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	defer broker.Close()
	pub, _ := broker.NewPublisher(sqlbroker.PublisherConfig{InitializeSchema: true})
	sub, _ := broker.NewSubscriber(sqlbroker.SubscriberConfig{ConsumerGroup: "billing", InitializeSchema: true, MaxInFlight: 1})

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := sub.Subscribe(ctx, "orders")
	if err != nil {
		panic(err)
	}
	_ = pub.Publish("orders",
		message.NewMessage(watermill.NewUUID(), []byte(`{"id":1}`)),
		message.NewMessage(watermill.NewUUID(), []byte(`{"id":2}`)))
	for range 2 {
		msg := <-msgs
		attempt, _ := sqlbroker.AttemptFromContext(msg.Context())
		fmt.Printf("%s, attempt %d\n", msg.Payload, attempt)
		msg.Ack()
	}
	report, err := sub.Shutdown(context.Background())
	fmt.Println("subscriptions stopped:", report.Subscriptions, "error:", err)
	// Output:
	// {"id":1}, attempt 1
	// {"id":2}, attempt 1
	// subscriptions stopped: 1 error: <nil>
}

// A publisher on the caller's transaction (the outbox pattern): its messages become visible
// exactly when the transaction commits, and never if it rolls back.
func ExamplePgxTx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://app@db/app")
	if err != nil {
		panic(err)
	}
	defer pool.Close()

	tx, err := pool.Begin(ctx)
	if err != nil {
		panic(err)
	}
	defer tx.Rollback(ctx)
	// ... the service's own writes in tx ...
	pub, err := sqlbroker.NewPublisher(sqlbroker.PgxTx(tx), sqlbroker.PublisherConfig{}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	if err := pub.Publish("orders.created", message.NewMessage(watermill.NewUUID(), []byte(`{"id":1}`))); err != nil {
		panic(err)
	}
	if err := tx.Commit(ctx); err != nil {
		panic(err)
	}
}

// NewPublisher on a database handle of the caller's (here SQLite's; Pgx and StdSQL wrap
// PostgreSQL pools): one Publish call writes all its messages or none.
func ExampleNewPublisher() {
	db, err := sql.Open("sqlite", "file:/example-publisher?vfs=memdb")
	if err != nil {
		panic(err)
	}
	defer db.Close() // the caller's handle: the library never closes it
	pub, err := sqlbroker.NewPublisher(sqlbroker.SQLite(db), sqlbroker.PublisherConfig{InitializeSchema: true}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	err = pub.Publish("orders",
		message.NewMessage(watermill.NewUUID(), []byte(`{"id":1}`)),
		message.NewMessage(watermill.NewUUID(), []byte(`{"id":2}`)))
	fmt.Println("published:", err)
	var n int
	_ = db.QueryRow(`SELECT count(*) FROM "sqlbroker_orders_messages"`).Scan(&n)
	fmt.Println("rows:", n)
	fmt.Println("closed:", pub.Close())
	// Output:
	// published: <nil>
	// rows: 2
	// closed: <nil>
}
