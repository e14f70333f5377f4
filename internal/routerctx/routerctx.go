// Package routerctx gives a message's context the values a Watermill router sets for the
// handlers it runs (message.HandlerNameFromCtx, SubscribeTopicFromCtx, PublishTopicFromCtx),
// for consumers that run Watermill handlers without the router: the batched consumer and the
// replay of given-up messages.
package routerctx

import (
	"context"
	"reflect"
)

// Values are the router's context values; an empty one is left to the parent context.
type Values struct {
	Handler, SubscribeTopic, PublishTopic string
}

// With returns a context in which message.HandlerNameFromCtx, SubscribeTopicFromCtx and
// PublishTopicFromCtx report v's non-empty fields.
//
// Watermill sets these values only inside its router, under keys of an unexported type; a
// consumer that is not the router cannot set them with context.WithValue. The returned context
// answers the lookups of those keys (recognised by their type's package and name and their
// value, which TestRoundTrip in internal/kafkarecord pins for the Watermill version in go.mod)
// and delegates every other lookup to ctx.
func With(ctx context.Context, v Values) context.Context {
	return routerCtx{Context: ctx, v: map[string]string{"handler_name": v.Handler, "subscribe_topic": v.SubscribeTopic, "publish_topic": v.PublishTopic}}
}

type routerCtx struct {
	context.Context
	v map[string]string
}

// watermillKey is the type of the router's context keys.
var watermillKey = struct{ pkg, name string }{"github.com/ThreeDotsLabs/watermill/message", "ctxKey"}

func (c routerCtx) Value(key any) any {
	if t := reflect.TypeOf(key); t != nil && t.Kind() == reflect.String && t.Name() == watermillKey.name && t.PkgPath() == watermillKey.pkg {
		if v := c.v[reflect.ValueOf(key).String()]; v != "" {
			return v
		}
	}
	return c.Context.Value(key)
}
