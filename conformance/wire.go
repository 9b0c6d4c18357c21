package conformance

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// inFlight is the number of requests in flight per connection every
// server accepts (§Pipelining and cancellation).
const inFlight = 16

// checkPipelining: 16 requests sent before any answer is read are each
// answered, by id, none of them busy; beyond 16, an answer is a result or
// busy with reason requestLimit.
func checkPipelining(ctx context.Context, r *checkRun) {
	c, _ := r.mustOpen(ctx)
	defer c.close()
	list := controller.TemplateListParams{UniverseID: r.s.cfg.UniverseID}
	batch := func(n int) []any {
		out := make([]any, n)
		for i := range out {
			out[i] = list
		}
		return out
	}
	answers, err := c.pipeline(ctx, controller.MethodTemplateList, batch(inFlight))
	if err != nil {
		r.fatalf("%d template/list in flight: %v", inFlight, err)
	}
	for i, f := range answers {
		if f.rpcErr != nil {
			r.failf("template/list %d of %d in flight answered %s; a server accepts at least %d requests in flight", i+1, inFlight, describeErr(f.rpcErr), inFlight)
		}
	}
	const more = 4 * inFlight
	answers, err = c.pipeline(ctx, controller.MethodTemplateList, batch(more))
	if err != nil {
		r.fatalf("%d template/list in flight: %v", more, err)
	}
	busy := 0
	for i, f := range answers {
		switch {
		case f.rpcErr == nil:
		case f.rpcErr.Kind == jsonrpc.KindBusy && f.rpcErr.Reason == "requestLimit":
			busy++
		default:
			r.failf("template/list %d of %d in flight answered %s; want its result, or busy (requestLimit) past the server's limit", i+1, more, describeErr(f.rpcErr))
		}
	}
	r.notef("%d in flight answered; of %d in flight, %d answered busy (requestLimit)", inFlight, more, busy)
}

// checkPing: a ping is answered by a pong with its payload, also while
// requests are in flight.
func checkPing(ctx context.Context, r *checkRun) {
	c, _ := r.mustOpen(ctx)
	defer c.close()
	payload := "lsconform-" + r.s.runID
	pongs := make(chan string, 16)
	c.ws.SetPongHandler(func(data string) error {
		select {
		case pongs <- data:
		default:
		}
		return nil
	})
	list := controller.TemplateListParams{UniverseID: r.s.cfg.UniverseID}
	ids := make([]string, inFlight)
	for i := range ids {
		id := c.newID()
		ids[i] = strconv.FormatInt(id, 10)
		if err := c.request(ctx, id, controller.MethodTemplateList, list); err != nil {
			r.fatalf("send template/list: %v", err)
		}
	}
	if err := c.ws.WriteControl(websocket.PingMessage, []byte(payload), time.Now().Add(r.s.cfg.Timeout)); err != nil {
		r.fatalf("send a ping: %v", err)
	}
	seen := func() (bool, string) {
		for {
			select {
			case got := <-pongs:
				if got == payload {
					return true, ""
				}
				if got != "" {
					return false, got
				}
			default:
				return false, ""
			}
		}
	}
	for range ids {
		if _, err := c.next(ctx, controller.MethodTemplateList); err != nil {
			r.fatalf("the answers to %d template/list sent before a ping: %v", inFlight, err)
		}
	}
	// The pong is read along with answers: ask more, for a while.
	deadline := time.Now().Add(r.s.cfg.Timeout)
	for asked := 0; ; asked++ {
		ok, other := seen()
		if ok {
			r.notef("the pong came back with the ping's payload, %d requests in flight when it was sent", inFlight)
			return
		}
		if other != "" {
			r.fatalf("a pong came back with payload %q; a pong carries its ping's payload (%q)", clip(other, 64), payload)
		}
		if time.Now().After(deadline) || asked >= 100 {
			r.fatalf("no pong to a ping sent %s ago, %d requests answered since", r.s.cfg.Timeout, inFlight+asked)
		}
		if f := r.rt(ctx, c, "template/list after a ping", controller.MethodTemplateList, list); f.rpcErr != nil {
			r.failf("template/list after a ping: %s", describeErr(f.rpcErr))
		}
		if err := sleep(ctx, 10*time.Millisecond); err != nil {
			r.fatalf("waiting for a pong: %v", err)
		}
	}
}

