package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/targets"
)

// runFake serves n stopped targets over socket until the parent ends it:
// the list (GET /1.0/instances?recursion=1), each instance
// (GET /1.0/instances/{name}) and an event stream with no events
// (GET /1.0/events), in the shapes Incus 6.0 gives them.
func runFake(socket string, n int) error {
	if socket == "" {
		return fmt.Errorf("-serve-fake needs -socket")
	}
	created := time.Now().Add(-time.Hour).UTC()
	list := make([]json.RawMessage, n)
	one := make(map[string][]byte, n)
	for i := range n {
		name := targets.Name(fakeOwner(i))
		config := targetConfig(i)
		for k, v := range map[string]string{
			"image.architecture": "x86_64", "image.os": "busybox", "volatile.base_image": benchImage,
			"volatile.last_state.power": "STOPPED", "volatile.uuid": fmt.Sprintf("8f0c1e7e-2b7a-4a43-9c55-%012d", i),
			"volatile.idmap.base": "0", "volatile.last_state.idmap": "[]",
		} {
			config[k] = v
		}
		raw, err := json.Marshal(map[string]any{
			"name": name, "type": "container", "status": "Stopped", "status_code": 102, "description": "",
			"architecture": "x86_64", "config": config, "devices": map[string]any{}, "profiles": []string{},
			"stateful": false, "ephemeral": false, "location": "none", "project": "default",
			"created_at": created, "last_used_at": created, "expanded_config": config,
			"expanded_devices": map[string]any{},
		})
		if err != nil {
			return err
		}
		list[i] = raw
		one[name] = envelope(raw)
	}
	all, err := json.Marshal(list)
	if err != nil {
		return err
	}
	listBody := envelope(all)
	up := websocket.Upgrader{}
	var lc net.ListenConfig
	ln, err := lc.Listen(context.Background(), "unix", socket)
	if err != nil {
		return err
	}
	srv := &http.Server{ReadHeaderTimeout: 10 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		switch {
		case r.Method == http.MethodGet && r.URL.Path == "/1.0/events":
			conn, err := up.Upgrade(w, r, nil)
			if err != nil {
				return
			}
			// Reading answers the client's pings; no event is ever sent.
			for {
				if _, _, err := conn.NextReader(); err != nil {
					_ = conn.Close()
					return
				}
			}
		case r.Method == http.MethodGet && r.URL.Path == "/1.0/instances" && r.URL.Query().Get("recursion") == "1":
			_, _ = w.Write(listBody)
			return
		case r.Method == http.MethodGet && strings.HasPrefix(r.URL.Path, "/1.0/instances/"):
			if body, ok := one[strings.TrimPrefix(r.URL.Path, "/1.0/instances/")]; ok {
				w.Header().Set("ETag", `"fake"`)
				_, _ = w.Write(body)
				return
			}
		case r.Method == http.MethodGet && r.URL.Path == "/1.0/operations":
			_, _ = w.Write(envelope([]byte(`{}`)))
			return
		}
		w.WriteHeader(http.StatusNotFound)
		_, _ = w.Write([]byte(`{"type":"error","status":"","status_code":0,"operation":"","error_code":404,"error":"Not Found","metadata":null}`))
	})}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-stop
		_ = srv.Close()
	}()
	// The parent kills this process when its row is done; a parent that
	// died leaves this one's stdin closed, which ends it as well.
	go func() {
		var b [1]byte
		_, _ = os.Stdin.Read(b[:])
		_ = srv.Close()
	}()
	if err := srv.Serve(ln); err != nil && err != http.ErrServerClosed {
		return err
	}
	return nil
}

func envelope(metadata []byte) []byte {
	var b bytes.Buffer
	b.WriteString(`{"type":"sync","status":"Success","status_code":200,"operation":"","error_code":0,"error":"","metadata":`)
	b.Write(metadata)
	b.WriteString("}")
	return b.Bytes()
}
