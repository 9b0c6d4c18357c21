package incus

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/gorilla/websocket"
	"golang.org/x/sync/errgroup"
)

// ExecPost is the body of POST /1.0/instances/{name}/exec.
type ExecPost struct {
	Command     []string          `json:"command"`
	Environment map[string]string `json:"environment,omitempty"`
	// WaitForWS makes Incus start the command only once the client has
	// connected the stream websockets, so no output is lost.
	WaitForWS    bool `json:"wait-for-websocket"`
	Interactive  bool `json:"interactive"`
	RecordOutput bool `json:"record-output"`
}

// ErrExecEnded is matched (errors.Is) by the error an ExecConn's Read returns
// when the command ended before it wrote anything, with what it said on
// stderr: for a bridge such as nc, the daemon refused the connection.
var ErrExecEnded = errors.New("the command in the instance ended")

// execBuffer is the buffer size of stdin's writes and stdout's reads: large
// enough that a 1 MiB frame of the data plane crosses in few calls.
const execBuffer = 256 << 10

// execBufferSizes are each websocket's read and write buffer sizes, in
// execFDs order; 0 is gorilla's default, 4 KiB. gorilla allocates a
// connection's buffers whole when it is made and keeps them for its life,
// so every open exec, an idle relay's too, holds all eight: with execBuffer
// for each that was 2.1 MiB of heap per idle exec relay, 0.6 MiB now
// (routebench -cluster). Only stdin is written and only stdout read in
// bulk; control and stderr carry a close or a few words.
var execBufferSizes = [len(execFDs)]struct{ read, write int }{
	{0, 0},          // control
	{0, execBuffer}, // stdin
	{execBuffer, 0}, // stdout
	{0, 0},          // stderr
}

// stderrKeep bounds what an ExecConn keeps of the command's stderr for its
// errors; the rest is read and dropped so the command never blocks on it.
const stderrKeep = 512

// ExecStream runs argv in the instance non-interactively and returns its
// stdin and stdout as one stream: what the caller writes reaches the
// command's stdin, what the command prints arrives on Read. It is how the
// provider reaches a guest's loopback on a cluster member it does not run
// on, through nothing but the Incus API: argv is a byte bridge such as
// `nc 127.0.0.1 PORT`. ctx bounds the request and the websocket dials, not
// the stream's life; Close ends the command (Incus kills it when the
// control websocket closes).
func (c *Client) ExecStream(ctx context.Context, instance string, argv []string) (*ExecConn, error) {
	op, secrets, err := c.startExec(ctx, instance, argv)
	if err != nil {
		return nil, err
	}
	ws, err := c.dialExecStreams(ctx, op, secrets)
	if err != nil {
		return nil, fmt.Errorf("incus: exec in %q: %w", instance, err)
	}
	return newExecConn(instance, ws), nil
}

// execFDs are the exec operation's websockets, in the order execStreams
// holds them.
var execFDs = [4]string{"control", "0", "1", "2"}

// execStreams are an exec's websockets: control, stdin, stdout, stderr.
type execStreams [4]*websocket.Conn

func (s execStreams) close() {
	for _, ws := range s {
		if ws != nil {
			_ = ws.Close()
		}
	}
}

// startExec asks Incus to run argv once its websockets are connected and
// returns the operation and the websockets' secrets.
func (c *Client) startExec(ctx context.Context, instance string, argv []string) (*Operation, map[string]string, error) {
	if len(argv) == 0 {
		return nil, nil, fmt.Errorf("incus: exec in %q: empty command", instance)
	}
	body := ExecPost{Command: argv, WaitForWS: true}
	resp, err := c.do(ctx, request{op: "instance.exec", method: http.MethodPost, scoped: true, path: instancePath(instance) + "/exec", body: body})
	if err != nil {
		return nil, nil, fmt.Errorf("incus: exec in %q: %w", instance, err)
	}
	op, err := operationOf("instance.exec", resp)
	if err != nil {
		return nil, nil, fmt.Errorf("incus: exec in %q: %w", instance, err)
	}
	secrets, err := execSecrets(op)
	if err != nil {
		return nil, nil, fmt.Errorf("incus: exec in %q: %w", instance, err)
	}
	return op, secrets, nil
}

