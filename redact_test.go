package sqlbroker_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
)

// No string the broker produces (String, Open's errors, the shutdown log) shows a password,
// wherever the URL carries it: the userinfo, password= or sslpassword= (pgx: the passphrase
// of an encrypted key), sslkey= (lib/pq with sslinline: the private key itself), in any
// spelling the drivers decode (issue 15 item 6).
func TestOpen_passwordsNeverShown(t *testing.T) {
	t.Parallel()
	const secret = "s3cr3t-Pw"
	urls := []string{
		"postgres://u:" + secret + "@127.0.0.1:1/db",
		"postgres://u@127.0.0.1:1/db?password=" + secret,
		"postgres://u@127.0.0.1:1/db?sslmode=disable&password=" + secret + "&application_name=x",
		"postgres://u@127.0.0.1:1/db?sslpassword=" + secret,
		"postgres://u@127.0.0.1:1/db?pass%77ord=" + secret,
		"postgres://u@127.0.0.1:1/db?PASSWORD=" + secret,
		"postgres://u@127.0.0.1:1/db?password=" + strings.ReplaceAll(secret, "-", "%2D"),
		"libpq+postgres://u@127.0.0.1:1/db?password=" + secret,
		"libpq+postgres://u@127.0.0.1:1/db?sslinline=true&sslkey=" + secret,
		"pgx+postgres://u:" + secret + "@127.0.0.1:1/db?sslpassword=" + secret,
		// Refused by the driver: its error must not echo the password either.
		"postgres://u@127.0.0.1:1/db?connect_timeout=soon&password=" + secret,
		"postgres://u@127.0.0.1:1/db?connect_timeout=soon&sslkey=" + secret,
		"postgres://u:" + secret + "@127.0.0.1:1/db?connect_timeout=soon",
		// Not URLs: refused without showing them.
		"host=127.0.0.1 user=u password=" + secret,
		"postgres://u:" + secret + "@/db",
	}
	for _, u := range urls {
		t.Run(u, func(t *testing.T) {
			log := watermill.NewCaptureLogger()
			b, err := sqlbroker.Open(u, sqlbroker.BrokerConfig{}, log)
			if err != nil {
				assert.NotContains(t, err.Error(), "s3cr3t", "Open's error")
				return
			}
			assert.NotContains(t, b.String(), "s3cr3t", "String")
			assert.NotContains(t, fmt.Sprint(b), "s3cr3t", "String")
			_, err = b.Shutdown(context.Background())
			require.NoError(t, err)
			for _, msgs := range log.Captured() {
				for _, m := range msgs {
					assert.NotContains(t, fmt.Sprint(m.Msg, m.Fields, m.Err), "s3cr3t", "log %q", m.Msg)
				}
			}
		})
	}
}
