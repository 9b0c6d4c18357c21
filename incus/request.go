package incus

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"path"
	"strings"
	"time"
)

// maxResponse caps how much of a response body is read (a recursive
// instance list of a busy project is the largest thing this client asks for).
const maxResponse = 64 << 20

// request describes one HTTP call.
type request struct {
	op      string     // fixed call name for errors and Observe
	method  string     // GET, POST, ...
	path    string     // already escaped, starting with /1.0
	query   url.Values // optional
	scoped  bool       // add ?project=
	body    any        // JSON-encoded when non-nil
	etag    string     // sent as If-Match when non-empty
	timeout time.Duration

	// waitCall marks GET /1.0/operations/{id}/wait. Incus sends the 200
	// header before it starts waiting, so the outcome of the wait (the
	// operation failed, or the server-side timeout ran out) arrives as an
	// error envelope under HTTP 200. Such a response is handed back as is
	// for Wait to interpret, instead of becoming an *Error.
	waitCall bool
}

// envelope is the body of every Incus response.
type envelope struct {
	Type       string          `json:"type"` // sync, async or error
	Status     string          `json:"status"`
	StatusCode int             `json:"status_code"`
	Operation  string          `json:"operation"`
	ErrorCode  int             `json:"error_code"`
	Error      string          `json:"error"`
	Metadata   json.RawMessage `json:"metadata"`
}

type response struct {
	envelope
	httpStatus int
	etag       string
}

// do runs one HTTP call under the call deadline, decodes the envelope and
// turns error answers into *Error. It reports the call to Observe.
func (c *Client) do(ctx context.Context, r request) (*response, error) {
	start := time.Now()
	resp, err := c.roundTrip(ctx, r)
	if c.observe != nil {
		c.observe(r.op, outcome(err), time.Since(start))
	}
	return resp, err
}

func (c *Client) roundTrip(ctx context.Context, r request) (*response, error) {
	timeout := r.timeout
	if timeout <= 0 {
		timeout = c.callTimeout
	}
	callCtx, cancel := context.WithTimeoutCause(ctx, timeout,
		fmt.Errorf("call took longer than %s: %w", timeout, context.DeadlineExceeded))
	defer cancel()

	q := url.Values{}
	for k, v := range r.query {
		q[k] = v
	}
	if r.scoped {
		q.Set("project", c.project)
	}
	target := c.base.String() + r.path
	if len(q) > 0 {
		target += "?" + q.Encode()
	}

	var body io.Reader
	if r.body != nil {
		buf, err := json.Marshal(r.body)
		if err != nil {
			return nil, &Error{Op: r.op, Err: fmt.Errorf("encode request: %w", err)}
		}
		body = bytes.NewReader(buf)
	}
	req, err := http.NewRequestWithContext(callCtx, r.method, target, body)
	if err != nil {
		return nil, &Error{Op: r.op, Err: err}
	}
	req.Header.Set("Accept", "application/json")
	req.Header.Set("User-Agent", "incus-provider")
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if r.etag != "" {
		req.Header.Set("If-Match", r.etag)
	}

	hresp, err := c.http.Do(req)
	if err != nil {
		return nil, &Error{Op: r.op, Err: contextual(callCtx, err)}
	}
	defer hresp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(hresp.Body, maxResponse+1))
	if err != nil {
		return nil, &Error{Op: r.op, Err: contextual(callCtx, fmt.Errorf("read response: %w", err))}
	}
	if len(raw) > maxResponse {
		return nil, &Error{Op: r.op, Status: hresp.StatusCode, Err: fmt.Errorf("%w: body larger than %d bytes", ErrMalformedResponse, maxResponse)}
	}

	resp := &response{httpStatus: hresp.StatusCode, etag: hresp.Header.Get("ETag")}
	if err := json.Unmarshal(raw, &resp.envelope); err != nil || resp.Type == "" {
		if hresp.StatusCode >= 400 {
			// Not from Incus proper (a proxy, or a crash); keep what it said.
			return nil, &Error{Op: r.op, Status: hresp.StatusCode, Message: snippet(raw)}
		}
		why := "no response type"
		if err != nil {
			why = err.Error()
		}
		return nil, &Error{Op: r.op, Status: hresp.StatusCode, Err: fmt.Errorf("%w: %s", ErrMalformedResponse, why)}
	}

	switch resp.Type {
	case "error":
		if r.waitCall && hresp.StatusCode == http.StatusOK {
			return resp, nil
		}
		code := resp.ErrorCode
		if code == 0 {
			code = hresp.StatusCode
		}
		if code < 400 {
			code = http.StatusInternalServerError
		}
		return nil, &Error{Op: r.op, Status: code, Message: resp.Error}
	case "sync", "async":
		if hresp.StatusCode >= 400 {
			return nil, &Error{Op: r.op, Status: hresp.StatusCode, Message: resp.Error}
		}
		return resp, nil
	default:
		return nil, &Error{Op: r.op, Status: hresp.StatusCode, Err: fmt.Errorf("%w: response type %q", ErrMalformedResponse, resp.Type)}
	}
}

