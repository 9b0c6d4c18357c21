// Command lockprobe measures, on a real Incus, the objects that could be an
// owner's lock, the one object whose name derives from the owner and that
// Incus creates at most once: an instance (today's lock, the target
// itself, or an empty instance standing for it), a custom storage volume,
// a profile. For each it prints what a create and a delete cost (median
// and p95 over -n creates one after the other) and whether concurrent
// creates of one name leave exactly one (-rounds rounds of -racers
// creates at once). Given several members' sockets (-sockets), the racers
// of a round are spread over them, as replicas on several members would
// be: that is where a member-local object (a volume on a local pool) can
// exist once per member.
//
// It works in an Incus project of its own, lsprobe-<random> (images from
// the default project, profiles and volumes its own), and removes it and
// everything in it when it ends.
//
// Usage:
//
//	go run ./cmd/lockprobe [-sockets /var/lib/incus/unix.socket] [-pool default] [-n 40] [-rounds 20] [-racers 8]
package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"sort"
	"strings"
	"sync"
	"time"
)

func main() {
	sockets := flag.String("sockets", "/var/lib/incus/unix.socket", "comma-separated Incus unix sockets, one per cluster member")
	pool := flag.String("pool", "default", "the storage pool of the volumes")
	n := flag.Int("n", 40, "creates one after the other, per kind")
	rounds := flag.Int("rounds", 20, "rounds of concurrent creates of one name, per kind")
	racers := flag.Int("racers", 8, "concurrent creates of one name in a round")
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	if err := run(ctx, strings.Split(*sockets, ","), *pool, *n, *rounds, *racers); err != nil {
		fmt.Fprintln(os.Stderr, "lockprobe:", err)
		os.Exit(1)
	}
}

// member is one Incus daemon reached on its unix socket.
type member struct {
	socket string
	http   *http.Client
}

func newMember(socket string) *member {
	return &member{socket: socket, http: &http.Client{Timeout: 60 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", socket)
		},
		MaxIdleConnsPerHost: 64,
	}}}
}

// answer is Incus's response envelope.
type answer struct {
	Type       string          `json:"type"`
	StatusCode int             `json:"status_code"`
	ErrorCode  int             `json:"error_code"`
	Error      string          `json:"error"`
	Operation  string          `json:"operation"`
	Metadata   json.RawMessage `json:"metadata"`
}

// call sends one request and, for an asynchronous one, waits for its
// operation; the error carries Incus's own words and code.
func (m *member) call(ctx context.Context, method, path string, body any) error {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://incus"+path, rd)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := m.http.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var a answer
	if err := json.NewDecoder(resp.Body).Decode(&a); err != nil {
		return fmt.Errorf("%s %s: HTTP %d: %w", method, path, resp.StatusCode, err)
	}
	if a.Type == "error" {
		return &incusError{code: a.ErrorCode, msg: a.Error}
	}
	if a.Type != "async" {
		return nil
	}
	// A wait forwarded to another member has been seen to end with the
	// operation still running: it is asked again, within the deadline.
	for deadline := time.Now().Add(60 * time.Second); ; {
		op, err := m.wait(ctx, a.Operation)
		if err != nil {
			return err
		}
		var meta struct {
			Status string `json:"status"`
			Err    string `json:"err"`
		}
		_ = json.Unmarshal(op.Metadata, &meta)
		switch {
		case op.Type == "error":
			return &incusError{code: op.ErrorCode, msg: op.Error}
		case meta.Status == "Success":
			return nil
		case meta.Status == "Failure" || meta.Status == "Cancelled" || time.Now().After(deadline):
			return &incusError{code: 0, msg: meta.Status + ": " + meta.Err}
		}
	}
}

func (m *member) wait(ctx context.Context, operation string) (answer, error) {
	var op answer
	// The operation's URL carries its project as a query: /wait goes on
	// its path, else Incus answers the operation at once and this polls.
	u, err := url.Parse("http://incus" + operation)
	if err != nil {
		return op, err
	}
	q := u.Query()
	q.Set("timeout", "30")
	u.Path, u.RawQuery = u.Path+"/wait", q.Encode()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return op, err
	}
	resp, err := m.http.Do(req)
	if err != nil {
		return op, err
	}
	defer resp.Body.Close()
	err = json.NewDecoder(resp.Body).Decode(&op)
	return op, err
}

// metadata GETs path and decodes the answer's metadata into v.
func (m *member) metadata(ctx context.Context, path string, v any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://incus"+path, nil)
	if err != nil {
		return err
	}
	resp, err := m.http.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	return json.NewDecoder(resp.Body).Decode(&struct {
		Metadata any `json:"metadata"`
	}{v})
}

// running says an operation of the project is still under way.
func (m *member) running(ctx context.Context, project string) (bool, error) {
	var ops map[string][]string
	err := m.metadata(ctx, "/1.0/operations?project="+url.QueryEscape(project), &ops)
	return len(ops["running"]) > 0, err
}

