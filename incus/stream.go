package incus

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
)

// A listing of 10,000 instances is a 36 MiB body. Read whole and then
// decoded, it is held three times at its peak: the body, the full decode of
// every instance, and what the caller keeps of each. A call whose request
// carries metadata decodes its metadata straight from the connection
// instead, so that only the caller's part of each item outlives its decode.

// metadataSink decodes one response's metadata from dec, positioned at the
// metadata value, and must consume exactly that value. It may be called
// once per attempt: an attempt cut short is tried again on the next
// endpoint, so a sink keeps what it decoded only once it has returned nil.
type metadataSink func(dec *json.Decoder) error

// countingReader counts what it reads and keeps the first read error, so
// that a failed decode can tell a broken connection from a malformed body.
type countingReader struct {
	r   io.Reader
	n   int64
	err error
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	if err != nil && err != io.EOF && c.err == nil {
		c.err = err
	}
	return n, err
}

// parseStream decodes a 200 answer's envelope token by token from the
// body, handing a sync answer's metadata to r.metadata; an error answer's
// or an async answer's metadata is kept as bytes, as parse keeps it. The
// second error is a failure to read the body (the connection broke); the
// first is the answer's own, as parse answers it.
func (c *Client) parseStream(r request, hresp *http.Response) (*response, error, error) {
	body := &countingReader{r: io.LimitReader(hresp.Body, maxResponse+1)}
	dec := json.NewDecoder(body)
	resp := &response{httpStatus: hresp.StatusCode, etag: hresp.Header.Get("ETag")}
	malformed := func(why error) (*response, error, error) {
		switch {
		case body.err != nil:
			return nil, nil, body.err
		case body.n > maxResponse:
			why = fmt.Errorf("body larger than %d bytes", maxResponse)
		}
		return nil, &Error{Op: r.op, Status: hresp.StatusCode, Err: fmt.Errorf("%w: %w", ErrMalformedResponse, why)}, nil
	}
	if err := expectDelim(dec, '{'); err != nil {
		return malformed(err)
	}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return malformed(err)
		}
		key, _ := tok.(string)
		switch key {
		case "type":
			err = dec.Decode(&resp.Type)
		case "status":
			err = dec.Decode(&resp.Status)
		case "status_code":
			err = dec.Decode(&resp.StatusCode)
		case "operation":
			err = dec.Decode(&resp.Operation)
		case "error_code":
			err = dec.Decode(&resp.ErrorCode)
		case "error":
			err = dec.Decode(&resp.Error)
		case "metadata":
			if resp.Type == "sync" {
				// Incus writes the type first; a body that does not
				// is read whole, below.
				if err = r.metadata(dec); err != nil {
					err = fmt.Errorf("metadata: %w", err)
				}
				resp.streamed = true
				break
			}
			var raw json.RawMessage
			err = dec.Decode(&raw)
			resp.Metadata = metadataRef(raw)
		default:
			var skip json.RawMessage
			err = dec.Decode(&skip)
		}
		if err != nil {
			return malformed(err)
		}
	}
	if err := expectDelim(dec, '}'); err != nil {
		return malformed(err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return malformed(errors.New("more after the answer's object"))
	}
	if resp.Type == "" {
		return malformed(errors.New("no response type"))
	}
	if resp.Type == "sync" && !resp.streamed {
		// The metadata came before the type (Incus writes the type first;
		// another writer may sort its keys), or not at all: the sink reads
		// the bytes kept, or a null, as a whole body's decode would.
		var md io.Reader = nullReader{}
		if len(resp.Metadata) > 0 {
			md = bytes.NewReader(resp.Metadata)
		}
		if err := r.metadata(json.NewDecoder(md)); err != nil {
			return malformed(fmt.Errorf("metadata: %w", err))
		}
		resp.Metadata, resp.streamed = nil, true
	}
	resp, err := c.judge(r, hresp, resp)
	return resp, err, nil
}

type nullReader struct{}

func (nullReader) Read(p []byte) (int, error) { return copy(p, "null"), io.EOF }

func expectDelim(dec *json.Decoder, want json.Delim) error {
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	if d, ok := tok.(json.Delim); !ok || d != want {
		return fmt.Errorf("want %q, found %v", want, tok)
	}
	return nil
}

// decodeArray decodes a JSON array (or null) item by item, handing each to
// each: the array is never held whole.
func decodeArray[T any](dec *json.Decoder, each func(*T)) error {
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	if tok == nil {
		return nil
	}
	if d, ok := tok.(json.Delim); !ok || d != '[' {
		return fmt.Errorf("want an array, found %v", tok)
	}
	for dec.More() {
		var v T
		if err := dec.Decode(&v); err != nil {
			return err
		}
		each(&v)
	}
	return expectDelim(dec, ']')
}