// contextual makes sure a failure caused by the call's context says so and
// matches context.Canceled / context.DeadlineExceeded with errors.Is.
func contextual(callCtx context.Context, err error) error {
	if callCtx.Err() == nil {
		return err
	}
	cerr := ctxErr(callCtx)
	if errors.Is(err, cerr) {
		return err
	}
	// err is kept as text only: the result must match the context's
	// error and nothing the failed call would otherwise match (a conflict,
	// say), so that callers see a context failure and no more.
	return fmt.Errorf("%w (%s)", cerr, err.Error())
}

// outcome is the Observe status for a call's result.
func outcome(err error) string {
	if err == nil {
		return "ok"
	}
	var e *Error
	if !errors.As(err, &e) {
		return "error"
	}
	switch {
	case e.Err != nil && e.Status == 0:
		return "transport"
	case e.Status == http.StatusNotFound:
		return "not_found"
	case e.Status == http.StatusConflict, e.Status == http.StatusPreconditionFailed:
		return "conflict"
	default:
		return "error"
	}
}

// get runs a GET and decodes its metadata into a T; what names the call in
// the error ("get instance \"x\"").
func get[T any](ctx context.Context, c *Client, r request, what string) (*T, *response, error) {
	r.method = http.MethodGet
	resp, err := c.do(ctx, r)
	if err != nil {
		return nil, nil, fmt.Errorf("incus: %s: %w", what, err)
	}
	var v T
	if err := decode(r.op, resp, &v); err != nil {
		return nil, nil, fmt.Errorf("incus: %s: %w", what, err)
	}
	return &v, resp, nil
}

// decode unmarshals the response metadata into v.
func decode(op string, resp *response, v any) error {
	if err := json.Unmarshal(resp.Metadata, v); err != nil {
		return &Error{Op: op, Status: resp.httpStatus, Err: fmt.Errorf("%w: metadata: %w", ErrMalformedResponse, err)}
	}
	return nil
}

// operationOf returns the operation an async response started. A sync
// response means the work is already done; it is returned as a finished,
// successful operation without an ID, which Wait accepts as is.
func operationOf(op string, resp *response) (*Operation, error) {
	if resp.Type == "sync" {
		return &Operation{Status: "Success", StatusCode: StatusSuccess}, nil
	}
	var o Operation
	if len(resp.Metadata) > 0 && string(resp.Metadata) != "null" {
		if err := decode(op, resp, &o); err != nil {
			return nil, err
		}
	}
	id := operationID(resp.Operation)
	if id == "" {
		id = o.ID
	}
	if id == "" {
		return nil, &Error{Op: op, Status: resp.httpStatus, Err: fmt.Errorf("%w: async response without operation", ErrMalformedResponse)}
	}
	o.ID = id
	if o.StatusCode == 0 {
		o.Status, o.StatusCode = "Running", StatusRunning
	}
	return &o, nil
}

// operationID takes the ID out of an operation URL such as
// "/1.0/operations/<id>" (possibly with a query string).
func operationID(u string) string {
	if u == "" {
		return ""
	}
	parsed, err := url.Parse(u)
	if err != nil {
		return ""
	}
	p := parsed.Path
	if !strings.HasPrefix(p, "/1.0/operations/") {
		return ""
	}
	id := path.Base(p)
	if id == "operations" || id == "/" || id == "." {
		return ""
	}
	return id
}

func snippet(b []byte) string {
	s := strings.TrimSpace(string(b))
	if len(s) > 200 {
		s = s[:200] + "..."
	}
	return s
}
