package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"time"

	"github.com/lightspeed-dev/incus-provider/guest"
)

// benchPath is one way to the guest's app: Addr a loopback listener (the
// edge, the byte relay, a peer), or "" for direct (the GuestDialer into
// the guest's network namespace).
type benchPath struct {
	Name string `json:"name"`
	Addr string `json:"addr"`
}

// peerJob is one phase of the peer comparison, run by a client process.
type peerJob struct {
	Phase    string        `json:"phase"` // "turns" (small GETs, 1 MiB bodies), "large" or "conns"
	Paths    []benchPath   `json:"paths"` // "turns": all, in turns; else one
	Instance string        `json:"instance"`
	PID      int           `json:"pid"`
	Endpoint string        `json:"endpoint"`
	Gets     int           `json:"gets"`
	MiB      int           `json:"mib"`
	Bytes    int64         `json:"bytes"`
	Conns    int           `json:"conns"`
	For      time.Duration `json:"for"`
}

// peerResult is a phase's figures; Get, Download and Upload per path.
type peerResult struct {
	Get      [][]time.Duration `json:"get,omitempty"`
	Download [][]time.Duration `json:"download,omitempty"`
	Upload   [][]time.Duration `json:"upload,omitempty"`
	Took     time.Duration     `json:"took,omitempty"`     // "large"
	Requests int64             `json:"requests,omitempty"` // "conns": answered 200 in the window
	Errors   int64             `json:"errors,omitempty"`
	Elapsed  time.Duration     `json:"elapsed,omitempty"`
	Lat      []time.Duration   `json:"lat,omitempty"`
	Conns    int               `json:"conns,omitempty"` // clients that connected
}

func (j peerJob) dial(p benchPath) func(context.Context) (net.Conn, error) {
	if p.Addr != "" {
		return func(ctx context.Context) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "tcp", p.Addr)
		}
	}
	dialer, err := guest.New(guest.KindNetns, guest.Options{Lookup: func(context.Context, string) (int, error) { return j.PID, nil }})
	if err != nil {
		return func(context.Context) (net.Conn, error) { return nil, fmt.Errorf("netns dialer: %w", err) }
	}
	return func(ctx context.Context) (net.Conn, error) {
		return dialer.DialContext(ctx, guest.Target{Instance: j.Instance, Port: 8080})
	}
}

// runPeerJob is the client process of one phase: the job as JSON in its
// one argument, the result as JSON on stdout.
func runPeerJob(ctx context.Context, arg string) error {
	var job peerJob
	if err := json.Unmarshal([]byte(arg), &job); err != nil {
		return fmt.Errorf("the client's job: %w", err)
	}
	if job.PID <= 0 || len(job.Paths) == 0 {
		return errors.New("the client's job names no guest init PID or no path")
	}
	if err := raiseFileLimit(); err != nil {
		return err
	}
	var res peerResult
	var err error
	switch job.Phase {
	case "turns":
		res, err = peerTurns(ctx, job)
	case "large":
		c := clientTo(job.dial(job.Paths[0]))
		start := time.Now()
		var n int64
		n, err = downloadInto(ctx, c, fmt.Sprintf("%s/bytes?n=%d", job.Endpoint, job.Bytes))
		res.Took = time.Since(start)
		if err == nil && n != job.Bytes {
			err = fmt.Errorf("large download: %d of %d bytes", n, job.Bytes)
		}
	case "conns":
		res, err = hammer(ctx, job)
	default:
		err = fmt.Errorf("unknown phase %q", job.Phase)
	}
	if err != nil {
		return fmt.Errorf("%s: %w", job.Phase, err)
	}
	return json.NewEncoder(os.Stdout).Encode(res)
}

// peerTurns runs the small GETs, then the 1 MiB downloads and uploads, on
// every path in turns, request by request; each round starts one path
// further on, so that no path always follows the same one.
func peerTurns(ctx context.Context, job peerJob) (peerResult, error) {
	cs := make([]*http.Client, len(job.Paths))
	for i, p := range job.Paths {
		cs[i] = clientTo(job.dial(p))
	}
	turns := func(n int, op func(*http.Client) error) ([][]time.Duration, error) {
		out := make([][]time.Duration, len(cs))
		for r := range n {
			for k := range cs {
				i := (r + k) % len(cs)
				start := time.Now()
				if err := op(cs[i]); err != nil {
					return nil, fmt.Errorf("%s: %w", job.Paths[i].Name, err)
				}
				out[i] = append(out[i], time.Since(start))
			}
		}
		return out, nil
	}
	var res peerResult
	var err error
	progress("small GETs, %d on each of %d paths in turns", job.Gets, len(cs))
	res.Get, err = turns(job.Gets, func(c *http.Client) error {
		s, err := get(ctx, c, job.Endpoint+"/bytes?n=64")
		if err == nil && s != http.StatusOK {
			err = fmt.Errorf("small GET answered %d", s)
		}
		return err
	})
	if err != nil {
		return res, err
	}
	progress("1 MiB bodies, %d each way on each path in turns", job.MiB)
	if res.Download, err = turns(job.MiB, func(c *http.Client) error { return moveMiB(ctx, c, job.Endpoint, "download") }); err != nil {
		return res, err
	}
	if res.Upload, err = turns(job.MiB, func(c *http.Client) error { return moveMiB(ctx, c, job.Endpoint, "upload") }); err != nil {
		return res, err
	}
	return res, nil
}

