// Command manual drives a subscriber by hand, without a Router, on the caller's own pool: it
// publishes export requests, works them 16 at a time, and after -run-for calls Shutdown while
// exports are still in work. It then prints the CloseReport with what each figure means, and
// drops the example's tables (-keep keeps them, so that the next run picks up what this one
// left).
//
//	go run ./_examples/manual -url postgres://postgres@127.0.0.1:5432/test?sslmode=disable
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
)

const (
	topic = "exports"
	// prefix names the example's tables: manual_exports_messages and its companions.
	prefix = "manual_"
	// leaseTTL is short so that the messages left in work come back soon in a next run.
	leaseTTL = 5 * time.Second
)

func main() {
	url := flag.String("url", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable", "PostgreSQL URL")
	publish := flag.Int("publish", 60, "export requests to publish at start-up")
	work := flag.Duration("work", 200*time.Millisecond, "how long one export takes")
	runFor := flag.Duration("run-for", 500*time.Millisecond, "how long to work before shutting down")
	keep := flag.Bool("keep", false, "keep the example's tables and what is left in them")
	flag.Parse()
	if err := run(*url, *publish, *work, *runFor, *keep); err != nil {
		log.Fatal(err)
	}
}

func run(url string, publish int, work, runFor time.Duration, keep bool) error {
	ctx := context.Background()
	logger := watermill.NewStdLogger(false, false)

	// The service's own pool: the library never closes it; the service does, at the end.
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	db := sqlbroker.Pgx(pool)

	// The tables, created from the exported schema as a migration would, before the
	// subscriber checks them.
	ddl, err := sqlbroker.SchemaSQL(topic, "", prefix)
	if err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, ddl); err != nil {
		return err
	}
	if !keep {
		defer func() {
			drop, _ := sqlbroker.DropSQL(topic, "", prefix)
			if _, err := pool.Exec(ctx, drop); err != nil {
				log.Printf("dropping the example's tables: %v", err)
				return
			}
			fmt.Println("dropped the example's tables (-keep keeps them for the next run)")
		}()
	}

	pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{TablePrefix: prefix}, logger)
	if err != nil {
		return err
	}
	defer pub.Close()
	for i := range publish {
		msg := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, `{"export":%d}`, i+1))
		if err := pub.Publish(topic, msg); err != nil {
			return err
		}
	}

	const inFlight = 16
	sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{
		ConsumerGroup: "exporter",
		TablePrefix:   prefix,
		MaxInFlight:   inFlight,
		LeaseTTL:      leaseTTL,
	}, logger)
	if err != nil {
		return err
	}
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		return err
	}

	// The handlers: one goroutine per message, at most MaxInFlight at once (the subscriber
	// hands out no more).
	var exported, interrupted atomic.Int64
	var wg sync.WaitGroup
	for msg := range until(msgs, time.After(runFor)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			select {
			case <-time.After(work): // the export itself
				msg.Ack()
				exported.Add(1)
			case <-msg.Context().Done():
				// The shutdown cancelled the delivery; its lease is left to run out.
				msg.Nack()
				interrupted.Add(1)
			}
		}()
	}

	// By hand: shut down while exports are in work. Claims not yet handed out go back at once;
	// the deliveries in work have their contexts cancelled and keep their leases, which run
	// out, so those messages come back to the group after LeaseTTL.
	shutdownCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	report, err := sub.Shutdown(shutdownCtx)
	wg.Wait()

	fmt.Printf("published %d, exported %d before the shutdown, %d interrupted by it\n", publish, exported.Load(), interrupted.Load())
	fmt.Printf("shut down in %v:\n", report.Duration.Round(time.Millisecond))
	explain("subscriptions stopped", report.Subscriptions, "")
	explain("claims given back", report.ClaimsReleased, "claimed ahead of the handlers, claimable again at once")
	explain("deliveries in work", report.DeliveriesInWork, "in handlers when the shutdown came; their contexts were cancelled")
	explain("leases left to run out", report.LeasesLeft, fmt.Sprintf("their messages return to the group after %v", leaseTTL))
	explain("statements cancelled", report.QueriesCancelled, "a claim or settlement the shutdown cancelled on the server and waited for")
	explain("settlements not applied", report.SettlementsNotApplied, "acks or nacks the shutdown could not apply in time")
	left := publish - int(exported.Load())
	fmt.Printf("left for the next run: %d messages (%d at once, the rest once their leases run out)\n", left, left-report.LeasesLeft)
	return err
}

// explain prints one figure of the report with what it means.
func explain(what string, n int, meaning string) {
	if meaning == "" || n == 0 {
		fmt.Printf("  %-24s %3d\n", what, n)
		return
	}
	fmt.Printf("  %-24s %3d  (%s)\n", what, n, meaning)
}

// until passes on the messages of in until stop fires or in closes.
func until(in <-chan *message.Message, stop <-chan time.Time) <-chan *message.Message {
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		for {
			select {
			case msg, ok := <-in:
				if !ok {
					return
				}
				out <- msg
			case <-stop:
				return
			}
		}
	}()
	return out
}
