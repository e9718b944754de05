// Command acktx handles messages exactly once inside the database: the handler writes its
// result and acks the message in one transaction (sqlbroker.PgxTxHandler, which calls
// sqlbroker.AckInTx), so a message is either handled and settled, or neither. One order fails
// on its first attempt after its row was written: the transaction rolls back, the message comes
// back, and the table still ends with exactly one row per message. The example drops its tables.
//
//	go run ./_examples/acktx -url postgres://postgres@127.0.0.1:5432/test?sslmode=disable
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
)

func main() {
	url := flag.String("url", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable", "PostgreSQL URL")
	count := flag.Int("n", 10, "messages to publish")
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
	defer pool.Close()
	db := sqlbroker.Pgx(pool)
	logger := watermill.NewStdLogger(false, false)

	// The handler's own table, one of its own for every run: one row per order handled.
	orders := pgx.Identifier{"acktx_example_orders_" + watermill.NewShortUUID()}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+orders+` (
		message_uuid text PRIMARY KEY, payload text NOT NULL, handled_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return err
	}
	defer func() { _, _ = pool.Exec(context.Background(), `DROP TABLE `+orders) }()

	pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: true}, logger)
	if err != nil {
		return err
	}
	defer pub.Close()
	sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{
		ConsumerGroup:    "acktx-example",
		InitializeSchema: true,
		NackBackoff:      100 * time.Millisecond, // the failed order comes back quickly
	}, logger)
	if err != nil {
		return err
	}
	defer sub.Close()

	topic := "acktx-example." + watermill.NewShortUUID()
	defer func() {
		// The topic's tables, dropped once the subscriber and publisher are closed (deferred
		// calls run last first).
		if ddl, err := sqlbroker.DropSQL(topic, "", ""); err == nil {
			_, _ = pool.Exec(context.Background(), ddl)
		}
	}()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	handled := make(chan struct{}, count)
	// Begin, the function, AckInTx, commit: the row and the ack commit together. If the
	// message's claim was lost meanwhile (another consumer has it now), the ack fails with
	// sqlbroker.ErrLeaseLost, the transaction is rolled back, and the Router's nack is
	// refused: the other consumer writes the row instead.
	router.AddNoPublisherHandler("orders", topic, sub, sqlbroker.PgxTxHandler(pool,
		func(ctx context.Context, tx pgx.Tx, msg *message.Message) error {
			if _, err := tx.Exec(ctx, `INSERT INTO `+orders+` (message_uuid, payload) VALUES ($1, $2)`,
				msg.UUID, string(msg.Payload)); err != nil {
				return err
			}
			attempt := msg.Metadata.Get(sqlbroker.MetadataAttempt)
			if string(msg.Payload) == "order #3" && attempt == "1" {
				fmt.Printf("%s, attempt %s: row written, then the handler failed: row and ack roll back together\n", msg.Payload, attempt)
				return errors.New("order #3 fails on its first attempt")
			}
			fmt.Printf("%s, attempt %s: row written and message acked in one commit\n", msg.Payload, attempt)
			handled <- struct{}{}
			return nil
		}))

	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(ctx) }()
	<-router.Running()

	for i := range count {
		if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, "order #%d", i+1))); err != nil {
			return err
		}
	}
	for range count {
		select {
		case <-handled:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if err := router.Close(); err != nil {
		return err
	}
	if err := <-runErr; err != nil {
		return err
	}
	var rows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+orders).Scan(&rows); err != nil {
		return err
	}
	fmt.Printf("handled %d messages; the orders table holds %d rows, one per message (the failed attempt left none)\n", count, rows)
	fmt.Println("dropping the example's tables")
	return nil
}
