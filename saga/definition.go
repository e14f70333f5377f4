package saga

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/config"
	"github.com/onceflow/onceflow/internal/engine"
	"github.com/onceflow/onceflow/outbox"
)

// Default step and saga policies.
const (
	// DefaultAttempts is how often a step's command is sent before the saga compensates: the
	// first attempt and two retries.
	DefaultAttempts = 3
	// DefaultBackoff is the wait before the first re-send; each further re-send waits twice as
	// long, up to MaxBackoff.
	DefaultBackoff = time.Second
	// MaxBackoff caps the wait between two attempts of one step.
	MaxBackoff = 5 * time.Minute
	// DefaultCompensationAttempts is how often a compensation is sent before the saga is
	// marked stuck for an operator (`onceflow saga retry`).
	DefaultCompensationAttempts = 10
	// maxNameBytes bounds saga and step names, which are part of every dedup key.
	maxNameBytes = 200
)

// ConfigError is returned by Define, NewOrchestrator and NewParticipant for an invalid
// definition or config. It lists every problem at once: Scope names what was configured and
// Problems holds one error per problem; Error() puts them on one line. It is the same type in
// every onceflow package.
type ConfigError = config.Error

// Reply is a participant's answer to a step's command, as an OnReply handler sees it.
type Reply struct {
	// Payload is the participant's result, JSON-encoded (what its handler returned).
	Payload []byte
	// Attempt is the attempt that produced the reply.
	Attempt int
}

// Decode unmarshals the reply's JSON payload into v.
func (r Reply) Decode(v any) error {
	if len(r.Payload) == 0 {
		return errors.New("saga: the reply has no payload")
	}
	return json.Unmarshal(r.Payload, v)
}

// StepDef describes one step of a saga over data of type D: the command it sends, what to do
// with the reply, the compensation and the step's policy. Build it with Step and its chained
// methods; Define checks it.
type StepDef[D any] struct {
	name       string
	topic      string
	command    func(D) (any, error)
	onReply    func(*D, Reply) error
	onReplyTx  ReplyTxFunc[D]
	compTopic  string
	compensate func(D) (any, error)
	attempts   int
	backoff    time.Duration
	timeout    time.Duration
	pivot      bool
	// local and compLocal: a local step's action and compensation (see Local).
	local     LocalFunc[D]
	compLocal LocalFunc[D]
}

// LocalFunc is a local step's action or compensation: it runs in the orchestrator's
// transaction, tx, and may change the saga data.
type LocalFunc[D any] func(ctx context.Context, tx pgx.Tx, data *D) error

// Step starts the definition of a step. name identifies it in the saga (and in dedup keys and
// operator output), so keep it stable across deployments.
func Step[D any](name string) *StepDef[D] {
	return &StepDef[D]{name: name, attempts: DefaultAttempts, backoff: DefaultBackoff}
}

// Send sets the command: topic is where the participant consumes it, and build returns the
// command's payload from the saga data (JSON-encoded; a []byte is sent as is). Required.
func (s *StepDef[D]) Send(topic string, build func(D) (any, error)) *StepDef[D] {
	s.topic, s.command = topic, build
	return s
}

// OnReply sets the handler of the participant's successful reply. It may update the saga
// data (for the steps after it, and for compensations); the new data is stored with the
// transition. An error from it is treated like a business failure of the step after its
// effect (the step is compensated). Optional: without it the reply's payload is ignored.
func (s *StepDef[D]) OnReply(h func(data *D, r Reply) error) *StepDef[D] {
	s.onReply = h
	return s
}

// ReplyTxFunc is a reply handler that runs in the transaction of the orchestrator's
// transition (see OnReplyTx).
type ReplyTxFunc[D any] func(ctx context.Context, tx pgx.Tx, data *D, r Reply) error