type incusError struct {
	code int
	msg  string
}

func (e *incusError) Error() string { return fmt.Sprintf("Incus %d: %s", e.code, e.msg) }

// kind is one candidate lock object.
type kind struct {
	name           string
	create, delete func(ctx context.Context, m *member, name string) error
	// collection lists the kind's objects (recursion=1); a member-local
	// one is deleted with its location as the target.
	collection string
	local      bool
}

// object is one listed object: its name and, on a cluster, its member.
type object struct {
	Name     string `json:"name"`
	Location string `json:"location"`
}

// copies lists the objects called name, on every member.
func (k kind) copies(ctx context.Context, m *member, project, name string) ([]object, error) {
	all, err := k.all(ctx, m, project)
	if err != nil {
		return nil, err
	}
	var out []object
	for _, o := range all {
		if o.Name == name {
			out = append(out, o)
		}
	}
	return out, nil
}

// all lists the kind's objects in the project, on every member.
func (k kind) all(ctx context.Context, m *member, project string) ([]object, error) {
	var all []object
	err := m.metadata(ctx, k.collection+"?recursion=1&project="+url.QueryEscape(project), &all)
	return all, err
}

// remove deletes every copy of name.
func (k kind) remove(ctx context.Context, m *member, project, name string) error {
	objs, err := k.copies(ctx, m, project, name)
	if err != nil {
		return err
	}
	for _, o := range objs {
		if err := k.removeOne(ctx, m, project, o); err != nil {
			return err
		}
	}
	return nil
}

// removeOne deletes one object where it is.
func (k kind) removeOne(ctx context.Context, m *member, project string, o object) error {
	target := ""
	if k.local && o.Location != "" && o.Location != "none" {
		target = "&target=" + url.QueryEscape(o.Location)
	}
	return m.call(ctx, http.MethodDelete, k.collection+"/"+o.Name+"?project="+url.QueryEscape(project)+target, nil)
}

func kinds(project, pool string) []kind {
	q := "?project=" + url.QueryEscape(project)
	lock := map[string]string{"user.lightspeed.lock": "warm-0123456789ab-7"}
	return []kind{
		{"instance (empty, source none)",
			func(ctx context.Context, m *member, n string) error {
				return m.call(ctx, http.MethodPost, "/1.0/instances"+q, map[string]any{
					"name": n, "type": "container", "source": map[string]any{"type": "none"}, "config": lock, "profiles": []string{},
					"devices": map[string]any{"root": map[string]string{"type": "disk", "path": "/", "pool": pool}}})
			},
			func(ctx context.Context, m *member, n string) error {
				return m.call(ctx, http.MethodDelete, "/1.0/instances/"+n+q, nil)
			}, "/1.0/instances", false},
		{"custom volume (pool " + pool + ")",
			func(ctx context.Context, m *member, n string) error {
				return m.call(ctx, http.MethodPost, "/1.0/storage-pools/"+pool+"/volumes/custom"+q, map[string]any{
					"name": n, "content_type": "filesystem", "config": lock})
			},
			func(ctx context.Context, m *member, n string) error {
				return m.call(ctx, http.MethodDelete, "/1.0/storage-pools/"+pool+"/volumes/custom/"+n+q, nil)
			}, "/1.0/storage-pools/" + pool + "/volumes/custom", true},
		{"profile",
			func(ctx context.Context, m *member, n string) error {
				return m.call(ctx, http.MethodPost, "/1.0/profiles"+q, map[string]any{"name": n, "config": lock})
			},
			func(ctx context.Context, m *member, n string) error {
				return m.call(ctx, http.MethodDelete, "/1.0/profiles/"+n+q, nil)
			}, "/1.0/profiles", false},
	}
}

