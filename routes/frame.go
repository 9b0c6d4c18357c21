package routes

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
)

// WebSocket opcodes (RFC 6455, section 5.2).
const (
	opContinuation = 0x0
	opText         = 0x1
	opBinary       = 0x2
	opClose        = 0x8
	opPing         = 0x9
	opPong         = 0xA
)

// Close codes the relay sends itself (RFC 6455, section 7.4.1).
const (
	CloseNormal        = 1000
	CloseGoingAway     = 1001
	CloseProtocolError = 1002
	CloseTooBig        = 1009
)

// maxHeaderBytes is the longest frame header: 2 bytes, an 8-byte extended
// length and a 4-byte masking key.
const maxHeaderBytes = 14

// header is a parsed frame header.
type header struct {
	fin    bool
	rsv    byte // the three reserved bits, as bits 6..4 of the first byte
	op     byte
	masked bool
	length uint64 // payload length
	size   int    // header length in bytes, masking key included
}

// parseHeader parses the frame header at the start of b. When b holds too
// few bytes it returns need > 0, the number of bytes the header needs in
// all. A 64-bit length with its top bit set is a protocol error.
func parseHeader(b []byte) (h header, need int, v *violation) {
	if len(b) < 2 {
		return h, 2, nil
	}
	h.fin = b[0]&0x80 != 0
	h.rsv = b[0] & 0x70
	h.op = b[0] & 0x0f
	h.masked = b[1]&0x80 != 0
	n := int(b[1] & 0x7f)
	size := 2
	switch n {
	case 126:
		size += 2
	case 127:
		size += 8
	}
	if h.masked {
		size += 4
	}
	if len(b) < size {
		return h, size, nil
	}
	switch n {
	case 126:
		h.length = uint64(binary.BigEndian.Uint16(b[2:4]))
	case 127:
		h.length = binary.BigEndian.Uint64(b[2:10])
		if h.length>>63 != 0 {
			return h, 0, errProtocol("a frame length has its most significant bit set")
		}
	default:
		h.length = uint64(n)
	}
	h.size = size
	return h, 0, nil
}

// violation is a breach of the framing rules or the message limit by one
// side; the relay closes both sides with its code.
type violation struct {
	code   int
	reason string
}

func (v *violation) Error() string { return fmt.Sprintf("websocket %d: %s", v.code, v.reason) }

func errProtocol(reason string) *violation {
	return &violation{code: CloseProtocolError, reason: reason}
}

// messageState follows the data messages of one direction.
type messageState struct {
	inMessage bool   // a fragmented message is under way
	size      uint64 // bytes of the message so far
}

// check applies the framing rules to a header read from one side: no
// reserved bits (no extension is negotiated), known opcodes, masking by
// direction (client frames masked, server frames not), unfragmented control
// frames of at most 125 bytes, continuation only inside a message, and at
// most limit bytes in one message, counted across its fragments. It reports
// whether the frame ends a data message.
func (m *messageState) check(h header, fromClient bool, limit uint64) (endsMessage bool, v *violation) {
	if h.rsv != 0 {
		return false, errProtocol("reserved bits set, but no extension was negotiated")
	}
	if h.masked != fromClient {
		if fromClient {
			return false, errProtocol("a client frame is not masked")
		}
		return false, errProtocol("a server frame is masked")
	}
	switch h.op {
	case opClose, opPing, opPong:
		if !h.fin || h.length > 125 {
			return false, errProtocol("a control frame is fragmented or longer than 125 bytes")
		}
		return false, nil
	case opText, opBinary:
		if m.inMessage {
			return false, errProtocol("a new message began before the last one ended")
		}
		m.size = 0
	case opContinuation:
		if !m.inMessage {
			return false, errProtocol("a continuation frame outside a message")
		}
	default:
		return false, errProtocol(fmt.Sprintf("unknown opcode %#x", h.op))
	}
	m.size += h.length
	if m.size > limit {
		return false, &violation{code: CloseTooBig, reason: fmt.Sprintf("a message over the %d-byte limit", limit)}
	}
	m.inMessage = !h.fin
	return h.fin, nil
}

// closeFrame builds a close frame with code and reason, masked when it goes
// to a server (the guest daemon).
func closeFrame(code int, reason string, masked bool) []byte {
	if len(reason) > 123 {
		reason = reason[:123]
	}
	payload := make([]byte, 2+len(reason))
	binary.BigEndian.PutUint16(payload, uint16(code))
	copy(payload[2:], reason)
	frame := []byte{0x80 | opClose, byte(len(payload))}
	if masked {
		var key [4]byte
		if _, err := rand.Read(key[:]); err != nil {
			panic(errors.New("routes: no randomness for a masking key"))
		}
		frame[1] |= 0x80
		frame = append(frame, key[:]...)
		for i := range payload {
			payload[i] ^= key[i%4]
		}
	}
	return append(frame, payload...)
}
