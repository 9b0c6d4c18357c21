// Package fakeincus serves a fixed set of instances over a unix socket, in
// the shapes Incus 6.0 gives them, for the benchmarks that measure the
// provider at a scale the real Incus on one machine cannot hold (10,000
// targets). It answers only reads:
//
//   - GET /1.0/instances?recursion=1: every instance;
//   - GET /1.0/instances/{name}: one, with an ETag;
//   - GET /1.0/operations: none under way;
//   - GET /1.0/events: a stream that stays open and quiet, as Incus's does
//     while nothing changes, so the provider's observation cache confirms;
//
// and 404 with an Incus error body to anything else. The instances never
// change, so a benchmark measures the provider's steady cost.
package fakeincus

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/gorilla/websocket"
)

// Instance is a container named name, running or stopped, in the shape and
// the size Incus 6.0.4 gives one of the provider's targets: config (its own,
// and again as the expanded config) is the caller's keys plus the image.*
// and volatile.* keys Incus keeps on a container made from the dev guest
// image, with values of their real lengths (the idmaps are JSON arrays);
// devices are the guest daemon's proxy device. created is its creation time.
func Instance(name string, running bool, config map[string]string, created time.Time) (json.RawMessage, error) {
	status, code := "Stopped", 102
	if running {
		status, code = "Running", 103
	}
	full := incusKeys(name)
	for k, v := range config {
		full[k] = v
	}
	devices := map[string]any{"lightspeed-daemon": map[string]string{"type": "proxy", "bind": "host",
		"listen": "unix:/run/incus-provider/guests/" + name + ".sock", "connect": "tcp:127.0.0.1:7000",
		"mode": "0600"}}
	raw, err := json.Marshal(map[string]any{
		"name": name, "type": "container", "status": status, "status_code": code, "description": "",
		"architecture": "x86_64", "config": full, "devices": devices, "profiles": []string{"default"},
		"stateful": false, "ephemeral": false, "location": "none", "project": "default",
		"created_at": created, "last_used_at": created.Add(time.Second),
		"expanded_config":  full,
		"expanded_devices": map[string]any{"root": map[string]string{"path": "/", "pool": "default", "type": "disk"}},
	})
	if err != nil {
		return nil, fmt.Errorf("fakeincus: encode instance %s: %w", name, err)
	}
	return raw, nil
}

// incusKeys are the keys Incus 6.0.4 itself keeps on a container of the dev
// guest image (read off one on 2026-12-02), with values of the same
// lengths, distinct per instance where Incus's are.
func incusKeys(name string) map[string]string {
	id := func(salt string) string { // a UUID's length, distinct per instance
		h := fmt.Sprintf("%x", sha256.Sum256([]byte(salt+name)))
		return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
	}
	const idmap = `[{"Isuid":true,"Isgid":false,"Hostid":1000000,"Nsid":0,"Maprange":1000000000},{"Isuid":false,"Isgid":true,"Hostid":1000000,"Nsid":0,"Maprange":1000000000}]`
	const image = "0d2ea4c1b5a05d1b3e1c7a1f8a4e6f3b2c9d8e7f6a5b4c3d2e1f0a9b8c7d6e5f"
	return map[string]string{
		"image.description":               "Lightspeed development guest (busybox and lsenvd-dev)",
		"image.lightspeed.content_hash":   image,
		"image.os":                        "Debian",
		"image.release":                   "bookwo",
		"volatile.base_image":             image,
		"volatile.cloud-init.instance-id": id("ci"),
		"volatile.idmap.base":             "0",
		"volatile.idmap.current":          idmap,
		"volatile.idmap.next":             idmap,
		"volatile.last_state.idmap":       "[]",
		"volatile.last_state.power":       "RUNNING",
		"volatile.uuid":                   id("uuid"),
		"volatile.uuid.generation":        id("gen"),
	}
}

// Server is a running fake.
type Server struct {
	srv *http.Server
	// ListBytes is the size of the full listing's body: what the provider
	// decodes at each list.
	ListBytes int

	mu      sync.Mutex
	streams map[*websocket.Conn]bool
}

// Serve listens on socket and serves instances (each an Incus instance
// object, as JSON) until Close.
func Serve(socket string, instances []json.RawMessage) (*Server, error) {
	one := make(map[string][]byte, len(instances))
	for i, raw := range instances {
		var id struct {
			Name string `json:"name"`
		}
		if err := json.Unmarshal(raw, &id); err != nil || id.Name == "" {
			return nil, fmt.Errorf("fakeincus: instance %d has no name", i)
		}
		one[id.Name] = envelope(raw)
	}
	all, err := json.Marshal(instances)
	if err != nil {
		return nil, fmt.Errorf("fakeincus: encode the listing: %w", err)
	}
	list := envelope(all)
	s := &Server{ListBytes: len(list), streams: map[*websocket.Conn]bool{}}
	up := websocket.Upgrader{}
	s.srv = &http.Server{ReadHeaderTimeout: 10 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		switch {
		case r.Method != http.MethodGet:
		case r.URL.Path == "/1.0/events":
			conn, err := up.Upgrade(w, r, nil)
			if err != nil {
				return
			}
			s.follow(conn)
			return
		case r.URL.Path == "/1.0/instances" && r.URL.Query().Get("recursion") == "1":
			_, _ = w.Write(list)
			return
		case strings.HasPrefix(r.URL.Path, "/1.0/instances/"):
			if body, ok := one[strings.TrimPrefix(r.URL.Path, "/1.0/instances/")]; ok {
				w.Header().Set("ETag", `"fake"`)
				_, _ = w.Write(body)
				return
			}
		case r.URL.Path == "/1.0/operations":
			_, _ = w.Write(envelope([]byte(`{}`)))
			return
		}
		w.WriteHeader(http.StatusNotFound)
		_, _ = w.Write([]byte(`{"type":"error","status":"","status_code":0,"operation":"","error_code":404,"error":"Not Found","metadata":null}`))
	})}
	var lc net.ListenConfig
	ln, err := lc.Listen(context.Background(), "unix", socket)
	if err != nil {
		return nil, fmt.Errorf("fakeincus: %w", err)
	}
	go func() { _ = s.srv.Serve(ln) }()
	return s, nil
}

// follow holds an event stream open until its client goes or the server
// closes; reading answers the client's pings.
func (s *Server) follow(conn *websocket.Conn) {
	s.mu.Lock()
	if s.streams == nil {
		s.mu.Unlock()
		_ = conn.Close()
		return
	}
	s.streams[conn] = true
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.streams, conn)
		s.mu.Unlock()
		_ = conn.Close()
	}()
	for {
		if _, _, err := conn.NextReader(); err != nil {
			return
		}
	}
}

// Close stops serving and ends every event stream (http.Server.Close does
// not reach a hijacked connection).
func (s *Server) Close() error {
	err := s.srv.Close()
	s.mu.Lock()
	streams := s.streams
	s.streams = nil
	s.mu.Unlock()
	for conn := range streams {
		_ = conn.Close()
	}
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

func envelope(metadata []byte) []byte {
	var b bytes.Buffer
	b.WriteString(`{"type":"sync","status":"Success","status_code":200,"operation":"","error_code":0,"error":"","metadata":`)
	b.Write(metadata)
	b.WriteString("}")
	return b.Bytes()
}
