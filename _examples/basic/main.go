// Command basic publishes a few messages to PostgreSQL and consumes them through a Watermill
// Router, then shuts down and prints what the shutdown did.
//
//	go run ./_examples/basic -url postgres://postgres@127.0.0.1:5432/test?sslmode=disable
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
)

func main() {
	url := flag.String("url", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable", "PostgreSQL URL")
	count := flag.Int("n", 5, "messages to publish")
	flag.Parse()
	if err := run(*url, *count); err != nil {
		log.Fatal(err)
	}
}

func run(url string, count int) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close() // the caller's pool: the library never closes it
	db := sqlbroker.Pgx(pool)
	logger := watermill.NewStdLogger(false, false)

	pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: true}, logger)
	if err != nil {
		return err
	}
	defer pub.Close()
	sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{
		ConsumerGroup:    "basic-example",
		InitializeSchema: true,
	}, logger)
	if err != nil {
		return err
	}

	// A topic of its own for every run, so a run reads only what it published.
	topic := "basic-example." + watermill.NewShortUUID()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	received := make(chan struct{}, count)
	router.AddNoPublisherHandler("print", topic, sub, func(msg *message.Message) error {
		fmt.Printf("received %s: %s (attempt %s)\n", msg.UUID, msg.Payload, msg.Metadata.Get(sqlbroker.MetadataAttempt))
		received <- struct{}{}
		return nil
	})

	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(ctx) }()
	<-router.Running()

	for i := range count {
		msg := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, "hello #%d", i+1))
		if err := pub.Publish(topic, msg); err != nil {
			return err
		}
	}
	for range count {
		select {
		case <-received:
		case <-ctx.Done():
			return fmt.Errorf("waiting for messages: %w", ctx.Err())
		}
	}

	if err := router.Close(); err != nil {
		return err
	}
	if err := <-runErr; err != nil {
		return err
	}
	report, err := sub.Shutdown(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stdout, "shutdown: %+v\n", report)
	return dropTopic(ctx, pool, topic)
}

// dropTopic removes the example's tables.
func dropTopic(ctx context.Context, pool *pgxpool.Pool, topic string) error {
	ddl, err := sqlbroker.DropSQL(topic, "", "")
	if err != nil {
		return err
	}
	_, err = pool.Exec(ctx, ddl)
	return err
}
