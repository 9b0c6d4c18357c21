package incus

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"path"
	"strings"
	"sync"
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

	// via pins the call to one endpoint (an operation's): no failover.
	via *endpoint

	// patient marks a read that may rightly take seconds (a recursive
	// list of a large project): AttemptTimeout does not cut it short, and
	// like a write it goes to endpoints known to answer before it would
	// probe one that failed.
	patient bool

	// metadata, when set, decodes a sync answer's metadata as it arrives
	// (see parseStream); the response's Metadata is then empty.
	metadata metadataSink

	// waitCall marks GET /1.0/operations/{id}/wait. Incus sends the 200
	// header before it starts waiting, so the outcome of the wait (the
	// operation failed, or the server-side timeout ran out) arrives as an
	// error envelope under HTTP 200. Such a response is handed back as is
	// for Wait to interpret, instead of becoming an *Error.
	waitCall bool
}

// envelope is the body of every Incus response.
type envelope struct {
	Type       string      `json:"type"` // sync, async or error
	Status     string      `json:"status"`
	StatusCode StatusCode  `json:"status_code"`
	Operation  string      `json:"operation"`
	ErrorCode  int         `json:"error_code"`
	Error      string      `json:"error"`
	Metadata   metadataRef `json:"metadata"`
}

// metadataRef is the metadata's bytes within the body they were read
// from, not a copy: at 10,000 instances a listing's metadata is tens of
// MiB, and the body is neither reused nor changed once parsed.
type metadataRef []byte

// UnmarshalJSON keeps data, a slice of the body, which outlives it.
func (m *metadataRef) UnmarshalJSON(data []byte) error {
	*m = data
	return nil
}

type response struct {
	envelope
	httpStatus int
	etag       string
	streamed   bool      // the metadata went to the request's sink
	via        *endpoint // the endpoint that answered
}

// do runs one call under the call deadline, over as many endpoints as it
// takes (see Client), decodes the envelope and turns error answers into
// *Error. It reports the call to Observe.
func (c *Client) do(ctx context.Context, r request) (*response, error) {
	start := time.Now()
	resp, err := c.call(ctx, r)
	// The server refused the call before doing anything, because another
	// operation held the instance until just then (LXD 5.0 takes such a
	// lock for every change, so two writes to one instance at once meet
	// it): asked again, a few times, a little later each time.
	for pause := 5 * time.Millisecond; isLockRace(err) && pause <= 80*time.Millisecond; pause *= 2 {
		t := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			t.Stop()
			return resp, err
		case <-t.C:
		}
		resp, err = c.call(ctx, r)
	}
	if c.observe != nil {
		c.observe(r.op, outcome(err), time.Since(start))
	}
	if names := wroteInstances(r); names != nil {
		c.writes.tell(c.project, names, startedOp(resp), false)
	}
	return resp, err
}

// attemptKind is how one attempt on one endpoint ended.
type attemptKind int

const (
	answered      attemptKind = iota // an answer (success or refusal): the endpoint works
	notConnected                     // no connection, or none of the request written
	lost                             // the connection broke after the request may have left
	timedOut                         // the request may have left; no answer within the attempt's bound
	unready                          // the member itself is starting up or shutting down
	cannotForward                    // the member could not reach what the call needs (or a read got 503)
	callOver                         // the call's own context ended
	invalid                          // the request could not be built: no endpoint is to blame
)

type attempt struct {
	kind attemptKind
	resp *response
	err  error // *Error for an answer, else the transport failure
	sent bool  // some of the request may have reached the server
	took time.Duration
}

// errAttemptTimeout is the cause of an attempt cut short by AttemptTimeout.
var errAttemptTimeout = errors.New("no answer within the attempt's bound")

