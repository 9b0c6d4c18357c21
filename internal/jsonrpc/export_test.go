package jsonrpc

import (
	"encoding/json"
	"time"

	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// DecodedFrame is decodeFrame's reading of a frame, for FuzzDecodeFrame.
type DecodedFrame struct {
	Notification bool
	ID           json.RawMessage // nil: answered with a null id
	Method       string
	Params       *wire.Member
	Refusal      *Error
}

func DecodeFrame(data []byte) DecodedFrame {
	f := decodeFrame(data)
	return DecodedFrame{Notification: f.notification, ID: f.id, Method: f.method, Params: f.params, Refusal: f.refusal}
}

// SetPingInterval shortens the pings of waiting calls for a test.
func SetPingInterval(d time.Duration) (restore func()) {
	old := pingEvery
	pingEvery = d
	return func() { pingEvery = old }
}

// Reading says whether the client's read loop runs.
func Reading(c *Client) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.reading
}

// SetAfterRead makes every client's read loop call f after each message it
// reads, before delivering it.
func SetAfterRead(f func()) (restore func()) {
	old := afterRead.Swap(&f)
	return func() { afterRead.Store(old) }
}

// Closing says whether Close has closed the client's connection.
func Closing(c *Client) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closing
}
