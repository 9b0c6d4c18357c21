package jsonrpc_test

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// A large frame holds its bytes of the shared budget until its method
// returns; a large frame on another connection that finds no room within
// the wait is answered busy/capacityExhausted with its own id and never
// reaches its method; small frames pass throughout; once the budget is
// returned, large frames are served again.
func TestDecodeBudgetIsSharedAcrossConnections(t *testing.T) {
	budget := jsonrpc.NewBudget(1<<20, 200*time.Millisecond)
	s := newTestServer(t, func(s *testServer) { s.srv.Budget = budget })
	big := func(label string) map[string]any {
		return map[string]any{"key": label + strings.Repeat("x", 700<<10)}
	}
	holder, other := s.dial(t), s.dial(t)
	holder.initialize()
	other.initialize()

	holder.request("held", "test/slow", big("a"))
	started := s.waitStarted(t, 1)
	var heldKey string
	for k := range started {
		heldKey = k
	}
	if got := budget.InUse(); got < 700<<10 {
		t.Fatalf("a running method's frame holds %d bytes of the budget; want its size", got)
	}

	begun := time.Now()
	r := other.call("refused", "test/slow", big("b"))
	expectError(t, r, jsonrpc.KindBusy, `"refused"`)
	if r.err.Reason != "capacityExhausted" || r.err.RetryAfterMs == nil || *r.err.RetryAfterMs == 0 {
		t.Fatalf("refusal: %s", r.raw)
	}
	if waited := time.Since(begun); waited < 150*time.Millisecond || waited > 5*time.Second {
		t.Fatalf("refused after %s; want after the 200 ms wait", waited)
	}
	if budget.Refused() != 1 {
		t.Fatalf("refused count %d, want 1", budget.Refused())
	}
	select {
	case k := <-s.started:
		t.Fatalf("a refused frame reached its method (key %.10s…)", k)
	default:
	}
	// Small frames take no budget.
	if r := other.call("small", "test/echo", map[string]any{"s": "x"}); r.err != nil {
		t.Fatalf("a small frame while the budget is full: %s", r.raw)
	}

	s.release(heldKey)
	if r := holder.read(); r.id != `"held"` || r.err != nil {
		t.Fatalf("held call: %s", r.raw)
	}
	if got := budget.InUse(); got != 0 {
		t.Fatalf("after the method returned, %d bytes are still held", got)
	}
	// Frames refused before their method, or answered inline, give the
	// budget back too.
	for i := range 3 {
		expectError(t, other.call(i, "no/such", big("c")), jsonrpc.KindMethodNotFound, strconv.Itoa(i))
	}
	expectError(t, other.call("bad", "test/slow", map[string]any{"key": 1, "pad": strings.Repeat("y", 700<<10)}), jsonrpc.KindInvalidParams, `"bad"`)
	if got := budget.InUse(); got != 0 {
		t.Fatalf("after refusals, %d bytes are still held", got)
	}
	other.request("again", "test/slow", big("d"))
	for k := range s.waitStarted(t, 1) {
		s.release(k)
	}
	if r := other.read(); r.id != `"again"` || r.err != nil {
		t.Fatalf("after the budget was returned: %s", r.raw)
	}
}

// An envelope or an initialize of a million members is answered from the
// names it may carry, whatever else it holds.
func TestManyMembersAreRefusedByName(t *testing.T) {
	s := newTestServer(t)
	p := s.dial(t)
	var b strings.Builder
	for i := range 200_000 {
		b.WriteString(`,"a` + strconv.Itoa(i) + `":0`)
	}
	members := b.String()
	p.send(`{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":4` + members + `}}`)
	if r := p.read(); r.err == nil || r.err.Kind != jsonrpc.KindInvalidParams || r.err.Field != "a0" {
		t.Fatalf("initialize with many members: %.300s", r.raw)
	}
	p.initialize()
	p.send(`{"jsonrpc":"2.0","id":2,"method":"test/echo"` + members + `}`)
	r := p.read()
	expectError(t, r, jsonrpc.KindInvalidRequest, "2")
	if !strings.Contains(r.message, `"a0"`) {
		t.Fatalf("want the first unknown member named: %s", r.raw)
	}
}