// checkMessageLimit: a request of exactly 16 MiB is read and answered; one
// byte more is never answered with a result (its reader refuses it: an
// error answer, or the connection closed).
func checkMessageLimit(ctx context.Context, r *checkRun) {
	c, _ := r.mustOpen(ctx)
	defer c.close()
	frameOf := func(id int64, size int) string {
		head := fmt.Sprintf(`{"jsonrpc":"2.0","id":%d,"method":%q,"params":{"universeId":%q}`, id, controller.MethodTemplateList, r.s.cfg.UniverseID)
		return head + strings.Repeat(" ", size-len(head)-1) + "}"
	}
	id := c.newID()
	f, err := (*frame)(nil), c.sendText(ctx, frameOf(id, jsonrpc.MaxMessageBytes))
	if err == nil {
		f, err = c.expectID(ctx, "a request of exactly 16 MiB", strconv.FormatInt(id, 10))
	}
	if err != nil {
		r.fatalf("a request of exactly %d bytes (16 MiB, the message limit) was not answered: %v", jsonrpc.MaxMessageBytes, err)
	}
	if f.rpcErr != nil {
		r.fatalf("a request of exactly %d bytes (16 MiB, the message limit) answered %s; want its result", jsonrpc.MaxMessageBytes, describeErr(f.rpcErr))
	}
	id = c.newID()
	if err := c.sendText(ctx, frameOf(id, jsonrpc.MaxMessageBytes+1)); err != nil {
		r.notef("16 MiB answered; the connection closed while 16 MiB + 1 byte was sent")
		return
	}
	f, err = c.next(ctx, "a request of 16 MiB + 1 byte")
	switch {
	case err != nil:
		var ce *websocket.CloseError
		if errors.As(err, &ce) {
			r.notef("16 MiB answered; 16 MiB + 1 byte closed the connection with code %d", ce.Code)
		} else {
			r.notef("16 MiB answered; 16 MiB + 1 byte ended the connection (%v)", err)
		}
	case f.rpcErr == nil:
		r.failf("a request of 16 MiB + 1 byte was read and answered with a result; every reader configures the 16 MiB limit")
	default:
		r.notef("16 MiB answered; 16 MiB + 1 byte answered %s", f.rpcErr.Kind)
	}
}

// checkOneFrame: an answer larger than the usual 64 KiB write buffers
// comes as one unfragmented text frame.
func checkOneFrame(ctx context.Context, r *checkRun) {
	rec := &frameRecorder{}
	ws, status, err := r.s.dialVia(ctx, r.s.authHeader(), rec.wrap)
	if err != nil {
		r.fatalf("cannot connect: %v", describeDialError(err, status))
	}
	c := &conn{s: r.s, ws: ws, check: r.name}
	defer c.close()
	if err := c.call(ctx, controller.MethodInitialize, initializeParams(controller.ProtocolVersion), nil); err != nil {
		r.fatalf("initialize: %v", err)
	}
	id := "lsconform-" + strings.Repeat("f", 192<<10)
	if err := c.request(ctx, id, controller.MethodTemplateList, controller.TemplateListParams{UniverseID: r.s.cfg.UniverseID}); err != nil {
		r.fatalf("send template/list with an id of %d bytes: %v", len(id), err)
	}
	before := rec.count()
	f, err := c.next(ctx, controller.MethodTemplateList)
	if err != nil {
		r.fatalf("template/list with an id of %d bytes: %v", len(id), err)
	}
	want, _ := json.Marshal(id)
	if f.id != string(want) {
		r.skipf("template/list with an id of %d bytes was answered with id %s (%s): no answer over 64 KiB to look at", len(id), clip(f.id, 40), f)
	}
	heads, bad := rec.since(before)
	if bad != "" {
		r.fatalf("the server's frames do not parse: %s", bad)
	}
	var size uint64
	for _, h := range heads {
		size += h.length
	}
	if len(heads) != 1 || heads[0].op != opText || !heads[0].fin {
		r.failf("an answer of %d bytes came as %d frames (%s); each text frame holds exactly one message", size, len(heads), describeHeads(heads))
		return
	}
	r.notef("an answer of %d bytes came as one text frame", size)
}

// WebSocket opcodes (RFC 6455 §5.2).
const (
	opContinuation = 0x0
	opText         = 0x1
)

// frameHead is one frame the server sent, as its header says.
type frameHead struct {
	fin    bool
	op     byte
	length uint64
}

func describeHeads(hs []frameHead) string {
	var parts []string
	for _, h := range hs {
		name := fmt.Sprintf("opcode %d", h.op)
		switch h.op {
		case opText:
			name = "text"
		case opContinuation:
			name = "continuation"
		}
		if !h.fin {
			name += " without FIN"
		}
		parts = append(parts, fmt.Sprintf("%s of %d bytes", name, h.length))
	}
	return strings.Join(parts, ", ")
}

// frameRecorder reads the server's side of a connection as it passes: the
// HTTP answer to the upgrade, then each frame's header. Payloads are
// counted, not kept. Control frames are left out.
type frameRecorder struct {
	mu     sync.Mutex
	http   bool // the upgrade's answer has been read
	tail   []byte
	head   []byte // a frame header being read
	skip   uint64 // payload bytes of the current frame still to come
	frames []frameHead
	bad    string
}

func (f *frameRecorder) wrap(c net.Conn) net.Conn { return &recordedConn{Conn: c, rec: f} }

type recordedConn struct {
	net.Conn
	rec *frameRecorder
}

func (c *recordedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.rec.feed(p[:n])
	}
	return n, err
}