// OnReplyTx is OnReply with the transition's transaction: h runs in the transaction that
// claims the reply and stores the saga's new state, so its writes in the orchestrator's own
// database (the reservation id on the order row, an audit row) commit with the transition,
// exactly once, or not at all. It runs in a savepoint: when it returns an error, its writes are
// rolled back and the step is compensated with the steps before it, as with OnReply. A
// transient database error (a deadlock, a lost connection) fails the whole transition instead,
// which is tried again when the reply is redelivered. saga.LocalRunFrom(ctx) describes the
// saga. A step has OnReply or OnReplyTx, not both, and a local step has neither.
func (s *StepDef[D]) OnReplyTx(h ReplyTxFunc[D]) *StepDef[D] {
	s.onReplyTx = h
	return s
}

// Compensate sets the command that undoes the step: topic and payload as in Send. A step
// without one is not compensated (its effect stays, e.g. a notification). Not allowed on a
// pivot step or after it.
func (s *StepDef[D]) Compensate(topic string, build func(D) (any, error)) *StepDef[D] {
	s.compTopic, s.compensate = topic, build
	return s
}

// Attempts sets how many times the command is sent before the saga compensates (n >= 1,
// default DefaultAttempts) and the backoff before the first re-send (doubling each time, up to
// MaxBackoff; default DefaultBackoff). A participant asks for a re-send with saga.Retry; a
// timeout (Timeout) counts as a failed attempt too. Each re-send carries the next attempt
// number, so the participant runs it rather than skipping it as a duplicate.
func (s *StepDef[D]) Attempts(n int, backoff time.Duration) *StepDef[D] {
	s.attempts, s.backoff = n, backoff
	return s
}

// Timeout sets how long the orchestrator waits for the reply to one attempt before counting
// it as failed (then it re-sends or compensates, per Attempts). Default 0: no timeout (the
// outbox and inbox deliver every command and reply eventually; a timeout bounds how long a
// slow or stopped participant may hold the saga).
func (s *StepDef[D]) Timeout(d time.Duration) *StepDef[D] {
	s.timeout = d
	return s
}

// Pivot marks the step as the saga's point of no return: it has no compensation, and it and
// every step after it are retried (with backoff) until they succeed — a business failure or
// timeout there re-sends instead of compensating. Steps before it are compensated as usual.
func (s *StepDef[D]) Pivot() *StepDef[D] {
	s.pivot = true
	return s
}

// Local makes the step local: instead of sending a command to a participant, the
// orchestrator runs fn in the transaction of the transition that reaches the step, so its
// writes commit together with the saga's state change, or not at all — exactly once by
// construction, with no command, no reply, no barrier and no dedup row. Use it for work in the
// orchestrator's own database (marking the order confirmed); anything in another service stays
// a remote step (Send). Consecutive local steps run in the same transition, and a remote step
// after them sends its command in that same transaction.
//
// fn may change the saga data; the change is stored with the transition. fn runs in a
// savepoint: when it returns an error, its writes are rolled back. saga.Fail is a business
// failure: the steps before it are compensated (or, on and after the pivot, it is run again
// after the backoff). Any other error (saga.Retry included) is retried after the step's
// backoff, as the next of its Attempts, then the saga compensates like for a remote step; so
// are an HTTP client's error, a deadline and a decoder's io.EOF. Only a failure of the
// transaction's own connection or server (a deadlock, a lost connection, a restart) fails the
// whole transition, which is tried again without counting an attempt.
//
// A local step has no Send, OnReply, Timeout or Compensate (use CompensateLocal). A local
// first step runs in StartTx's transaction with the RunLocalSteps start option, else within
// about TimerInterval after the start commits (Orchestrator.Run).
func (s *StepDef[D]) Local(fn LocalFunc[D]) *StepDef[D] {
	s.local = fn
	return s
}

// CompensateLocal sets a compensation that runs in the orchestrator's transaction (see
// Local): it undoes the step when a later step fails. It may compensate a local or a remote
// step. Failures are retried with the saga's compensation attempts and backoff
// (WithCompensationAttempts), then the saga is stuck, as with Compensate. Not allowed with
// Compensate, nor on or after the pivot.
func (s *StepDef[D]) CompensateLocal(fn LocalFunc[D]) *StepDef[D] {
	s.compLocal = fn
	return s
}

// Option configures a Definition.
type Option func(*options)

