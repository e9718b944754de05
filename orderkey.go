package sqlbroker

import (
	"encoding/json"

	"github.com/ThreeDotsLabs/watermill/message"
)

// OrderKeyInEnvelope is a PublisherConfig.OrderKey for the publisher under Watermill's
// forwarder (components/forwarder): the forwarder's publisher wraps each message in an
// envelope, a new message whose payload holds the original's UUID, payload and metadata, and
// whose own metadata is empty. It returns the MetadataOrderKey of the message inside the
// envelope, so that the outbox topic keeps each key's order (with SubscriberConfig.OrderByKey
// on the forwarder's subscriber) and the message the forwarder publishes carries its key. A
// payload that is no envelope has no key.
func OrderKeyInEnvelope(_ string, msg *message.Message) (string, error) {
	var env struct {
		Metadata map[string]string `json:"metadata"`
	}
	if json.Unmarshal(msg.Payload, &env) != nil {
		return "", nil
	}
	return env.Metadata[MetadataOrderKey], nil
}