func (f *frameRecorder) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.frames)
}

// since is the data frames recorded after the first n, and what did not
// parse.
func (f *frameRecorder) since(n int) ([]frameHead, string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]frameHead(nil), f.frames[n:]...), f.bad
}

func (f *frameRecorder) feed(b []byte) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for len(b) > 0 && f.bad == "" {
		if !f.http {
			f.tail = append(f.tail, b...)
			i := strings.Index(string(f.tail), "\r\n\r\n")
			if i < 0 {
				if len(f.tail) > 64<<10 {
					f.bad = "no end of the HTTP answer in its first 64 KiB"
				}
				return
			}
			b = f.tail[i+4:]
			f.http, f.tail = true, nil
			continue
		}
		if f.skip > 0 {
			n := min(uint64(len(b)), f.skip)
			f.skip -= n
			b = b[n:]
			continue
		}
		f.head = append(f.head, b[0])
		b = b[1:]
		need := 2
		if len(f.head) >= 2 {
			switch f.head[1] & 0x7f {
			case 126:
				need += 2
			case 127:
				need += 8
			}
			if f.head[1]&0x80 != 0 {
				f.bad = "a server frame is masked"
				return
			}
		}
		if len(f.head) < need {
			continue
		}
		h := frameHead{fin: f.head[0]&0x80 != 0, op: f.head[0] & 0x0f}
		switch l := uint64(f.head[1] & 0x7f); l {
		case 126:
			h.length = uint64(f.head[2])<<8 | uint64(f.head[3])
		case 127:
			for _, c := range f.head[2:10] {
				h.length = h.length<<8 | uint64(c)
			}
		default:
			h.length = l
		}
		f.head, f.skip = f.head[:0], h.length
		if h.op < 0x8 { // data frames only
			f.frames = append(f.frames, h)
		}
	}
}

// checkResponseLimit: an answer that would be over 16 MiB is answered
// payloadTooLarge for the same id instead. The answer is made one byte
// too long by the request's own id (a template/list result echoes it):
// the id is sized from the same answer to a short id, so the request
// itself stays within the limit, and so does the error answer, unless
// the result is shorter than an error object.
func checkResponseLimit(ctx context.Context, r *checkRun) {
	c, _ := r.mustOpen(ctx)
	defer c.close()
	list := controller.TemplateListParams{UniverseID: r.s.cfg.UniverseID}
	f := r.rt(ctx, c, "template/list", controller.MethodTemplateList, list)
	if f.rpcErr != nil {
		r.fatalf("template/list: %s", describeErr(f.rpcErr))
	}
	// The answer's length less its id's, which was an integer of c.nextID's
	// digits: what any other id is added to.
	rest := len(f.raw) - len(f.id)
	// An error object with a short message: the least a payloadTooLarge
	// answer takes besides its id.
	const errorLeast = len(`{"jsonrpc":"2.0","id":,"error":{"code":-32013,"message":"Too large.","data":{"kind":"payloadTooLarge","limitBytes":16777216}}}`)
	if rest <= errorLeast {
		r.skipf("the template/list answer (%d bytes besides its id) is not longer than an error answer: no id makes the one too long and the other fit", rest)
	}
	idLen := jsonrpc.MaxMessageBytes + 1 - rest - 2 // the quotes of a string id
	id := "lsconform-" + strings.Repeat("r", idLen-len("lsconform-"))
	if err := c.request(ctx, id, controller.MethodTemplateList, list); err != nil {
		r.fatalf("send template/list whose answer would be %d bytes: %v", jsonrpc.MaxMessageBytes+1, err)
	}
	got, err := c.next(ctx, "template/list whose answer would be one byte over 16 MiB")
	switch {
	case errors.Is(err, websocket.ErrReadLimit):
		r.failf("a template/list whose answer would be %d bytes was answered with a message over the 16 MiB limit; a server answers payloadTooLarge for the same id instead", jsonrpc.MaxMessageBytes+1)
	case err != nil:
		r.failf("a template/list whose answer would be %d bytes was not answered: %v; a server answers payloadTooLarge for the same id", jsonrpc.MaxMessageBytes+1, err)
	case got.rpcErr == nil:
		r.failf("a template/list whose answer would be %d bytes was answered with a result of %d bytes", jsonrpc.MaxMessageBytes+1, len(got.raw))
	case got.rpcErr.Kind != jsonrpc.KindPayloadTooLarge:
		r.failf("a template/list whose answer would be %d bytes answered %s; want payloadTooLarge", jsonrpc.MaxMessageBytes+1, describeErr(got.rpcErr))
	default:
		want, _ := json.Marshal(id)
		if got.id != string(want) {
			r.failf("payloadTooLarge came with id %s…, not the request's", clip(got.id, 40))
			return
		}
		r.notef("an answer that would be %d bytes came as payloadTooLarge for the same id", jsonrpc.MaxMessageBytes+1)
	}
}