type options struct {
	replyTopic           string
	deadline             time.Duration
	compensationAttempts int
	compensationBackoff  time.Duration
	// onCompleted and onCompensated hold a func(context.Context, pgx.Tx, *D) error (see
	// OnCompleted), checked against D by Define.
	onCompleted, onCompensated any
	// upgrades are the earlier versions this one takes over running sagas of (Upgrade).
	upgrades []upgradeDecl
}

// OnCompleted sets a hook that runs in the transaction of the transition that completes a
// saga of data D: a service marks its order confirmed atomically with the saga's end, without
// a step of its own. It may change the saga data (stored with the transition). An error from
// it fails the transition, which is tried again like any failing transition (the reply is
// redelivered, the timer fires again), so keep it to writes that cannot fail for business
// reasons.
func OnCompleted[D any](h func(ctx context.Context, tx pgx.Tx, data *D) error) Option {
	return func(o *options) { o.onCompleted = h }
}

// OnCompensated is OnCompleted for the transition that ends the saga compensated (a service
// marks its order cancelled); the saga's error says why it compensated.
func OnCompensated[D any](h func(ctx context.Context, tx pgx.Tx, data *D) error) Option {
	return func(o *options) { o.onCompensated = h }
}

// WithReplyTopic sets the topic participants send their replies to, which the orchestrator
// consumes. Default "<name>.replies".
func WithReplyTopic(topic string) Option { return func(o *options) { o.replyTopic = topic } }

// WithDeadline bounds the whole saga: when it has not completed this long after its start,
// it compensates (unless it passed its pivot, after which it can only go forward). Default 0:
// no deadline.
func WithDeadline(d time.Duration) Option { return func(o *options) { o.deadline = d } }

// WithCompensationAttempts sets how often a compensation is sent (default
// DefaultCompensationAttempts) and the first backoff (default DefaultBackoff, doubling up to
// MaxBackoff) before the saga is marked stuck.
func WithCompensationAttempts(n int, backoff time.Duration) Option {
	return func(o *options) { o.compensationAttempts, o.compensationBackoff = n, backoff }
}

// Definition is a validated, versioned saga: a name, a version, typed data D and its steps.
// Build it with Define; it is immutable and safe for concurrent use.
type Definition[D any] struct {
	name    string
	version int
	steps   []*StepDef[D]
	opts    options
	pivot   int // index of the pivot step, or len(steps) when none
	// hooks run when the saga ends: onEnd[0] completed, onEnd[1] compensated (nil: none).
	onEnd [2]func(ctx context.Context, tx pgx.Tx, data *D) error
}

