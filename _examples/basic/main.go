// Command basic publishes a few messages and consumes them through a Watermill Router, then
// shuts down and prints what the shutdown did. By default it runs on an in-memory SQLite
// database, with no server; -url takes a PostgreSQL or a MySQL URL instead:
//
//	go run ./_examples/basic
//	go run ./_examples/basic -url postgres://postgres@127.0.0.1:5432/test?sslmode=disable
//	go run ./_examples/basic -url mysql://root@127.0.0.1:3306/test
package main

import (
	"context"
	"database/sql"
	"flag"
	"fmt"
	"log"
	"os"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/go-sql-driver/mysql" // the MySQL driver behind mysql:// URLs
	"github.com/jackc/pgx/v5/pgxpool"
	_ "modernc.org/sqlite" // the SQLite driver behind sqlite: URLs

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
)

func main() {
	url := flag.String("url", "sqlite::memory:", "database URL: sqlite:file.db?mode=rwc, sqlite::memory:, postgres://user@host/db or mysql://user@host:3306/db")
	count := flag.Int("n", 5, "messages to publish")
	flag.Parse()
	if err := run(*url, *count); err != nil {
		log.Fatal(err)
	}
}

func run(url string, count int) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	logger := watermill.NewStdLogger(false, false)
	broker, err := sqlbroker.Open(url, sqlbroker.BrokerConfig{}, logger) // the broker owns its pool
	if err != nil {
		return err
	}
	defer broker.Close()

	pub, err := broker.NewPublisher(sqlbroker.PublisherConfig{InitializeSchema: true})
	if err != nil {
		return err
	}
	sub, err := broker.NewSubscriber(sqlbroker.SubscriberConfig{
		ConsumerGroup:    "basic-example",
		InitializeSchema: true,
	})
	if err != nil {
		return err
	}

	// A topic of its own for every run, so a run reads only what it published. In lower case:
	// on SQLite, a topic with an upper-case letter has a hash in its table names.
	topic := "basic-example." + strings.ToLower(watermill.NewShortUUID())
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
	report, err := broker.Shutdown(ctx)
	if err != nil {
		return err
	}
	// Every message was handled before the Router closed, so nothing was in work and no claim
	// was held: the figures that count are the subscription stopped and the pool's connections.
	fmt.Fprintf(os.Stdout, "shut down in %v: %d subscription stopped, %d connections of the broker's pool closed, "+
		"%d deliveries in work, %d claims given back (all %d messages were handled first)\n",
		report.Duration.Round(time.Microsecond), report.Subscriptions, report.ConnectionsClosed,
		report.DeliveriesInWork, report.ClaimsReleased, count)
	if strings.Contains(url, ":memory:") {
		fmt.Println("the in-memory database, and the example's tables with it, went with the pool")
		return nil
	}
	fmt.Println("dropping the example's tables")
	return dropTopic(ctx, url, topic)
}

// dropTopic removes the example's tables: on PostgreSQL, whichever driver the URL names, in a
// SQLite file, and on MySQL.
func dropTopic(ctx context.Context, url, topic string) error {
	if strings.HasPrefix(url, "mysql://") {
		ddl, err := sqlbroker.MySQLDropSQL(topic, "")
		if err != nil {
			return err
		}
		b, err := sqlbroker.Open(url, sqlbroker.BrokerConfig{}, nil)
		if err != nil {
			return err
		}
		defer b.Close()
		_, err = b.SQLDB().ExecContext(ctx, ddl)
		return err
	}
	ddl, err := sqlbroker.DropSQL(topic, "", "")
	if err != nil {
		return err
	}
	if file, ok := strings.CutPrefix(url, "sqlite:"); ok {
		db, err := sql.Open("sqlite", "file:"+file)
		if err != nil {
			return err
		}
		defer db.Close()
		// SQLite drops one table per statement: "DROP TABLE IF EXISTS a, b, c" becomes three.
		for _, table := range strings.Split(strings.TrimPrefix(ddl, "DROP TABLE IF EXISTS "), ", ") {
			if _, err := db.ExecContext(ctx, "DROP TABLE IF EXISTS "+table); err != nil {
				return err
			}
		}
		return nil
	}
	// libpq+postgres:// names lib/pq for the broker; the URL after the prefix is the same
	// connection string for pgx.
	pool, err := pgxpool.New(ctx, strings.TrimPrefix(url, "libpq+"))
	if err != nil {
		return err
	}
	defer pool.Close()
	_, err = pool.Exec(ctx, ddl)
	return err
}
