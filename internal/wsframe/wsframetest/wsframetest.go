// Package wsframetest builds WebSocket frames for tests and reads them with
// an oracle of its own, written byte by byte from RFC 6455 (section 5.2) and
// the relay's rules (routes/doc.go), so that the fuzz targets of wsframe and
// of the relay hold the code under test to something other than itself. It
// does not import wsframe, whose own tests use it.
package wsframetest

import (
	"crypto/rand"
	"encoding/binary"
)

// The close codes the rules answer with (RFC 6455, section 7.4.1).
const (
	CloseProtocolError = 1002
	CloseTooBig        = 1009
)

// Frame builds one frame; masked frames get a random key.
func Frame(fin bool, op byte, payload []byte, masked bool) []byte {
	b0 := op
	if fin {
		b0 |= 0x80
	}
	out := []byte{b0}
	var mbit byte
	if masked {
		mbit = 0x80
	}
	n := len(payload)
	switch {
	case n < 126:
		out = append(out, mbit|byte(n))
	case n < 1<<16:
		out = append(out, mbit|126, byte(n>>8), byte(n))
	default:
		var l [8]byte
		binary.BigEndian.PutUint64(l[:], uint64(n))
		out = append(out, mbit|127)
		out = append(out, l[:]...)
	}
	if !masked {
		return append(out, payload...)
	}
	var key [4]byte
	_, _ = rand.Read(key[:])
	out = append(out, key[:]...)
	start := len(out)
	out = append(out, payload...)
	for i := range payload {
		out[start+i] ^= key[i%4]
	}
	return out
}

// Header is the oracle's reading of a frame header. Whole is false when
// the bytes end inside the header.
type Header struct {
	Fin      bool
	RSV      byte // the three reserved bits, as a number 0..7
	Op       byte
	Masked   bool
	LenField byte // the 7-bit length field: a length, or 126 or 127
	Length   uint64
	Size     int
	Whole    bool
}

// Parse reads the frame header at the start of b.
func Parse(b []byte) Header {
	var h Header
	if len(b) < 2 {
		return h
	}
	h.Fin = b[0] >= 0x80
	h.RSV = b[0] >> 4 & 7
	h.Op = b[0] % 16
	h.Masked = b[1] >= 0x80
	h.LenField = b[1] % 128
	ext := 0
	switch h.LenField {
	case 126:
		ext = 2
	case 127:
		ext = 8
	}
	h.Size = 2 + ext
	if h.Masked {
		h.Size += 4
	}
	if len(b) < h.Size {
		return h
	}
	h.Whole = true
	if ext == 0 {
		h.Length = uint64(h.LenField)
	}
	for _, c := range b[2 : 2+ext] {
		h.Length = h.Length<<8 | uint64(c)
	}
	return h
}

// Rules is the oracle's framing state of one direction.
type Rules struct {
	InMessage bool
	size      uint64
}

// Step returns the close code a header must be answered with (0 when the
// frame is allowed) and whether the frame ends a data message.
func (s *Rules) Step(h Header, fromClient bool, limit uint64) (code int, ends bool) {
	control := h.Op == 8 || h.Op == 9 || h.Op == 10
	data := h.Op == 1 || h.Op == 2
	switch {
	case h.Length >= 1<<63, // only a 64-bit length can be this long
		h.RSV != 0,             // no extension is negotiated
		h.Masked != fromClient, // clients mask, servers do not
		!control && !data && h.Op != 0,
		control && (!h.Fin || h.Length > 125),
		data && s.InMessage,
		h.Op == 0 && !s.InMessage:
		return CloseProtocolError, false
	case control:
		return 0, false
	}
	if data {
		s.size = 0
	}
	s.size += h.Length
	if s.size > limit {
		return CloseTooBig, false
	}
	s.InMessage = !h.Fin
	return 0, h.Fin
}
