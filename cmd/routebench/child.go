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
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/bearer"
	"github.com/lightspeed-dev/incus-provider/provider"
	"github.com/lightspeed-dev/incus-provider/templates"
)

// The provider under test runs in a child process of its own, wired as
// cmd/incus-provider wires it (controller plane, data routes, the relay
// registry connected to the targets), so that its memory can be measured
// apart from the benchmark's clients. It listens on 127.0.0.1 only, prints
// "ADDR host:port" when it serves, and exits when its stdin closes.

const childEnv = "ROUTEBENCH_CHILD"

// memReport is what /bench/mem answers: the process's resident set after a
// full collection, and the Go runtime's view of it.
type memReport struct {
	RSSBytes       uint64 `json:"rssBytes"`
	HeapInuseBytes uint64 `json:"heapInuseBytes"`
	StackBytes     uint64 `json:"stackBytes"`
	Goroutines     int    `json:"goroutines"`
	Relays         int    `json:"relays"`
}

func runChild() error {
	// Ctrl-C reaches the whole process group: the parent cleans up through
	// this process, which ends when the parent closes its stdin.
	signal.Ignore(os.Interrupt)
	project := os.Getenv("ROUTEBENCH_PROJECT")
	credential := os.Getenv("ROUTEBENCH_CREDENTIAL")
	// On a cluster, as cmd/incus-provider is deployed there: every member's
	// URL, the cluster certificate pinned, and the member dialer of the
	// member this provider is taken to run on.
	icfg := incus.Config{Socket: os.Getenv("ROUTEBENCH_INCUS_SOCKET"), Project: project}
	member := os.Getenv("ROUTEBENCH_MEMBER")
	if urls := os.Getenv("ROUTEBENCH_INCUS_URLS"); urls != "" {
		icfg = incus.Config{URLs: strings.Split(urls, ","), ClientCert: os.Getenv("ROUTEBENCH_INCUS_CLIENT_CERT"),
			ClientKey: os.Getenv("ROUTEBENCH_INCUS_CLIENT_KEY"), ServerCert: os.Getenv("ROUTEBENCH_INCUS_SERVER_CERT"), Project: project}
	}
	client, err := incus.New(icfg)
	if err != nil {
		return err
	}
	catalog, err := templates.Load(os.Getenv("ROUTEBENCH_TEMPLATES"))
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _, _ = io.Copy(io.Discard, os.Stdin); cancel() }() // the parent is gone

	rctx, rcancel := context.WithTimeout(ctx, 30*time.Second)
	defer rcancel()
	if err := catalog.Resolve(rctx, client); err != nil {
		return err
	}
	kind := guest.KindNetns
	if member != "" {
		kind = guest.KindMember
		if err := catalog.CheckPlacement(rctx, true, client); err != nil {
			return err
		}
	}
	var peers map[string]string
	var secret []byte
	if path := os.Getenv("ROUTEBENCH_PEER_SECRET"); path != "" {
		if secret, err = os.ReadFile(path); err != nil {
			return err
		}
	}
	if p := os.Getenv("ROUTEBENCH_PEERS"); p != "" {
		m, a, _ := strings.Cut(p, "=")
		peers = map[string]string{m: a}
	}
	inner, err := guest.New(kind, guest.Options{Lookup: client.InitPID, Member: member, Located: client.LocatedInitPID,
		Peers: peers, PeerSecret: secret,
		Exec: func(ctx context.Context, instance string, argv []string) (net.Conn, error) {
			return client.ExecStream(ctx, instance, argv)
		}})
	if err != nil {
		return err
	}
	if addr := os.Getenv("ROUTEBENCH_PEER_LISTEN"); addr != "" {
		// The replica on the remote member: serves its guests to the other.
		fs, err := guest.NewForwardServer(guest.ForwardServerOptions{Member: member, Secret: secret,
			Local: guest.NewNetns(guest.OnMember(member, client.LocatedInitPID))})
		if err != nil {
			return err
		}
		var lc net.ListenConfig
		pln, err := lc.Listen(ctx, "tcp", addr)
		if err != nil {
			return err
		}
		go func() { _ = fs.Serve(ctx, pln) }()
	}
	cred := bearer.New(credential)
	mux := http.NewServeMux()
	// On a cluster the benchmark asks how each wake dialled; the single-host
	// run keeps the bare dialer, so its memory figures carry no trace.
	dialer := inner
	if member != "" {
		traced := &tracingDialer{Dialer: inner}
		dialer = traced
		mux.Handle("/bench/dials", cred.Require(traced, nil))
	}
	log := zap.NewNop()
	if os.Getenv("ROUTEBENCH_DEBUG") != "" {
		log, _ = zap.NewDevelopment()
	}
	// Every wake's trace, so that the benchmark can divide its time: the
	// hook runs only for wakes, which the memory figures do not include.
	wakes := &wakeTraces{}
	mux.Handle("/bench/wakes", cred.Require(wakes, nil))
	prov, err := provider.New(ctx, provider.Config{Incus: client, Catalog: catalog, Dialer: dialer, Credential: cred,
		Log: log, GracefulStop: 5 * time.Second, MaxInFlight: 64, WakeTrace: wakes.record})
	if err != nil {
		return err
	}
	go func() { _ = prov.Run(ctx) }()

	mux.Handle("/", prov.Handler())
	// A load balancer's health check (-lb): the child serves once it is here.
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok\n") })
	mux.Handle("/bench/mem", cred.Require(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		runtime.GC()
		debug.FreeOSMemory()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		rss, err := residentBytes()
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		_ = json.NewEncoder(w).Encode(memReport{RSSBytes: rss, HeapInuseBytes: ms.HeapInuse, StackBytes: ms.StackInuse,
			Goroutines: runtime.NumGoroutine(), Relays: prov.Relays.Relays()})
	}), nil))
	// The floor: a plain byte pipe from a loopback port to the daemon,
	// through the same GuestDialer, reading nothing. What the relay adds over
	// it is what reading frame headers costs; what it adds over a direct
	// connection is mostly the extra hop itself.
	mux.Handle("/bench/pipe", cred.Require(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		t := guest.Target{Instance: r.URL.Query().Get("instance"), Port: guest.DefaultPort, Location: r.URL.Query().Get("location")}
		var lc net.ListenConfig
		pl, err := lc.Listen(ctx, "tcp", "127.0.0.1:0")
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		context.AfterFunc(ctx, func() { _ = pl.Close() })
		go func() {
			for {
				c, err := pl.Accept()
				if err != nil {
					return
				}
				go func() {
					g, err := dialer.DialContext(ctx, t)
					if err != nil {
						_ = c.Close()
						return
					}
					go func() { _, _ = io.Copy(g, c); _ = g.Close() }()
					_, _ = io.Copy(c, g)
					_ = c.Close()
				}()
			}
		}()
		_, _ = io.WriteString(w, pl.Addr().String())
	}), nil))
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { <-ctx.Done(); _ = srv.Close() }()
	fmt.Printf("ADDR %s\n", ln.Addr())
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// residentBytes reads VmRSS from /proc/self/status.
func residentBytes() (uint64, error) {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0, err
	}
	defer func() { _ = f.Close() }()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			fields := strings.Fields(rest)
			if len(fields) == 2 && fields[1] == "kB" {
				kb, err := strconv.ParseUint(fields[0], 10, 64)
				return kb << 10, err
			}
		}
	}
	return 0, errors.New("no VmRSS in /proc/self/status")
}
