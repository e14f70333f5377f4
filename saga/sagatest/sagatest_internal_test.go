package sagatest

import (
	"strings"
	"testing"
)

// An empty schema is the default one, as in every Config; a name that is not an identifier is
// refused where it is given, not by a SQL syntax error at the first Deliver.
func TestNewBusSchema(t *testing.T) {
	if b := NewBus(nil, ""); b.schema != "onceflow" {
		t.Errorf(`NewBus(pool, "") uses schema %q, want "onceflow"`, b.schema)
	}
	defer func() {
		if r := recover(); r == nil || !strings.Contains(r.(string), "invalid schema name") {
			t.Errorf("NewBus with a bad schema: panic %v, want one naming the bad schema", r)
		}
	}()
	NewBus(nil, `x"; DROP TABLE y`)
}
