package routes

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/sha1"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"
)

// websocketGUID is the RFC 6455 constant of Sec-WebSocket-Accept.
const websocketGUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

func acceptKey(key string) string {
	h := sha1.New()
	h.Write([]byte(key))
	h.Write([]byte(websocketGUID))
	return base64.StdEncoding.EncodeToString(h.Sum(nil))
}

// headerHasToken reports whether a comma-separated header holds token,
// case-insensitively.
func headerHasToken(h http.Header, name, token string) bool {
	for _, v := range h.Values(name) {
		for part := range strings.SplitSeq(v, ",") {
			if strings.EqualFold(strings.TrimSpace(part), token) {
				return true
			}
		}
	}
	return false
}

// upgradeProblem checks that r is a WebSocket handshake this relay can
// answer, before anything else is done for it. It answers the status and a
// sentence for a request that is not.
func upgradeProblem(r *http.Request) (int, string) {
	if r.Method != http.MethodGet {
		return http.StatusMethodNotAllowed, "A data route is a WebSocket endpoint: open it with a GET handshake."
	}
	if !headerHasToken(r.Header, "Connection", "upgrade") || !headerHasToken(r.Header, "Upgrade", "websocket") {
		return http.StatusBadRequest, "A data route is a WebSocket endpoint: the request is not a WebSocket handshake."
	}
	if r.Header.Get("Sec-WebSocket-Version") != "13" {
		return http.StatusUpgradeRequired, "A data route speaks WebSocket version 13 only."
	}
	key := r.Header.Get("Sec-WebSocket-Key")
	if raw, err := base64.StdEncoding.DecodeString(key); err != nil || len(raw) != 16 {
		return http.StatusBadRequest, "The WebSocket handshake's Sec-WebSocket-Key is not 16 bytes of base64."
	}
	if origin := r.Header.Get("Origin"); origin != "" && origin != "http://"+r.Host && origin != "https://"+r.Host {
		// The runtime is not a browser and sends no Origin; a page elsewhere
		// must not ride on an operator's network position.
		return http.StatusForbidden, "A data route does not accept cross-origin WebSocket handshakes."
	}
	return 0, ""
}

// acceptClient hijacks the runtime's connection and answers its handshake
// with 101, negotiating no extension and no subprotocol. It returns the
// connection and any bytes the runtime sent after its handshake that the
// HTTP server had already read.
func acceptClient(w http.ResponseWriter, r *http.Request, deadline time.Time) (net.Conn, []byte, error) {
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		return nil, nil, fmt.Errorf("hijack: %w", err)
	}
	var early []byte
	if n := brw.Reader.Buffered(); n > 0 {
		early = make([]byte, n)
		_, _ = io.ReadFull(brw.Reader, early)
	}
	resp := "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: " +
		acceptKey(r.Header.Get("Sec-WebSocket-Key")) + "\r\n\r\n"
	_ = conn.SetWriteDeadline(deadline)
	if _, err := io.WriteString(conn, resp); err != nil {
		conn.Close()
		return nil, nil, fmt.Errorf("answer the handshake: %w", err)
	}
	_ = conn.SetDeadline(time.Time{})
	return conn, early, nil
}

// errGuestHandshake marks a guest that took the connection but did not
// complete a WebSocket handshake.
var errGuestHandshake = errors.New("the guest daemon did not complete the WebSocket handshake")

// dialGuestWebSocket performs the client side of the WebSocket handshake on
// conn (URL ws://guest/, as internal/envd does), requesting no extension and
// no subprotocol, and checks the answer strictly. It returns whatever the
// daemon sent after its 101 that was read along with the response, so that
// no byte is lost. It is bounded by ctx; on failure the caller closes conn.
func dialGuestWebSocket(ctx context.Context, conn net.Conn) ([]byte, error) {
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	var raw [16]byte
	_, _ = rand.Read(raw[:])
	key := base64.StdEncoding.EncodeToString(raw[:])
	req := "GET / HTTP/1.1\r\nHost: guest\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: " + key +
		"\r\nSec-WebSocket-Version: 13\r\nUser-Agent: incus-provider-relay\r\n\r\n"
	if _, err := io.WriteString(conn, req); err != nil {
		return nil, fmt.Errorf("%w: write: %w", errGuestHandshake, err)
	}
	br := bufio.NewReaderSize(conn, 1024)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodGet})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errGuestHandshake, err)
	}
	resp.Body.Close()
	switch {
	case resp.StatusCode != http.StatusSwitchingProtocols:
		return nil, fmt.Errorf("%w: it answered HTTP %s", errGuestHandshake, resp.Status)
	case !headerHasToken(resp.Header, "Upgrade", "websocket") || !headerHasToken(resp.Header, "Connection", "upgrade"):
		return nil, fmt.Errorf("%w: its 101 lacks Upgrade: websocket", errGuestHandshake)
	case resp.Header.Get("Sec-WebSocket-Accept") != acceptKey(key):
		return nil, fmt.Errorf("%w: wrong Sec-WebSocket-Accept", errGuestHandshake)
	case resp.Header.Get("Sec-WebSocket-Extensions") != "":
		return nil, fmt.Errorf("%w: it negotiated extensions %q that were not asked for", errGuestHandshake, resp.Header.Get("Sec-WebSocket-Extensions"))
	case resp.Header.Get("Sec-WebSocket-Protocol") != "":
		return nil, fmt.Errorf("%w: it chose a subprotocol that was not asked for", errGuestHandshake)
	}
	var early []byte
	if n := br.Buffered(); n > 0 {
		early = make([]byte, n)
		_, _ = io.ReadFull(br, early)
	}
	if !stop() {
		return nil, fmt.Errorf("%w: %w", errGuestHandshake, ctx.Err())
	}
	_ = conn.SetDeadline(time.Time{})
	return early, nil
}
