// Package wsframe reads WebSocket frame headers (RFC 6455, section 5.2) and
// applies the framing rules a relay that forwards frames without decoding
// them must enforce (routes/doc.go, step 6).
//
// It is a leaf, importing nothing of this module, so that its fuzz target's
// test binary stays small: go test -fuzz walks every coverage counter of the
// binary on each execution, and the routes binary has some 70,000 of them.
package wsframe

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
)

// WebSocket opcodes (RFC 6455, section 5.2).
const (
	OpContinuation = 0x0
	OpText         = 0x1
	OpBinary       = 0x2
	OpClose        = 0x8
	OpPing         = 0x9
	OpPong         = 0xA
)

// Close codes a relay sends itself (RFC 6455, section 7.4.1).
const (
	CloseNormal        = 1000
	CloseGoingAway     = 1001
	CloseProtocolError = 1002
	CloseTooBig        = 1009
)

// MaxHeaderBytes is the longest frame header: 2 bytes, an 8-byte extended
// length and a 4-byte masking key.
const MaxHeaderBytes = 14

// Header is a parsed frame header.
type Header struct {
	Fin    bool
	RSV    byte // the three reserved bits, as bits 6..4 of the first byte
	Op     byte
	Masked bool
	Length uint64 // payload length
	Size   int    // header length in bytes, masking key included
}

// ParseHeader parses the frame header at the start of b. When b holds too
// few bytes it returns need > 0, the number of bytes the header needs in
// all, so that a reader can fill exactly that much before it asks again. A
// 64-bit length with its top bit set is a protocol error.
func ParseHeader(b []byte) (h Header, need int, v *Violation) {
	if len(b) < 2 {
		return h, 2, nil
	}
	h.Fin = b[0]&0x80 != 0
	h.RSV = b[0] & 0x70
	h.Op = b[0] & 0x0f
	h.Masked = b[1]&0x80 != 0
	n := int(b[1] & 0x7f)
	size := 2
	switch n {
	case 126:
		size += 2
	case 127:
		size += 8
	}
	if h.Masked {
		size += 4
	}
	if len(b) < size {
		return h, size, nil
	}
	switch n {
	case 126:
		h.Length = uint64(binary.BigEndian.Uint16(b[2:4]))
	case 127:
		h.Length = binary.BigEndian.Uint64(b[2:10])
		if h.Length>>63 != 0 {
			return h, 0, errProtocol("a frame length has its most significant bit set")
		}
	default:
		h.Length = uint64(n)
	}
	h.Size = size
	return h, 0, nil
}

// Violation is a breach of the framing rules or the message limit by one
// side; a relay closes both sides with its Code, and its Reason fits in a
// close frame.
type Violation struct {
	Code   int
	Reason string
}

func (v *Violation) Error() string { return fmt.Sprintf("websocket %d: %s", v.Code, v.Reason) }

func errProtocol(reason string) *Violation {
	return &Violation{Code: CloseProtocolError, Reason: reason}
}

// MessageState follows the data messages of one direction: the limit is on
// a message, not a frame, so the size of a fragmented message has to be
// carried from one header to the next.
type MessageState struct {
	inMessage bool   // a fragmented message is under way
	size      uint64 // bytes of the message so far
}

// Check applies the framing rules to a header read from one side: no
// reserved bits (no extension is negotiated), known opcodes, masking by
// direction (client frames masked, server frames not), unfragmented control
// frames of at most 125 bytes, continuation only inside a message, and at
// most limit bytes in one message, counted across its fragments. It reports
// whether the frame ends a data message.
func (m *MessageState) Check(h Header, fromClient bool, limit uint64) (endsMessage bool, v *Violation) {
	if h.RSV != 0 {
		return false, errProtocol("reserved bits set, but no extension was negotiated")
	}
	if h.Masked != fromClient {
		if fromClient {
			return false, errProtocol("a client frame is not masked")
		}
		return false, errProtocol("a server frame is masked")
	}
	switch h.Op {
	case OpClose, OpPing, OpPong:
		if !h.Fin || h.Length > 125 {
			return false, errProtocol("a control frame is fragmented or longer than 125 bytes")
		}
		return false, nil
	case OpText, OpBinary:
		if m.inMessage {
			return false, errProtocol("a new message began before the last one ended")
		}
		m.size = 0
	case OpContinuation:
		if !m.inMessage {
			return false, errProtocol("a continuation frame outside a message")
		}
	default:
		return false, errProtocol(fmt.Sprintf("unknown opcode %#x", h.Op))
	}
	m.size += h.Length
	if m.size > limit {
		return false, &Violation{Code: CloseTooBig, Reason: fmt.Sprintf("a message over the %d-byte limit", limit)}
	}
	m.inMessage = !h.Fin
	return h.Fin, nil
}

// CloseFrame builds a close frame with code and reason, masked when it goes
// to a server. A reason too long for a control frame is cut.
func CloseFrame(code int, reason string, masked bool) []byte {
	if len(reason) > 123 {
		reason = reason[:123]
	}
	payload := make([]byte, 2+len(reason))
	binary.BigEndian.PutUint16(payload, uint16(code))
	copy(payload[2:], reason)
	frame := []byte{0x80 | OpClose, byte(len(payload))}
	if masked {
		var key [4]byte
		if _, err := rand.Read(key[:]); err != nil {
			panic(errors.New("wsframe: no randomness for a masking key"))
		}
		frame[1] |= 0x80
		frame = append(frame, key[:]...)
		for i := range payload {
			payload[i] ^= key[i%4]
		}
	}
	return append(frame, payload...)
}
