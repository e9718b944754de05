// Command deadletter leaves a dead-letter topic to look at: it publishes five invoices to
// demo.invoices, runs a Router whose handler fails two of them every time, so that
// MaxAttempts moves them to demo.invoices.dead-letter, and stops. Then look, and redrive:
//
//	go run ./_examples/deadletter -url postgres://postgres@127.0.0.1:5432/test?sslmode=disable
//	sqlbroker dead-letter list demo.invoices.dead-letter
//	sqlbroker peek demo.invoices.dead-letter
//	sqlbroker dead-letter redrive demo.invoices.dead-letter
//
// With -url sqlite:invoices.db?mode=rwc it does the same in a SQLite file. -drop drops the
// demo's tables and does nothing else.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "modernc.org/sqlite"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
)

const invoices = "demo.invoices"

func main() {
	url := flag.String("url", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable", "database URL")
	drop := flag.Bool("drop", false, "drop the demo's tables and stop")
	flag.Parse()
	if err := run(*url, *drop); err != nil {
		log.Fatal(err)
	}
}

func run(url string, drop bool) error {
	ctx := context.Background()
	if drop || !strings.HasPrefix(url, "sqlite:") {
		if err := dropTables(ctx, url); err != nil || drop {
			return err
		}
	}
	b, err := sqlbroker.Open(url, sqlbroker.BrokerConfig{}, nil)
	if err != nil {
		return err
	}
	defer b.Close()
	pub, err := b.NewPublisher(sqlbroker.PublisherConfig{InitializeSchema: true})
	if err != nil {
		return err
	}
	var msgs []*message.Message
	for i, customer := range []string{"acme", "", "globex", "initech", "umbrella"} {
		m := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf(`{"invoice": %d, "customer": %q}`, 1001+i, customer)))
		if i == 4 {
			m.Payload = []byte{0x1f, 0x8b, 0x08, 0x00, 0xde, 0xad, 0xbe, 0xef} // a gzip header: binary
		}
		m.Metadata.Set("trace_id", fmt.Sprintf("trace-%d", 1001+i))
		msgs = append(msgs, m)
	}
	if err := pub.Publish(invoices, msgs...); err != nil {
		return err
	}
	sub, err := b.NewSubscriber(sqlbroker.SubscriberConfig{ConsumerGroup: "billing", MaxAttempts: 3, InitializeSchema: true,
		NackBackoff: 20 * time.Millisecond, MaxNackBackoff: 50 * time.Millisecond})
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	router.AddNoPublisherHandler("bill", invoices, sub, func(m *message.Message) error {
		if strings.Contains(string(m.Payload), `"customer": ""`) || m.Payload[0] == 0x1f {
			return errors.New("no customer")
		}
		return nil
	})
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { _ = router.Run(rctx) }()
	<-router.Running()
	for sub.Stats().DeadLettered < 2 {
		select {
		case <-time.After(20 * time.Millisecond):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	cancel()
	_ = router.Close()
	fmt.Printf("2 of 5 invoices are in %s.dead-letter\n", invoices)
	return nil
}

// dropTables drops the demo's tables on PostgreSQL.
func dropTables(ctx context.Context, url string) error {
	if strings.HasPrefix(url, "sqlite:") {
		return errors.New("-drop: remove the SQLite file instead")
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	for _, topic := range []string{invoices, invoices + sqlbroker.DefaultDeadLetterSuffix} {
		sql, err := sqlbroker.DropSQL(topic, "", "")
		if err != nil {
			return err
		}
		if _, err := pool.Exec(ctx, sql); err != nil {
			return err
		}
	}
	return nil
}