func (c *Client) call(ctx context.Context, r request) (*response, error) {
	timeout := r.timeout
	if timeout <= 0 {
		timeout = c.callTimeout
	}
	callCtx, cancel := context.WithTimeoutCause(ctx, timeout,
		fmt.Errorf("call took longer than %s: %w", timeout, context.DeadlineExceeded))
	defer cancel()

	var body []byte
	if r.body != nil {
		buf, err := json.Marshal(r.body)
		if err != nil {
			return nil, &Error{Op: r.op, Err: fmt.Errorf("encode request: %w", err)}
		}
		body = buf
	}
	write := r.method != http.MethodGet && r.method != http.MethodHead
	var picks []pick
	if r.via != nil {
		picks = pinned(r.via)
	} else {
		picks = c.eps.order(!write && !r.patient)
		if r.scoped {
			picks = preferAffine(picks, c.eps.affineTo(c.project, r))
		}
	}
	// Every pick is settled once: by its attempt's result, as a suspect
	// at the end, or unused.
	settled := make([]bool, len(picks))
	defer func() {
		for i, p := range picks {
			if !settled[i] {
				p.release()
			}
		}
	}()

	var failures []error
	var suspects []int // picks whose failure may not be theirs; see Client
	for i, p := range picks {
		a := c.attempt(callCtx, r, body, p, i == len(picks)-1, write)
		switch a.kind {
		case invalid:
			return nil, a.err
		case answered:
			c.eps.succeeded(p)
			settled[i] = true
			// Another endpoint answered this call, and in good time: those
			// that did not were at fault after all. (One that answered
			// slowly too says the call is slow, not the members.)
			if a.took < c.attemptTO {
				for _, j := range suspects {
					c.eps.failed(picks[j], failures[j])
					settled[j] = true
				}
			}
			return a.resp, a.err
		case callOver:
			if write && a.sent {
				return nil, outcomeUnknown(r.op, contextual(callCtx, a.err))
			}
			failures = append(failures, a.err)
			e := &Error{Op: r.op, Err: contextual(callCtx, joinAttempts(failures))}
			e.unreachable = !errors.Is(ctx.Err(), context.Canceled)
			return nil, e
		case notConnected, unready:
			c.eps.failed(p, a.err)
			settled[i] = true
		case lost:
			c.eps.failed(p, a.err)
			settled[i] = true
			if write {
				return nil, outcomeUnknown(r.op, a.err)
			}
		case timedOut:
			if write {
				return nil, outcomeUnknown(r.op, a.err)
			}
			suspects = append(suspects, i)
		case cannotForward:
			suspects = append(suspects, i)
		}
		failures = append(failures, a.err)
	}

	// No endpoint answered, and a write was sent to none.
	var e *Error
	if errors.As(failures[len(failures)-1], &e) && e.Status != 0 {
		// The last endpoint's own words say more than a summary (and keep
		// a single endpoint's errors as they always were).
		cp := *e
		cp.unreachable = true
		return nil, &cp
	}
	return nil, &Error{Op: r.op, Err: joinAttempts(failures), unreachable: true}
}

// outcomeUnknown is the error of a write that was sent and got no answer.
func outcomeUnknown(op string, err error) error {
	return &Error{Op: op, Err: fmt.Errorf("sent, but no answer came back, so it may have been carried out: %w", err), unknown: true}
}

// attempt runs the call once on one endpoint. last says no other endpoint
// follows: it then has the rest of the call's time for everything.
func (c *Client) attempt(callCtx context.Context, r request, body []byte, p pick, last, write bool) attempt {
	start := time.Now()
	a := c.tryEndpoint(callCtx, r, body, p.ep, last, write)
	a.took = time.Since(start)
	if c.observeEP != nil {
		c.observeEP(p.ep.label, r.op, attemptStatus(callCtx, a), a.took)
	}
	return a
}

func attemptStatus(callCtx context.Context, a attempt) string {
	switch a.kind {
	case answered:
		return outcome(a.err)
	case notConnected, lost:
		return "transport"
	case timedOut:
		return "timeout"
	case unready, cannotForward:
		return "not_ready"
	default:
		if errors.Is(callCtx.Err(), context.Canceled) {
			return "canceled"
		}
		return "timeout"
	}
}

// sentTracker watches which connections a request got and whether any
// byte of it was handed to one.
type sentTracker struct {
	mu    sync.Mutex
	conns []*countingConn
	from  []int64
	other bool // a connection of another kind: assume it was written to
}

func (t *sentTracker) gotConn(info httptrace.GotConnInfo) {
	t.mu.Lock()
	defer t.mu.Unlock()
	cc, ok := info.Conn.(*countingConn)
	if !ok {
		t.other = true
		return
	}
	t.conns = append(t.conns, cc)
	t.from = append(t.from, cc.writes.Load())
}