// Define builds a saga definition and checks it, reporting every problem at once: an empty or
// overlong name, a version below 1, no steps, duplicate or empty step names, a step without a
// command, a compensation on or after the pivot, more than one pivot, bad attempts or
// timeouts.
//
// The name and version identify the definition: every saga runs to its end on the definition
// it started with. To change a saga, Define it again with the next version, register both
// versions with the orchestrator, start new sagas on the new one, and remove the old one once
// `onceflow saga versions` shows none of its sagas running, compensating or stuck
// (Admin.CheckVersions checks a build; see docs/sagas.md). A new version that declares
// Upgrade from an old one can also take over the old one's running sagas, each at a step
// boundary (Admin.UpgradeMatching, `onceflow saga upgrade`).
func Define[D any](name string, version int, steps []*StepDef[D], opts ...Option) (*Definition[D], error) {
	d := &Definition[D]{name: name, version: version, steps: steps, pivot: len(steps)}
	d.opts = options{compensationAttempts: DefaultCompensationAttempts, compensationBackoff: DefaultBackoff}
	for _, o := range opts {
		o(&d.opts)
	}
	if d.opts.replyTopic == "" {
		d.opts.replyTopic = name + ".replies"
	}
	var problems []error
	if err := checkName("saga name", name); err != nil {
		problems = append(problems, err)
	}
	if version < 1 {
		problems = append(problems, fmt.Errorf("version is %d; number versions from 1", version))
	}
	if len(steps) == 0 {
		problems = append(problems, errors.New("no steps; a saga needs at least one"))
	}
	if d.opts.deadline < 0 {
		problems = append(problems, fmt.Errorf("deadline is %s; use 0 for none or a positive duration", d.opts.deadline))
	}
	if d.opts.compensationAttempts < 1 || d.opts.compensationBackoff < 0 {
		problems = append(problems, fmt.Errorf("compensation attempts %d, backoff %s; use at least 1 attempt and a backoff >= 0", d.opts.compensationAttempts, d.opts.compensationBackoff))
	}
	for i, h := range []any{d.opts.onCompleted, d.opts.onCompensated} {
		if h == nil {
			continue
		}
		f, ok := h.(func(context.Context, pgx.Tx, *D) error)
		if !ok {
			problems = append(problems, fmt.Errorf("%s hook is a %T; want a func(context.Context, pgx.Tx, *%T) error",
				[]string{"OnCompleted", "OnCompensated"}[i], h, *new(D)))
			continue
		}
		d.onEnd[i] = f
	}
	seen := map[string]bool{}
	for i, s := range steps {
		if s == nil {
			problems = append(problems, fmt.Errorf("step %d is nil", i))
			continue
		}
		where := fmt.Sprintf("step %d (%q)", i, s.name)
		if err := checkName(where+": name", s.name); err != nil {
			problems = append(problems, err)
		} else if seen[s.name] {
			problems = append(problems, fmt.Errorf("%s: duplicate step name; step names must be unique in a saga", where))
		}
		seen[s.name] = true
		switch {
		case s.local != nil && (s.topic != "" || s.command != nil):
			problems = append(problems, fmt.Errorf("%s: both Local and Send; a step is either local or sends a command", where))
		case s.local != nil && (s.onReply != nil || s.onReplyTx != nil):
			problems = append(problems, fmt.Errorf("%s: OnReply on a local step, which gets no reply; change the data in its Local function", where))
		case s.local != nil && s.timeout != 0:
			problems = append(problems, fmt.Errorf("%s: Timeout on a local step, which runs in the transition; remove it", where))
		case s.local == nil && (s.topic == "" || s.command == nil):
			problems = append(problems, fmt.Errorf("%s: no command; call Send(topic, build), or Local(fn) for a local step", where))
		}
		if s.onReply != nil && s.onReplyTx != nil {
			problems = append(problems, fmt.Errorf("%s: both OnReply and OnReplyTx; a step has one reply handler", where))
		}
		if (s.compTopic == "") != (s.compensate == nil) {
			problems = append(problems, fmt.Errorf("%s: Compensate needs both a topic and a build function", where))
		}
		if s.compensate != nil && s.compLocal != nil {
			problems = append(problems, fmt.Errorf("%s: both Compensate and CompensateLocal; a step has one compensation", where))
		}
		if s.attempts < 1 {
			problems = append(problems, fmt.Errorf("%s: attempts is %d; use at least 1", where, s.attempts))
		}
		if s.backoff < 0 || s.timeout < 0 {
			problems = append(problems, fmt.Errorf("%s: backoff %s and timeout %s must not be negative", where, s.backoff, s.timeout))
		}
		if s.pivot {
			if d.pivot != len(steps) {
				problems = append(problems, fmt.Errorf("%s: a second pivot; a saga has at most one (step %d is the pivot)", where, d.pivot))
			} else {
				d.pivot = i
			}
		}
		if i >= d.pivot && (s.compensate != nil || s.compLocal != nil) {
			what := "a pivot step has no compensation"
			if !s.pivot {
				what = "steps after the pivot are retried until they succeed and never compensated"
			}
			problems = append(problems, fmt.Errorf("%s: Compensate is not allowed: %s", where, what))
		}
	}
	problems = append(problems, d.upgradeProblems()...) // upgrade.go
	if err := config.Check("saga "+fmt.Sprintf("%q", name)+" definition", problems...); err != nil {
		return nil, err
	}
	return d, nil
}