func run(ctx context.Context, sockets []string, pool string, n, rounds, racers int) error {
	var members []*member
	for _, s := range sockets {
		members = append(members, newMember(s))
	}
	project := "lsprobe-" + randomHex(4)
	first := members[0]
	if err := first.call(ctx, http.MethodPost, "/1.0/projects", map[string]any{"name": project,
		"config": map[string]string{"features.images": "false", "features.profiles": "true", "features.storage.volumes": "true"}}); err != nil {
		return fmt.Errorf("creating project %s: %w", project, err)
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		removeAll(cctx, first, project, pool)
		if err := first.call(cctx, http.MethodDelete, "/1.0/projects/"+project, nil); err != nil {
			fmt.Fprintf(os.Stderr, "lockprobe: removing project %s: %v\n", project, err)
		}
	}()
	// The claim's other write, for scale: a config PATCH of an existing
	// instance, as a hand-out writes the owner onto a spare.
	kk := kinds(project, pool)
	if err := kk[0].create(ctx, first, "ls-claimed"); err != nil {
		return fmt.Errorf("creating the instance the claim writes are made on: %w", err)
	}
	var patches []time.Duration
	for i := range n {
		began := time.Now()
		if err := first.call(ctx, http.MethodPatch, "/1.0/instances/ls-claimed?project="+url.QueryEscape(project),
			map[string]any{"config": map[string]string{"user.lightspeed.claim": fmt.Sprint(i)}}); err != nil {
			return fmt.Errorf("patching: %w", err)
		}
		patches = append(patches, time.Since(began))
	}
	if err := kk[0].delete(ctx, first, "ls-claimed"); err != nil {
		return err
	}
	fmt.Printf("lockprobe: %d member(s), project %s, %d creates one after the other and %d rounds of %d concurrent creates per kind\n\n",
		len(members), project, n, rounds, racers)
	fmt.Printf("%-32s %12s %12s %12s %12s %s\n", "kind", "create p50", "create p95", "delete p50", "delete p95", "concurrent creates of one name")
	fmt.Printf("%-32s %12s %12s\n", "instance config PATCH (claim)", pct(patches, 50), pct(patches, 95))
	for _, k := range kk {
		var creates, deletes []time.Duration
		for i := range n {
			name := fmt.Sprintf("ls-seq-%s-%d", randomHex(3), i)
			began := time.Now()
			if err := k.create(ctx, members[i%len(members)], name); err != nil {
				return fmt.Errorf("%s: create %s: %w", k.name, name, err)
			}
			creates = append(creates, time.Since(began))
			began = time.Now()
			if err := k.delete(ctx, members[i%len(members)], name); err != nil {
				return fmt.Errorf("%s: delete %s: %w", k.name, name, err)
			}
			deletes = append(deletes, time.Since(began))
		}
		won := map[int]int{} // objects left by a round -> rounds
		answered := map[string]int{}
		var refusals []string
		for r := range rounds {
			name := fmt.Sprintf("ls-race-%s-%d", randomHex(3), r)
			var wg sync.WaitGroup
			errs := make([]error, racers)
			start := make(chan struct{})
			for i := range racers {
				wg.Go(func() {
					<-start
					errs[i] = k.create(ctx, members[i%len(members)], name)
				})
			}
			close(start)
			wg.Wait()
			for _, err := range errs {
				var ie *incusError
				switch {
				case err == nil:
					answered["success"]++
				case errors.As(err, &ie):
					msg := strings.ReplaceAll(strings.ReplaceAll(ie.msg, name, "NAME"), project, "PROJECT")
					refusals = appendOnce(refusals, fmt.Sprintf("%d %s", ie.code, firstWords(msg)))
					answered["refused"]++
				default:
					return fmt.Errorf("%s: a racing create: %w", k.name, err)
				}
			}
			// What counts is what Incus holds afterwards, once no create
			// of the round is under way any more.
			var objs []object
			for deadline := time.Now().Add(30 * time.Second); ; {
				var err error
				if objs, err = k.copies(ctx, first, project, name); err != nil {
					return fmt.Errorf("%s: listing: %w", k.name, err)
				}
				if busy, err := first.running(ctx, project); err != nil || !busy || time.Now().After(deadline) {
					break
				}
				time.Sleep(50 * time.Millisecond)
			}
			won[len(objs)]++
			if err := k.remove(ctx, first, project, name); err != nil {
				return fmt.Errorf("%s: removing %s: %w", k.name, name, err)
			}
		}
		fmt.Printf("%-32s %12s %12s %12s %12s %s (answers: %d successes, %d refusals); refused with: %s\n", k.name, pct(creates, 50), pct(creates, 95), pct(deletes, 50), pct(deletes, 95),
			describe(won, rounds), answered["success"], answered["refused"], strings.Join(refusals, " | "))
	}
	return nil
}

// removeAll deletes what a failed run may have left in the project.
func removeAll(ctx context.Context, m *member, project, pool string) {
	for _, k := range kinds(project, pool) {
		objs, _ := k.all(ctx, m, project)
		for _, o := range objs {
			if k.collection != "/1.0/profiles" || o.Name != "default" {
				_ = k.removeOne(ctx, m, project, o)
			}
		}
	}
}

func describe(won map[int]int, rounds int) string {
	var keys []int
	for k := range won {
		keys = append(keys, k)
	}
	sort.Ints(keys)
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%d left in %d/%d rounds", k, won[k], rounds))
	}
	return strings.Join(parts, ", ")
}

func pct(ds []time.Duration, p int) string {
	if len(ds) == 0 {
		return "-"
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[(len(s)-1)*p/100].Round(100 * time.Microsecond).String()
}

func appendOnce(list []string, s string) []string {
	for _, x := range list {
		if x == s {
			return list
		}
	}
	return append(list, s)
}

func firstWords(s string) string {
	if len(s) > 90 {
		return s[:90] + "…"
	}
	return s
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