// sent: some byte of the request may have left. A request that timed out
// once it had a connection counts as sent, written or not: its write may
// be under way.
func (t *sentTracker) sent(timedOut bool) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.other || (timedOut && len(t.conns) > 0) {
		return true
	}
	for i, cc := range t.conns {
		if cc.writes.Load() != t.from[i] {
			return true
		}
	}
	return false
}

func (c *Client) tryEndpoint(callCtx context.Context, r request, body []byte, ep *endpoint, last, write bool) attempt {
	actx := callCtx
	if !last && !write && !r.patient {
		var cancel context.CancelFunc
		actx, cancel = context.WithTimeoutCause(callCtx, c.attemptTO, errAttemptTimeout)
		defer cancel()
	}
	connectBy, ok := actx.Deadline()
	if !last {
		if t := time.Now().Add(c.connectTO); !ok || t.Before(connectBy) {
			connectBy = t
		}
	}
	tracker := &sentTracker{}
	tctx := httptrace.WithClientTrace(withConnectBy(actx, connectBy), &httptrace.ClientTrace{GotConn: tracker.gotConn})

	q := url.Values{}
	for k, v := range r.query {
		q[k] = v
	}
	if r.scoped {
		q.Set("project", c.project)
	}
	target := ep.base.String() + r.path
	if len(q) > 0 {
		target += "?" + q.Encode()
	}
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(tctx, r.method, target, rd)
	if err != nil {
		return attempt{kind: invalid, err: &Error{Op: r.op, Err: err}}
	}
	req.Header.Set("Accept", "application/json")
	req.Header.Set("User-Agent", "incus-provider")
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if r.etag != "" {
		req.Header.Set("If-Match", r.etag)
	}

	// failed classifies a call that got no (complete) answer.
	failed := func(err error, answerStarted bool) attempt {
		timeout := actx.Err() != nil
		sent := answerStarted || tracker.sent(timeout)
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // the URL is the endpoint's, which the text names already
		}
		switch {
		case callCtx.Err() != nil:
			return attempt{kind: callOver, err: &endpointError{ep.label, err}, sent: sent}
		case !sent:
			return attempt{kind: notConnected, err: &endpointError{ep.label, err}}
		case timeout:
			return attempt{kind: timedOut, err: &endpointError{ep.label, fmt.Errorf("no answer within %s", c.attemptTO)}, sent: true}
		default:
			return attempt{kind: lost, err: &endpointError{ep.label, err}, sent: true}
		}
	}

	hresp, err := ep.http.Do(req)
	if err != nil {
		return failed(err, false)
	}
	defer hresp.Body.Close()
	// cutShort: an answer that does not parse, read after this attempt's
	// time ran out, is the server's reaction to the cut and says nothing
	// of the call. Go's transport hands back a response that raced its
	// own cancellation, and a server whose handler gives up when the
	// connection closes answers an empty 200 in that race (met under
	// load: a hung member's "answer" to a write whose outcome is unknown).
	cutShort := func(aerr error) bool {
		return errors.Is(aerr, ErrMalformedResponse) && actx.Err() != nil
	}
	if r.metadata != nil && hresp.StatusCode == http.StatusOK {
		resp, aerr, rerr := c.parseStream(r, hresp)
		if rerr != nil {
			return failed(fmt.Errorf("read response: %w", rerr), true)
		}
		if cutShort(aerr) {
			return failed(fmt.Errorf("read response: %w", context.Cause(actx)), true)
		}
		if resp != nil {
			resp.via = ep
		}
		return attempt{kind: failoverKind(aerr, write), resp: resp, err: aerr, sent: true}
	}
	raw, err := readBody(hresp)
	if err != nil {
		return failed(fmt.Errorf("read response: %w", err), true)
	}
	resp, aerr := c.parse(r, hresp, raw)
	if cutShort(aerr) {
		return failed(fmt.Errorf("read response: %w", context.Cause(actx)), true)
	}
	if resp != nil {
		resp.via = ep
	}
	return attempt{kind: failoverKind(aerr, write), resp: resp, err: aerr, sent: true}
}