// MustDefine is Define for package-level definitions: it panics on an invalid definition.
func MustDefine[D any](name string, version int, steps []*StepDef[D], opts ...Option) *Definition[D] {
	d, err := Define(name, version, steps, opts...)
	if err != nil {
		panic(err)
	}
	return d
}

// Name returns the saga's name.
func (d *Definition[D]) Name() string { return d.name }

// Version returns the definition's version.
func (d *Definition[D]) Version() int { return d.version }

// ReplyTopic returns the topic the orchestrator consumes replies from.
func (d *Definition[D]) ReplyTopic() string { return d.opts.replyTopic }

// Steps returns the step names in order.
func (d *Definition[D]) Steps() []string {
	names := make([]string, len(d.steps))
	for i, s := range d.steps {
		names[i] = s.name
	}
	return names
}

func checkName(what, name string) error {
	switch {
	case name == "":
		return fmt.Errorf("%s is empty", what)
	case len(name) > maxNameBytes:
		return fmt.Errorf("%s is %d bytes; use at most %d", what, len(name), maxNameBytes)
	case !utf8.ValidString(name) || strings.IndexByte(name, 0) >= 0:
		return fmt.Errorf("%s %q is not valid UTF-8 text without NUL bytes", what, name)
	}
	return nil
}

// encodePayload JSON-encodes a command built by a Send or Compensate function; a []byte or
// json.RawMessage is taken as is.
func encodePayload(v any) ([]byte, error) {
	switch b := v.(type) {
	case []byte:
		return b, nil
	case json.RawMessage:
		return b, nil
	}
	return json.Marshal(v)
}

// definition is the type-erased view of a Definition that the orchestrator and the state
// machine use: the saga data travels as JSON between them.
type definition interface {
	Name() string
	Version() int
	stepCount() int
	step(i int) stepPolicy
	stepIndex(name string) int
	pivotIndex() int
	replyTopic() string
	deadline() time.Duration
	compensationAttempts() int
	compensationBackoff() time.Duration
	encodeData(data any) (json.RawMessage, error)
	command(i int, phase outbox.SagaPhase, data json.RawMessage) (topic string, payload []byte, err error)
	onReply(i int, data json.RawMessage, r Reply) (json.RawMessage, error)
	// onReplyTx runs step i's OnReplyTx handler in tx.
	onReplyTx(ctx context.Context, tx pgx.Tx, i int, data json.RawMessage, r Reply) (json.RawMessage, error)
	// runLocal runs the local action or compensation of step i on data in tx; runEnd the
	// hook of the end state s, if any. Both return the data after it (unchanged when none).
	runLocal(ctx context.Context, tx pgx.Tx, i int, phase outbox.SagaPhase, data json.RawMessage) (json.RawMessage, error)
	runEnd(ctx context.Context, tx pgx.Tx, s State, data json.RawMessage) (json.RawMessage, bool, error)
}

// stepPolicy is a step's policy without its typed functions.
type stepPolicy struct {
	name     string
	attempts int
	backoff  time.Duration
	timeout  time.Duration
	comp     bool
	// local and compLocal: the action and the compensation run in the orchestrator's
	// transaction instead of being sent.
	local, compLocal bool
	// replyTx: the reply handler needs the transition's transaction (OnReplyTx).
	replyTx bool
}

func (p stepPolicy) hasCompensation() bool { return p.comp }

// isLocal reports whether the step's phase runs locally.
func (p stepPolicy) isLocal(phase outbox.SagaPhase) bool {
	if phase == outbox.SagaPhaseCompensation {
		return p.compLocal
	}
	return p.local
}

func (d *Definition[D]) stepCount() int                     { return len(d.steps) }
func (d *Definition[D]) pivotIndex() int                    { return d.pivot }
func (d *Definition[D]) replyTopic() string                 { return d.opts.replyTopic }
func (d *Definition[D]) deadline() time.Duration            { return d.opts.deadline }
func (d *Definition[D]) compensationAttempts() int          { return d.opts.compensationAttempts }
func (d *Definition[D]) compensationBackoff() time.Duration { return d.opts.compensationBackoff }