// dialExecStreams connects the exec's four websockets, all at once: each
// is a TCP and TLS connect and a handshake, which a member that does not
// hold the instance forwards to the one that does (about 9 ms each, one
// after the other, on the cluster rig: TestMeasureExec). Incus starts the
// command only once stdin, stdout and stderr are all there (it waits up to
// 10 s); control is what lets Close end it. A failed dial closes what was
// opened, and Incus then abandons the operation.
func (c *Client) dialExecStreams(ctx context.Context, op *Operation, secrets map[string]string) (execStreams, error) {
	var ws execStreams
	g, gctx := errgroup.WithContext(ctx)
	for i, fd := range execFDs {
		g.Go(func() error {
			conn, err := c.dialOperationWebsocket(gctx, op, secrets[fd], execBufferSizes[i].read, execBufferSizes[i].write)
			if err != nil {
				return fmt.Errorf("websocket %s: %w", fd, err)
			}
			ws[i] = conn // each goroutine its own element; read after Wait
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		ws.close()
		return execStreams{}, err
	}
	return ws, nil
}

// newExecConn joins connected streams into a conn and starts reading the
// command's stderr.
func newExecConn(instance string, ws execStreams) *ExecConn {
	x := &ExecConn{instance: instance, control: ws[0], stdin: ws[1], stdout: ws[2], stderr: ws[3], stderrDone: make(chan struct{})}
	go x.drainStderr()
	return x
}

// execSecrets reads the websocket secrets of an exec operation.
func execSecrets(op *Operation) (map[string]string, error) {
	fds, ok := op.Metadata["fds"].(map[string]any)
	if !ok {
		return nil, fmt.Errorf("%w: exec operation %s carries no websocket secrets", ErrMalformedResponse, op.ID)
	}
	out := make(map[string]string, len(execFDs))
	for _, fd := range execFDs {
		s, ok := fds[fd].(string)
		if !ok || s == "" {
			return nil, fmt.Errorf("%w: exec operation %s has no secret for websocket %q", ErrMalformedResponse, op.ID, fd)
		}
		out[fd] = s
	}
	return out, nil
}

// dialOperationWebsocket connects one websocket of an operation through
// the endpoint that started it (WebsocketURL, DialOperation): the
// connection is made, TLS included, by this client, so gorilla only speaks
// the handshake over it. readBuf and writeBuf size its buffers (0: 4 KiB).
func (c *Client) dialOperationWebsocket(ctx context.Context, op *Operation, secret string, readBuf, writeBuf int) (*websocket.Conn, error) {
	u, err := c.WebsocketURL(op, secret)
	if err != nil {
		return nil, err
	}
	dial := func(ctx context.Context, _, _ string) (net.Conn, error) { return c.DialOperation(ctx, op) }
	d := websocket.Dialer{
		NetDialContext:    dial,
		NetDialTLSContext: dial,
		HandshakeTimeout:  c.callTimeout,
		ReadBufferSize:    readBuf,
		WriteBufferSize:   writeBuf,
	}
	ws, resp, err := d.DialContext(ctx, u, http.Header{"User-Agent": {"incus-provider"}})
	if resp != nil && resp.Body != nil {
		_ = resp.Body.Close()
	}
	if err != nil {
		if resp != nil {
			return nil, &Error{Op: "operation.websocket", Status: resp.StatusCode, Err: err}
		}
		return nil, &Error{Op: "operation.websocket", Err: err}
	}
	return ws, nil
}

// ExecConn is a command's stdin and stdout as a net.Conn. Incus frames the
// bytes as binary websocket messages and marks the end of a stream with an
// empty text message (or a close).
type ExecConn struct {
	instance string
	control  *websocket.Conn
	stdin    *websocket.Conn
	stdout   *websocket.Conn
	stderr   *websocket.Conn

	rmu    sync.Mutex
	reader io.Reader // the stdout message being read
	got    bool      // any stdout byte arrived
	rerr   error     // sticky once stdout ended

	wmu    sync.Mutex
	closed bool // stdin's end was sent

	// writeBy is the write deadline asked for. gorilla's own deadline field
	// is not safe for concurrent use, so it is set from writeBy only under
	// wmu, before each write; SetWriteDeadline sets the socket's (which is)
	// to reach a write already under way.
	dmu     sync.Mutex
	writeBy time.Time

	emu        sync.Mutex
	errText    strings.Builder
	stderrDone chan struct{}

	closeOnce sync.Once
}

var _ net.Conn = (*ExecConn)(nil)

func (x *ExecConn) Read(p []byte) (int, error) {
	x.rmu.Lock()
	defer x.rmu.Unlock()
	for {
		if x.rerr != nil {
			return 0, x.rerr
		}
		if x.reader == nil {
			mt, r, err := x.stdout.NextReader()
			if err != nil {
				if streamEnded(err) {
					err = io.EOF
				}
				x.rerr = x.ended(err)
				continue
			}
			if mt != websocket.BinaryMessage {
				x.rerr = x.ended(io.EOF)
				continue
			}
			x.reader = r
		}
		n, err := x.reader.Read(p)
		if n > 0 {
			x.got = true
		}
		if err == io.EOF {
			x.reader = nil
			err = nil
		}
		if n > 0 || err != nil {
			return n, err
		}
	}
}

// streamEnded says a stdout read error is Incus ending the stream: its
// close (any code), or the failed write of gorilla's answer to that close
// on a socket Incus has already shut (a broken pipe or a reset, which the
// read then returns in the close's place; seen on a loaded machine).
func streamEnded(err error) bool {
	var ce *websocket.CloseError
	return errors.As(err, &ce) || errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET)
}

// ended turns the end of stdout into the Read error: a command that ended
// without a byte of output failed to bridge, and its stderr says why.
func (x *ExecConn) ended(err error) error {
	if x.got || !errors.Is(err, io.EOF) {
		return err
	}
	// stderr ends with the command, a moment after stdout; wait briefly
	// for its last words.
	select {
	case <-x.stderrDone:
	case <-time.After(100 * time.Millisecond):
	}
	x.emu.Lock()
	text := strings.TrimSpace(x.errText.String())
	x.emu.Unlock()
	if text == "" {
		return io.EOF
	}
	return fmt.Errorf("%w in %q without output: %s", ErrExecEnded, x.instance, text)
}

func (x *ExecConn) Write(p []byte) (int, error) {
	x.wmu.Lock()
	defer x.wmu.Unlock()
	if x.closed {
		return 0, net.ErrClosed
	}
	if len(p) == 0 {
		return 0, nil
	}
	_ = x.stdin.SetWriteDeadline(x.writeDeadline())
	if err := x.stdin.WriteMessage(websocket.BinaryMessage, p); err != nil {
		return 0, err
	}
	return len(p), nil
}

// CloseWrite ends the command's stdin, as a TCP half-close would.
func (x *ExecConn) CloseWrite() error {
	x.wmu.Lock()
	defer x.wmu.Unlock()
	if x.closed {
		return nil
	}
	x.closed = true
	_ = x.stdin.SetWriteDeadline(time.Now().Add(time.Second))
	return x.stdin.WriteMessage(websocket.TextMessage, nil)
}

// Close ends the stream and the command: a close on the control websocket
// makes Incus kill it, so no bridge outlives its connection.
func (x *ExecConn) Close() error {
	x.closeOnce.Do(func() {
		_ = x.CloseWrite()
		if x.control != nil {
			deadline := time.Now().Add(time.Second)
			_ = x.control.WriteControl(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""), deadline)
		}
		x.closeAll()
	})
	return nil
}