// readBody reads at most maxResponse+1 bytes of the body, into one buffer
// of the announced length when there is one: a listing of 10,000 instances
// read by doubling passed through twice its size in garbage.
func readBody(hresp *http.Response) ([]byte, error) {
	body := io.LimitReader(hresp.Body, maxResponse+1)
	if n := hresp.ContentLength; n > 0 && n <= maxResponse {
		buf := make([]byte, n)
		if _, err := io.ReadFull(body, buf); err != nil {
			return nil, err
		}
		// Nothing may follow what was announced; the transport refuses a
		// longer body, so this reads only the end.
		if m, err := body.Read(make([]byte, 1)); m > 0 || (err != nil && err != io.EOF) {
			return nil, fmt.Errorf("body longer than its Content-Length %d", n)
		}
		return buf, nil
	}
	return io.ReadAll(body)
}

// failoverKind says whether an answer is one to try the next endpoint on.
func failoverKind(err error, write bool) attemptKind {
	var e *Error
	if !errors.As(err, &e) || e.Status == 0 {
		return answered
	}
	switch {
	case e.Status == http.StatusServiceUnavailable && isUnreadyMessage(e.Message):
		return unready
	case e.Status >= 500 && isForwardMessage(e.Message):
		return cannotForward
	case !write && e.Status == http.StatusServiceUnavailable:
		return cannotForward
	}
	return answered
}

// isUnreadyMessage recognises Incus refusing a call at its front door
// because the daemon is not set up yet or is shutting down (503): nothing
// of the call ran.
func isUnreadyMessage(msg string) bool {
	return msg == "Daemon is starting up" || msg == "Shutting down"
}

// isForwardMessage recognises a member that could not reach the member a
// call must be forwarded to (the one holding the instance): "Server isn't
// ready yet" when that member is known to be down, "Missing event
// connection with target cluster member" after waiting 10 s for it (Incus
// 6.0, internal/server/cluster/connect.go). Both come before the call is
// forwarded, so nothing of it ran.
func isForwardMessage(msg string) bool {
	return strings.Contains(msg, "Server isn't ready yet") ||
		strings.Contains(msg, "Missing event connection with target cluster member")
}

// parse turns a complete HTTP answer into a response or an *Error.
func (c *Client) parse(r request, hresp *http.Response, raw []byte) (*response, error) {
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
	return c.judge(r, hresp, resp)
}

// judge turns a decoded envelope into the answer or its *Error.
func (c *Client) judge(r request, hresp *http.Response, resp *response) (*response, error) {
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

// endpointError is one endpoint's failure, named by its label.
type endpointError struct {
	label string
	err   error
}

func (e *endpointError) Error() string { return e.label + ": " + e.err.Error() }
func (e *endpointError) Unwrap() error { return e.err }

// attemptsError is the failures of every endpoint a call tried.
type attemptsError struct{ errs []error }

func (e *attemptsError) Error() string {
	parts := make([]string, len(e.errs))
	for i, err := range e.errs {
		parts[i] = err.Error()
	}
	return "no Incus endpoint answered: " + strings.Join(parts, "; ")
}

func (e *attemptsError) Unwrap() []error { return e.errs }

func joinAttempts(errs []error) error {
	return &attemptsError{errs: append([]error(nil), errs...)}
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
// Operations names every call the client makes, as the op of its
// observations: metrics start each at zero with it, so that the first
// failure of a call is an increase rather than a new series.
func Operations() []string {
	return []string{"cluster.group.get", "cluster.members.list", "image.alias.get", "image.get",
		"instance.create", "instance.delete", "instance.exec", "instance.find", "instance.get", "instance.list", "instance.located",
		"instance.patch", "instance.put", "instance.rename", "instance.state.get", "instance.state.put",
		"operation.get", "operation.list", "operation.wait", "profile.get", "project.create", "project.delete", "project.get", "project.put", "server.get"}
}

// CallStatuses are the statuses a call is observed with (Observe).
func CallStatuses() []string { return []string{"ok", "not_found", "conflict", "error", "transport"} }

// AttemptStatuses are the statuses an attempt on one endpoint is observed
// with (ObserveEndpoint).
func AttemptStatuses() []string {
	return append(CallStatuses(), "timeout", "not_ready", "canceled")
}

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
	o.via = resp.via
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
