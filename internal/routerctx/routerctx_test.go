package routerctx_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/internal/routerctx"
)

type key struct{}

// With answers Watermill's own lookups (pinned for the Watermill version in go.mod), leaves
// an empty value to the parent, and delegates every other lookup.
func TestWith(t *testing.T) {
	parent := context.WithValue(context.Background(), key{}, "kept")
	ctx := routerctx.With(parent, routerctx.Values{Handler: "billing", SubscribeTopic: "orders.placed", PublishTopic: "billing.invoiced"})
	if got := message.HandlerNameFromCtx(ctx); got != "billing" {
		t.Errorf("HandlerNameFromCtx = %q", got)
	}
	if got := message.SubscribeTopicFromCtx(ctx); got != "orders.placed" {
		t.Errorf("SubscribeTopicFromCtx = %q", got)
	}
	if got := message.PublishTopicFromCtx(ctx); got != "billing.invoiced" {
		t.Errorf("PublishTopicFromCtx = %q", got)
	}
	if ctx.Value(key{}) != "kept" {
		t.Error("a value of the parent context was lost")
	}
	inner := routerctx.With(ctx, routerctx.Values{SubscribeTopic: "other"})
	if message.HandlerNameFromCtx(inner) != "billing" || message.SubscribeTopicFromCtx(inner) != "other" {
		t.Errorf("an empty value must fall through to the parent: handler %q, topic %q",
			message.HandlerNameFromCtx(inner), message.SubscribeTopicFromCtx(inner))
	}
}
