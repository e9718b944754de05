// Command inspect sets up two topics, one consumed in each claim mode, with messages in work,
// a consumer group that is behind and a transaction holding delivery back, then runs
// `sqlbroker inspect` on them while that state holds (the README shows its output), and
// cleans up.
//
//	go run ./_examples/inspect -url postgres://postgres@127.0.0.1:5432/test?sslmode=disable
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/exec"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
)

const (
	orders   = "demo.orders"
	payments = "demo.payments"
)

func main() {
	url := flag.String("url", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable", "PostgreSQL URL")
	flag.Parse()
	if err := run(*url); err != nil {
		log.Fatal(err)
	}
}

func run(url string) error {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	db := sqlbroker.Pgx(pool)
	drop := func() {
		for _, topic := range []string{orders, payments} {
			if sql, err := sqlbroker.DropSQL(topic, "", ""); err == nil {
				_, _ = pool.Exec(ctx, sql)
			}
		}
	}
	drop()
	defer drop()

	pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: true}, nil)
	if err != nil {
		return err
	}
	defer pub.Close()
	publish := func(topic string, n int) error {
		for range n {
			if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("{}"))); err != nil {
				return err
			}
		}
		return nil
	}

	subscriber := func(group string, mode sqlbroker.ClaimMode) (*sqlbroker.Subscriber, error) {
		return sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{
			ConsumerGroup: group, ClaimMode: mode, InitializeSchema: true,
			MaxInFlight: 2, BatchSize: 1, NackBackoff: time.Minute,
		}, nil)
	}
	// "reporting" subscribes once, then stops: from then on it falls behind.
	reporting, err := subscriber("reporting", sqlbroker.ClaimLease)
	if err != nil {
		return err
	}
	if _, err := reporting.Subscribe(ctx, orders); err != nil {
		return err
	}
	if _, err := reporting.Shutdown(ctx); err != nil {
		return err
	}
	if err := publish(orders, 10); err != nil {
		return err
	}
	if err := publish(payments, 5); err != nil {
		return err
	}

	// "billing" (lease mode) and "ledger" (advisory mode) each have two messages in handlers
	// and one claimed ahead; billing nacked one before (it waits for its backoff).
	var subs []*sqlbroker.Subscriber
	defer func() {
		for _, s := range subs {
			_, _ = s.Shutdown(ctx)
		}
	}()
	for _, c := range []struct {
		topic, group string
		mode         sqlbroker.ClaimMode
		nack         bool
	}{{orders, "billing", sqlbroker.ClaimLease, true}, {payments, "ledger", sqlbroker.ClaimAdvisoryLock, false}} {
		s, err := subscriber(c.group, c.mode)
		if err != nil {
			return err
		}
		subs = append(subs, s)
		ch, err := s.Subscribe(ctx, c.topic)
		if err != nil {
			return err
		}
		if c.nack {
			(<-ch).Nack()
		}
		<-ch
		<-ch // two in handlers, never settled while inspect runs
	}
	time.Sleep(300 * time.Millisecond) // the claims ahead are taken

	// A transaction that took an xid and stays open holds the next message back.
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, "SELECT txid_current()"); err != nil {
		return err
	}
	if err := publish(orders, 1); err != nil {
		return err
	}
	time.Sleep(1500 * time.Millisecond)

	cmd := exec.Command("go", "run", "./cmd/sqlbroker", "inspect", "-url", url, "-topic", orders, "-topic", payments)
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	fmt.Println("$ sqlbroker inspect -topic demo.orders -topic demo.payments")
	return cmd.Run()
}