func (d *Definition[D]) step(i int) stepPolicy {
	s := d.steps[i]
	return stepPolicy{name: s.name, attempts: s.attempts, backoff: s.backoff, timeout: s.timeout,
		comp: s.compensate != nil || s.compLocal != nil, local: s.local != nil, compLocal: s.compLocal != nil,
		replyTx: s.onReplyTx != nil}
}

func (d *Definition[D]) stepIndex(name string) int {
	for i, s := range d.steps {
		if s.name == name {
			return i
		}
	}
	return -1
}

func (d *Definition[D]) encodeData(data any) (json.RawMessage, error) {
	v, ok := data.(D)
	if !ok {
		return nil, fmt.Errorf("saga %q: data is %T, want %T", d.name, data, *new(D))
	}
	return json.Marshal(v)
}

func (d *Definition[D]) decode(raw json.RawMessage) (D, error) {
	var v D
	if err := json.Unmarshal(raw, &v); err != nil {
		return v, fmt.Errorf("saga %q: decode the saga data: %w", d.name, err)
	}
	return v, nil
}

func (d *Definition[D]) command(i int, phase outbox.SagaPhase, raw json.RawMessage) (string, []byte, error) {
	data, err := d.decode(raw)
	if err != nil {
		return "", nil, err
	}
	s := d.steps[i]
	topic, build := s.topic, s.command
	if phase == outbox.SagaPhaseCompensation {
		topic, build = s.compTopic, s.compensate
	}
	if build == nil {
		return "", nil, fmt.Errorf("step %q has no %s command", s.name, phase)
	}
	v, err := build(data)
	if err != nil {
		return "", nil, err
	}
	payload, err := encodePayload(v)
	return topic, payload, err
}

func (d *Definition[D]) onReply(i int, raw json.RawMessage, r Reply) (json.RawMessage, error) {
	h := d.steps[i].onReply
	if h == nil {
		return raw, nil
	}
	data, err := d.decode(raw)
	if err != nil {
		return nil, err
	}
	if err := h(&data, r); err != nil {
		return nil, err
	}
	return json.Marshal(data)
}

func (d *Definition[D]) onReplyTx(ctx context.Context, tx pgx.Tx, i int, raw json.RawMessage, r Reply) (json.RawMessage, error) {
	h := d.steps[i].onReplyTx
	if h == nil {
		return nil, fmt.Errorf("saga %q: step %q has no OnReplyTx handler", d.name, d.steps[i].name)
	}
	return d.runFunc(ctx, tx, func(ctx context.Context, tx pgx.Tx, data *D) error { return h(ctx, tx, data, r) }, raw)
}

func (d *Definition[D]) runLocal(ctx context.Context, tx pgx.Tx, i int, phase outbox.SagaPhase, raw json.RawMessage) (json.RawMessage, error) {
	fn := d.steps[i].local
	if phase == outbox.SagaPhaseCompensation {
		fn = d.steps[i].compLocal
	}
	if fn == nil {
		return nil, fmt.Errorf("saga %q: step %q has no local %s", d.name, d.steps[i].name, phase)
	}
	return d.runFunc(ctx, tx, fn, raw)
}

func (d *Definition[D]) runEnd(ctx context.Context, tx pgx.Tx, s State, raw json.RawMessage) (json.RawMessage, bool, error) {
	h := d.onEnd[0]
	if s == StateCompensated {
		h = d.onEnd[1]
	}
	if h == nil {
		return raw, false, nil
	}
	out, err := d.runFunc(ctx, tx, h, raw)
	return out, true, err
}

// runFunc runs fn on the decoded data, and returns the data after it; a panic is the step's
// error, wrapping inbox.ErrPanicked (the engine's one panic policy).
func (d *Definition[D]) runFunc(ctx context.Context, tx pgx.Tx, fn func(context.Context, pgx.Tx, *D) error, raw json.RawMessage) (json.RawMessage, error) {
	data, err := d.decode(raw)
	if err != nil {
		return nil, err
	}
	return engine.Call(func() (json.RawMessage, error) {
		if err := fn(ctx, tx, &data); err != nil {
			return nil, err
		}
		return json.Marshal(data)
	})
}
