package sqlbroker_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// A NUL character is valid UTF-8, but PostgreSQL cannot store it in text: Publish refuses it
// with an error that says so and names the field (and the key), on every database alike; text
// that is not UTF-8 is refused as such.
func TestPublisher_nulCharacterRefusedAsSuch(t *testing.T) {
	t.Parallel()
	for _, d := range allDrivers {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			topic := testdb.Topic(t, "")
			pub := newPublisher(t, d.open(t))
			with := func(uuid, k, v string) *message.Message {
				m := message.NewMessage(uuid, []byte("x"))
				m.Metadata.Set(k, v)
				return m
			}
			const nul = "contains a NUL character, which PostgreSQL cannot store in text"
			for _, c := range []struct {
				name string
				msg  *message.Message
				want string
			}{
				{"value", with(watermill.NewUUID(), "k", "a\x00b"), `metadata value of key "k" ` + nul},
				{"key", with(watermill.NewUUID(), "k\x00", "v"), `metadata key "k\x00" ` + nul},
				{"uuid", with("id\x00", "k", "v"), "UUID " + nul},
				{"not utf-8", with(watermill.NewUUID(), "k", "\xff"), `metadata value of key "k" is not valid UTF-8 text`},
			} {
				err := pub.Publish(topic, c.msg)
				require.Error(t, err, c.name)
				assert.Contains(t, err.Error(), c.want, c.name)
				if c.name != "not utf-8" {
					assert.NotContains(t, err.Error(), "UTF-8", c.name+": a NUL is valid UTF-8")
				}
			}
		})
	}
}
