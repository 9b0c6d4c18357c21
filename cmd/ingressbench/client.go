package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"time"

	"github.com/lightspeed-dev/incus-provider/guest"
)

// The small GETs and the 1 MiB bodies are measured from a process of
// their own by default, as a real client is. A client in the edge's own
// process shares its Go scheduler: the client's transport goroutines and
// the edge's wake each other on the same two Ps, which weighs on the edge
// path (three goroutines of one process a request) more than on the direct
// one (the client's alone), so the shape measured the client as much as
// the edge. -client inline keeps the old shape, for comparison.

// clientJob is what the measuring process is given.
type clientJob struct {
	Edge     string `json:"edge"`  // the edge's loopback listener
	Relay    string `json:"relay"` // the byte relay's
	Instance string `json:"instance"`
	PID      int    `json:"pid"` // the guest's init PID, for the direct dial
	Endpoint string `json:"endpoint"`
	Gets     int    `json:"gets"`
	MiB      int    `json:"mib"`
}

// clientResult holds each phase's durations, per path: edge, direct, byte
// relay.
type clientResult struct {
	Get      [][]time.Duration `json:"get"`
	Download [][]time.Duration `json:"download"`
	Upload   [][]time.Duration `json:"upload"`
}

// measure runs the small GETs and the 1 MiB bodies, in turns on the three
// paths.
func measure(ctx context.Context, job clientJob, edge, direct, floor *http.Client) (clientResult, error) {
	var res clientResult
	var err error
	progress("small GETs")
	res.Get, err = interleaved(job.Gets, func(c *http.Client) error {
		s, err := get(ctx, c, job.Endpoint+"/bytes?n=64")
		if err == nil && s != http.StatusOK {
			err = fmt.Errorf("small GET answered %d", s)
		}
		return err
	}, edge, direct, floor)
	if err != nil {
		return res, err
	}
	progress("1 MiB bodies")
	for _, dir := range []string{"download", "upload"} {
		took, err := interleaved(job.MiB, func(c *http.Client) error { return moveMiB(ctx, c, job.Endpoint, dir) }, edge, direct, floor)
		if err != nil {
			return res, err
		}
		if dir == "download" {
			res.Download = took
		} else {
			res.Upload = took
		}
	}
	return res, nil
}

// clients are the three paths' HTTP clients as job names them.
func clients(job clientJob, direct guest.Dialer) (edge, dir, floor *http.Client) {
	edge = clientTo(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", job.Edge)
	})
	dir = clientTo(func(ctx context.Context) (net.Conn, error) {
		return direct.DialContext(ctx, guest.Target{Instance: job.Instance, Port: 8080})
	})
	floor = clientTo(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", job.Relay)
	})
	return edge, dir, floor
}

// runClient is the measuring process: the job as JSON in its one
// argument, the result as JSON on stdout.
func runClient(ctx context.Context, arg string) error {
	var job clientJob
	if err := json.Unmarshal([]byte(arg), &job); err != nil {
		return fmt.Errorf("the client's job: %w", err)
	}
	if job.PID <= 0 {
		return errors.New("the client's job names no guest init PID")
	}
	// The guest stays running through these phases: its PID holds.
	dialer, err := guest.New(guest.KindNetns, guest.Options{Lookup: func(context.Context, string) (int, error) { return job.PID, nil }})
	if err != nil {
		return fmt.Errorf("netns dialer: %w", err)
	}
	edge, direct, floor := clients(job, dialer)
	res, err := measure(ctx, job, edge, direct, floor)
	if err != nil {
		return err
	}
	return json.NewEncoder(os.Stdout).Encode(res)
}

// measureApart runs job in a child process of this same binary.
func measureApart(ctx context.Context, job clientJob) (clientResult, error) {
	var res clientResult
	self, err := os.Executable()
	if err != nil {
		return res, fmt.Errorf("this binary's path: %w", err)
	}
	arg, err := json.Marshal(job)
	if err != nil {
		return res, fmt.Errorf("the client's job: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, self, "-client-job", string(arg))
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return res, fmt.Errorf("the measuring client process: %w", err)
	}
	if err := json.Unmarshal(out, &res); err != nil {
		return res, fmt.Errorf("the measuring client's result: %w", err)
	}
	if len(res.Get) != 3 || len(res.Download) != 3 || len(res.Upload) != 3 {
		return res, errors.New("the measuring client's result lacks a path")
	}
	return res, nil
}
