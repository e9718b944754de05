// Command shutdown is the "exports" service: a Watermill Router consuming export requests
// from SQLite (the file exports.db, by default) or PostgreSQL through a broker built from a URL,
// with handlers that take some time. On
// SIGINT or SIGTERM, or after -run-for (1 s by default, while exports are still in work), it
// stops taking messages, lets the handlers in work finish (the graceful drain), shuts the
// library down, closes the pool the library built, and prints the CloseReport. The exports
// not yet started stay in the database for the next run.
//
//	go run ./_examples/shutdown
//	go run ./_examples/shutdown -run-for 0   # until Ctrl-C
//	go run ./_examples/shutdown -url postgres://postgres@127.0.0.1:5432/test?sslmode=disable
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "modernc.org/sqlite" // the SQLite driver behind sqlite: URLs

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
)

const topic = "exports"

func main() {
	url := flag.String("url", "sqlite:exports.db?mode=rwc", "database URL: sqlite:file.db?mode=rwc, or a PostgreSQL URL (postgres://, libpq+postgres:// for lib/pq)")
	publish := flag.Int("publish", 200, "export requests to publish at start-up")
	work := flag.Duration("work", 200*time.Millisecond, "how long one export takes")
	runFor := flag.Duration("run-for", time.Second, "stop after this long (0: run until SIGINT or SIGTERM)")
	flag.Parse()
	if err := run(*url, *publish, *work, *runFor); err != nil {
		log.Fatal(err)
	}
}

func run(url string, publish int, work, runFor time.Duration) error {
	logger := watermill.NewStdLogger(false, false)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if runFor > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, runFor)
		defer cancel()
	}

	// Nothing connects here: the broker builds its pool on first use, and closes it when the
	// service stops, after the handlers have drained.
	broker, err := sqlbroker.Open(url, sqlbroker.BrokerConfig{}, logger)
	if err != nil {
		return err
	}

	// The table, created at start-up, before the subscription checks it.
	if err := broker.InitializeSchema(ctx, sqlbroker.PublisherConfig{}, topic); err != nil {
		return err
	}
	sub, err := broker.NewSubscriber(sqlbroker.SubscriberConfig{ConsumerGroup: "exporter", MaxInFlight: 16})
	if err != nil {
		return err
	}
	pub, err := broker.NewPublisher(sqlbroker.PublisherConfig{})
	if err != nil {
		return err
	}
	for i := range publish {
		msg := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, `{"export":%d}`, i+1))
		if err := pub.Publish(topic, msg); err != nil {
			return err
		}
	}

	const closeTimeout = 10 * time.Second
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: closeTimeout}, logger)
	if err != nil {
		return err
	}
	hook := sqlbroker.NewRouterHook(broker, sqlbroker.RouterHookConfig{CloseTimeout: closeTimeout})
	router.AddPlugin(hook.Plugin)
	var inWork atomic.Int64
	go func() {
		<-ctx.Done()
		fmt.Printf("stopping: no new exports; %d in work are let finish\n", inWork.Load())
	}()
	router.AddNoPublisherHandler("export", topic, sub, func(msg *message.Message) error {
		inWork.Add(1)
		defer inWork.Add(-1)
		select {
		case <-time.After(work): // the export itself
			fmt.Printf("exported %s\n", msg.Payload)
			return nil
		case <-msg.Context().Done():
			return context.Cause(msg.Context())
		}
	})

	// Run returns once the handlers have drained and the broker has shut down and closed the
	// pool it built.
	if err := router.Run(ctx); err != nil {
		return err
	}
	report, err := hook.Report()
	fmt.Printf("shut down in %v: %d subscription stopped, %d claims held ahead given back at once, "+
		"%d deliveries still in work at the end (the drain let the others finish), %d connections closed\n",
		report.Duration.Round(time.Millisecond), report.Subscriptions, report.ClaimsReleased,
		report.DeliveriesInWork, report.ConnectionsClosed)
	fmt.Printf("full report: %+v\n", report)
	fmt.Println("the exports not handled stay in the database for the next run")
	return err
}