func (x *ExecConn) closeAll() {
	for _, ws := range []*websocket.Conn{x.control, x.stdin, x.stdout, x.stderr} {
		if ws != nil {
			_ = ws.Close()
		}
	}
}

// drainStderr reads stderr to its end (Close ends it), keeping its start.
func (x *ExecConn) drainStderr() {
	defer close(x.stderrDone)
	buf := make([]byte, 4096)
	for {
		mt, r, err := x.stderr.NextReader()
		if err != nil || mt != websocket.BinaryMessage {
			return
		}
		for {
			n, err := r.Read(buf)
			if n > 0 {
				x.emu.Lock()
				if room := stderrKeep - x.errText.Len(); room > 0 {
					x.errText.Write(buf[:min(n, room)])
				}
				x.emu.Unlock()
			}
			if err != nil {
				break
			}
		}
	}
}

func (x *ExecConn) LocalAddr() net.Addr  { return x.stdout.LocalAddr() }
func (x *ExecConn) RemoteAddr() net.Addr { return x.stdout.RemoteAddr() }

func (x *ExecConn) SetDeadline(t time.Time) error {
	return errors.Join(x.SetReadDeadline(t), x.SetWriteDeadline(t))
}
func (x *ExecConn) SetReadDeadline(t time.Time) error { return x.stdout.SetReadDeadline(t) }

// SetWriteDeadline applies to the next write, and through the socket to
// one under way. It may be called while a write or a Close runs.
func (x *ExecConn) SetWriteDeadline(t time.Time) error {
	x.dmu.Lock()
	x.writeBy = t
	x.dmu.Unlock()
	return x.stdin.NetConn().SetWriteDeadline(t)
}

func (x *ExecConn) writeDeadline() time.Time {
	x.dmu.Lock()
	defer x.dmu.Unlock()
	return x.writeBy
}
