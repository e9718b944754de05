// Command manual is the "exports" service of _examples/shutdown, driven by hand: the
// subscriber is built on the caller's own pool, its handler reads a differently named source
// table (the tables of topic "exports" under the prefix "inbox_"), and the service calls
// Shutdown itself after the Router has stopped, then closes its own pool.
//
//	go run ./_examples/manual -url postgres://postgres@127.0.0.1:5432/test?sslmode=disable
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
)

const (
	topic = "exports"
	// source names the tables the handler reads: inbox_exports_messages and its companions.
	source = "inbox_"
)

func main() {
	url := flag.String("url", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable", "PostgreSQL URL")
	publish := flag.Int("publish", 20, "export requests to publish at start-up")
	work := flag.Duration("work", 200*time.Millisecond, "how long one export takes")
	runFor := flag.Duration("run-for", 0, "stop after this long (0: run until SIGINT or SIGTERM)")
	flag.Parse()
	if err := run(*url, *publish, *work, *runFor); err != nil {
		log.Fatal(err)
	}
}

func run(url string, publish int, work, runFor time.Duration) error {
	logger := watermill.NewStdLogger(false, false)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	// The service's own pool: the library never closes it; the service does, after Run.
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		return err
	}
	defer pool.Close()
	db := sqlbroker.Pgx(pool)

	// The source table, created at start-up from the exported schema, before the subscription
	// checks it.
	ddl, err := sqlbroker.SchemaSQL(topic, "", source)
	if err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, ddl); err != nil {
		return err
	}

	sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{ConsumerGroup: "exporter", TablePrefix: source, MaxInFlight: 16}, logger)
	if err != nil {
		return err
	}
	pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{TablePrefix: source}, logger)
	if err != nil {
		return err
	}
	for i := range publish {
		msg := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, `{"export":%d}`, i+1))
		if err := pub.Publish(topic, msg); err != nil {
			return err
		}
	}

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	router.AddNoPublisherHandler("export", topic, sub, func(msg *message.Message) error {
		select {
		case <-time.After(work):
			fmt.Printf("exported %s\n", msg.Payload)
			return nil
		case <-msg.Context().Done():
			return context.Cause(msg.Context())
		}
	})

	runCtx := ctx
	if runFor > 0 {
		var cancel context.CancelFunc
		runCtx, cancel = context.WithTimeout(ctx, runFor)
		defer cancel()
	}
	// Cancelling Run's context stops the subscriptions (claims not yet handed to a handler go
	// back at once) and the Router waits for the handlers in work. Router.Close would instead
	// call the subscriber's Close, which is the whole shutdown, before the handlers drained.
	if err := router.Run(runCtx); err != nil {
		return err
	}

	// By hand: the Router has drained; shut the subscriber down and read what it did.
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	report, err := sub.Shutdown(shutdownCtx)
	fmt.Printf("shut down: %+v\n", report)
	if cerr := pub.Close(); cerr != nil && err == nil {
		err = cerr
	}
	return err
}