// downloadInto reads the answer through answerBuf, as moveMiB does.
func downloadInto(ctx context.Context, c *http.Client, u string) (int64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return 0, fmt.Errorf("request %s: %w", u, err)
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, fmt.Errorf("GET %s: %w", u, err)
	}
	defer func() { _ = resp.Body.Close() }()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("GET %s answered %d", u, resp.StatusCode)
	}
	n, err := io.CopyBuffer(io.Discard, struct{ io.Reader }{resp.Body}, answerBuf)
	if err != nil {
		return n, fmt.Errorf("read %s: %w", u, err)
	}
	return n, nil
}

// hammer connects job.Conns clients to the one path, each on a connection
// of its own kept alive, sends one unmeasured GET on each, and then, all
// starting at once, small GETs one after another on each for job.For. The
// client is a bare HTTP/1.1 writer and reader (http.ReadResponse), lighter
// than http.Client, as it shares the machine's cores with what it
// measures. Requests still under way at the end are waited for and
// counted; the rate is of the requests over the time until the last ends.
func hammer(ctx context.Context, job peerJob) (peerResult, error) {
	var res peerResult
	u, err := url.Parse(job.Endpoint)
	if err != nil {
		return res, fmt.Errorf("endpoint: %w", err)
	}
	request := []byte("GET /bytes?n=64 HTTP/1.1\r\nHost: " + u.Host + "\r\nUser-Agent: ingressbench\r\n\r\n")
	dial := job.dial(job.Paths[0])
	type client struct {
		c   net.Conn
		r   *bufio.Reader
		lat []time.Duration
	}
	one := func(cl *client) error {
		if _, err := cl.c.Write(request); err != nil {
			return err
		}
		resp, err := http.ReadResponse(cl.r, nil)
		if err != nil {
			return err
		}
		_, err = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		if err == nil && resp.StatusCode != http.StatusOK {
			err = fmt.Errorf("answered %d", resp.StatusCode)
		}
		return err
	}
	// Connect and warm up, at most 64 dials at a time (a burst of 1,000
	// SYNs would overflow a listen queue and measure retransmits).
	clients := make([]*client, job.Conns)
	var errs atomic.Int64
	var firstErr atomic.Value
	sem := make(chan struct{}, 64)
	var wg sync.WaitGroup
	cctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	for i := range clients {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			c, err := dial(cctx)
			if err == nil {
				_ = c.SetDeadline(time.Now().Add(30 * time.Second))
				cl := &client{c: c, r: bufio.NewReaderSize(c, 4096)}
				if err = one(cl); err == nil {
					clients[i] = cl
					return
				}
				_ = c.Close()
			}
			errs.Add(1)
			firstErr.CompareAndSwap(nil, err)
		}()
	}
	wg.Wait()
	defer func() {
		for _, cl := range clients {
			if cl != nil {
				_ = cl.c.Close()
			}
		}
	}()
	for _, cl := range clients {
		if cl != nil {
			res.Conns++
		}
	}
	if res.Conns == 0 {
		return res, fmt.Errorf("no client connected: %v", firstErr.Load())
	}
	progress("%s: %d clients connected, small GETs for %s", job.Paths[0].Name, res.Conns, job.For)
	start := time.Now()
	end := start.Add(job.For)
	var requests atomic.Int64
	for _, cl := range clients {
		if cl == nil {
			continue
		}
		cl.lat = make([]time.Duration, 0, 1024)
		_ = cl.c.SetDeadline(end.Add(30 * time.Second))
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				t := time.Now()
				if !t.Before(end) {
					return
				}
				if err := one(cl); err != nil {
					errs.Add(1)
					firstErr.CompareAndSwap(nil, err)
					return
				}
				cl.lat = append(cl.lat, time.Since(t))
				requests.Add(1)
			}
		}()
	}
	wg.Wait()
	res.Elapsed = time.Since(start)
	res.Requests = requests.Load()
	res.Errors = errs.Load()
	if res.Errors > 0 {
		progress("%s: %d clients failed, the first: %v", job.Paths[0].Name, res.Errors, firstErr.Load())
	}
	for _, cl := range clients {
		if cl != nil {
			res.Lat = append(res.Lat, cl.lat...)
		}
	}
	return res, ctx.Err()
}

// childJSON runs this binary with flag and job as JSON, and decodes what
// it prints into out.
func childJSON(ctx context.Context, flag string, job, out any) error {
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("this binary's path: %w", err)
	}
	arg, err := json.Marshal(job)
	if err != nil {
		return fmt.Errorf("the client's job: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, self, flag, string(arg))
	cmd.Stderr = os.Stderr
	b, err := cmd.Output()
	if err != nil {
		return fmt.Errorf("the measuring client process: %w", err)
	}
	if err := json.Unmarshal(b, out); err != nil {
		return fmt.Errorf("the measuring client's result: %w", err)
	}
	return nil
}
