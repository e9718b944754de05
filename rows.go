package sqlbroker

import (
	"encoding/json"
	"fmt"
	"maps"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// rows validates messages and turns them into rows, before anything reaches the database.
func (p *Publisher) rows(topic string, messages []*message.Message) ([]offsets.Row, error) {
	rows := make([]offsets.Row, len(messages))
	seen := make(map[string]int, len(messages))
	for i, msg := range messages {
		if msg == nil {
			return nil, &PublishError{Topic: topic, Index: i, Reason: "message is nil"}
		}
		fail := func(reason string) error {
			return &PublishError{Topic: topic, Index: i, UUID: msg.UUID, Reason: reason}
		}
		if msg.UUID == "" {
			return nil, fail("UUID is empty")
		}
		if err := textOK(msg.UUID); err != "" {
			return nil, fail("UUID " + err)
		}
		if j, dup := seen[msg.UUID]; dup {
			return nil, fail(fmt.Sprintf("UUID is the same as message %d's in this call", j))
		}
		seen[msg.UUID] = i
		if len(msg.Payload) > p.config.MaxPayloadBytes {
			return nil, fail(fmt.Sprintf("payload is %d bytes, MaxPayloadBytes is %d", len(msg.Payload), p.config.MaxPayloadBytes))
		}
		md := msg.Metadata
		if p.config.OrderKey != nil && md.Get(MetadataOrderKey) == "" {
			key, err := p.config.OrderKey(topic, msg)
			if err != nil {
				return nil, fail("OrderKey: " + err.Error())
			}
			if key != "" {
				// Stored with the message, leaving the caller's message as it was.
				md = maps.Clone(md)
				if md == nil {
					md = message.Metadata{}
				}
				md.Set(MetadataOrderKey, key)
			}
		}
		meta, err := encodeMetadata(md)
		if err != nil {
			return nil, fail(err.Error())
		}
		rows[i] = offsets.Row{UUID: msg.UUID, Payload: msg.Payload, Metadata: meta}
		if until, later, err := delayedUntil(msg.Metadata, time.Now()); err != nil {
			return nil, fail(err.Error())
		} else if later {
			rows[i].DeliverAt = until
		}
	}
	return rows, nil
}

// textOK says what keeps s from being stored as text, or "" if nothing does: invalid UTF-8
// (encoding/json would silently replace it), or a NUL character, which is valid UTF-8 but
// which PostgreSQL cannot store in text or jsonb.
func textOK(s string) string {
	if !utf8.ValidString(s) {
		return "is not valid UTF-8 text"
	}
	if strings.IndexByte(s, 0) >= 0 {
		return "contains a NUL character, which PostgreSQL cannot store in text"
	}
	return ""
}

// encodeMetadata turns metadata into a JSON object. Invalid UTF-8 and NUL characters are
// refused (textOK), naming the key.
func encodeMetadata(md message.Metadata) (string, error) {
	if len(md) == 0 {
		return "{}", nil
	}
	for k, v := range md {
		if err := textOK(k); err != "" {
			return "", fmt.Errorf("metadata key %q %s", k, err)
		}
		if err := textOK(v); err != "" {
			return "", fmt.Errorf("metadata value of key %q %s", k, err)
		}
	}
	b, err := json.Marshal(map[string]string(md))
	if err != nil {
		return "", fmt.Errorf("metadata: %w", err)
	}
	return string(b), nil
}
