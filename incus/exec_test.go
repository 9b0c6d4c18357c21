package incus

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gorilla/websocket"
)

// execFake answers an exec POST with an operation whose websocket secrets
// are "s-control", "s-0", "s-1" and "s-2", and upgrades each websocket
// whose secret is not refuse. It keeps the server side of every websocket.
type execFake struct {
	refuse string
	// hold delays each upgrade, so that dials one after the other would
	// take four times as long as dials at once.
	hold time.Duration

	mu    sync.Mutex
	conns map[string]*websocket.Conn
}

func (e *execFake) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch {
	case r.Method == http.MethodPost && r.URL.Path == "/1.0/instances/i1/exec":
		op := opJSON("op1", "Running", 103, "")
		op["class"] = "websocket"
		op["metadata"] = map[string]any{"fds": map[string]any{"control": "s-control", "0": "s-0", "1": "s-1", "2": "s-2"}}
		writeAsync(w, op)
	case r.URL.Path == "/1.0/operations/op1/websocket":
		secret := r.URL.Query().Get("secret")
		time.Sleep(e.hold)
		if secret == e.refuse {
			writeError(w, http.StatusForbidden, 403, "not authorized")
			return
		}
		u := websocket.Upgrader{}
		ws, err := u.Upgrade(w, r, nil)
		if err != nil {
			return
		}
		e.mu.Lock()
		e.conns[secret] = ws
		e.mu.Unlock()
	default:
		writeError(w, http.StatusNotFound, 404, "not found")
	}
}

// conn is the server's end of one websocket. The client's dial returns as
// soon as the 101 is written, a moment before the handler stores its end,
// so it waits (at most 2 s) for it.
func (e *execFake) conn(secret string) *websocket.Conn {
	for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(time.Millisecond) {
		e.mu.Lock()
		c := e.conns[secret]
		e.mu.Unlock()
		if c != nil || time.Now().After(deadline) {
			return c
		}
	}
}

func TestExecStreamDialsTheWebsocketsAtOnce(t *testing.T) {
	e := &execFake{hold: 100 * time.Millisecond, conns: map[string]*websocket.Conn{}}
	f := newFake(t, e)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	start := time.Now()
	x, err := f.client.ExecStream(ctx, "i1", []string{"nc", "127.0.0.1", "1"})
	if err != nil {
		t.Fatal(err)
	}
	defer x.Close()
	if took := time.Since(start); took > 350*time.Millisecond {
		t.Fatalf("four websockets held 100 ms each took %s: dialled one after the other", took)
	}
	// Each stream is where it belongs: stdin written reaches "0", "1"
	// written reaches Read.
	if _, err := x.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	_ = e.conn("s-0").SetReadDeadline(time.Now().Add(2 * time.Second))
	if _, msg, err := e.conn("s-0").ReadMessage(); err != nil || string(msg) != "ping" {
		t.Fatalf("stdin got %q, %v", msg, err)
	}
	if err := e.conn("s-1").WriteMessage(websocket.BinaryMessage, []byte("pong")); err != nil {
		t.Fatal(err)
	}
	_ = x.SetReadDeadline(time.Now().Add(2 * time.Second))
	buf := make([]byte, 4)
	if _, err := io.ReadFull(x, buf); err != nil || string(buf) != "pong" {
		t.Fatalf("stdout read %q, %v", buf, err)
	}
}

func TestExecStreamClosesWhatItOpenedWhenAWebsocketIsRefused(t *testing.T) {
	e := &execFake{refuse: "s-1", conns: map[string]*websocket.Conn{}}
	f := newFake(t, e)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err := f.client.ExecStream(ctx, "i1", []string{"nc", "127.0.0.1", "1"})
	var ie *Error
	if err == nil || !errors.As(err, &ie) || ie.Status != http.StatusForbidden || !strings.Contains(err.Error(), "websocket 1") || !strings.Contains(err.Error(), `"i1"`) {
		t.Fatalf("err = %v, want the refused websocket 1 of i1 with its status", err)
	}
	// Every websocket that did connect is closed: Incus then abandons the
	// operation instead of waiting for the rest.
	for _, s := range []string{"s-control", "s-0", "s-2"} {
		ws := e.conn(s)
		if ws == nil {
			continue // cancelled before it connected
		}
		_ = ws.SetReadDeadline(time.Now().Add(2 * time.Second))
		if _, _, err := ws.ReadMessage(); err == nil || errors.Is(err, context.DeadlineExceeded) || strings.Contains(err.Error(), "timeout") {
			t.Fatalf("websocket %s still open after the failed exec: %v", s, err)
		}
	}
}

// Deadlines may be set while a write or a Close runs (envd's handshake
// sets one from a context's AfterFunc): under -race, nothing of the
// websocket's own state is touched from two goroutines. CI's race
// detector found SetDeadline racing Close's CloseWrite on a cluster.
func TestExecConnDeadlinesDuringWritesAndClose(t *testing.T) {
	e := &execFake{conns: map[string]*websocket.Conn{}}
	f := newFake(t, e)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	x, err := f.client.ExecStream(ctx, "i1", []string{"true"})
	if err != nil {
		t.Fatal(err)
	}
	stdin := e.conn("s-0")
	go func() { // the command reads its stdin
		for {
			if _, _, err := stdin.ReadMessage(); err != nil {
				return
			}
		}
	}()
	var wg sync.WaitGroup
	for i := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range 200 {
				switch i {
				case 0:
					_ = x.SetDeadline(time.Now().Add(time.Duration(j) * time.Millisecond))
				case 1:
					_, _ = x.Write([]byte("x"))
				default:
					if j == 100 {
						_ = x.Close()
					}
				}
			}
		}()
	}
	wg.Wait()
	_ = x.Close()
}

// TestStreamEndedIsIncusClosingTheStream: a close of any code, and the
// broken pipe or reset that gorilla's answer to a close meets on a socket
// Incus already shut, end the stream; a timeout does not.
func TestStreamEndedIsIncusClosingTheStream(t *testing.T) {
	pipe := &net.OpError{Op: "write", Net: "unix", Err: os.NewSyscallError("write", syscall.EPIPE)}
	reset := &net.OpError{Op: "read", Net: "unix", Err: os.NewSyscallError("read", syscall.ECONNRESET)}
	for _, c := range []struct {
		err  error
		want bool
	}{
		{&websocket.CloseError{Code: websocket.CloseNormalClosure}, true},
		{&websocket.CloseError{Code: websocket.CloseAbnormalClosure}, true},
		{fmt.Errorf("websocket: %w", pipe), true},
		{reset, true},
		{os.ErrDeadlineExceeded, false},
		{errors.New("something else"), false},
	} {
		if got := streamEnded(c.err); got != c.want {
			t.Errorf("streamEnded(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}
