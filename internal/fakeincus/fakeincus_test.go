package fakeincus_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/fakeincus"
)

// The fake answers our own client as Incus would: the listing, each
// instance, no operations, 404 for the rest, and an event stream that
// stays open until the fake closes.
func TestServesWhatTheClientReads(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "incus.sock")
	var list []json.RawMessage
	for i := range 3 {
		list = append(list, json.RawMessage(fmt.Sprintf(
			`{"name":"ls-%d","type":"container","status":"Stopped","status_code":102,"config":{"user.n":"%d"}}`, i, i)))
	}
	running, err := fakeincus.Instance("ls-running", true, map[string]string{"user.n": "r"}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	list = append(list, running)
	srv, err := fakeincus.Serve(socket, list)
	if err != nil {
		t.Fatal(err)
	}
	client, err := incus.New(incus.Config{Socket: socket, CallTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	got, err := client.ListInstances(t.Context())
	if err != nil || len(got) != 4 || got[2].Name != "ls-2" {
		t.Fatalf("list: %+v %v", got, err)
	}
	if srv.ListBytes == 0 {
		t.Error("ListBytes is 0")
	}
	one, etag, err := client.GetInstance(t.Context(), "ls-1")
	if err != nil || one.Config["user.n"] != "1" || etag == "" {
		t.Fatalf("get: %+v %q %v", one, etag, err)
	}
	if r, _, err := client.GetInstance(t.Context(), "ls-running"); err != nil || r.Status != incus.InstanceRunning || r.Config["user.n"] != "r" {
		t.Fatalf("get of the running instance: %+v %v", r, err)
	}
	if _, _, err := client.GetInstance(t.Context(), "ls-9"); !errors.Is(err, incus.ErrNotFound) {
		t.Fatalf("get of no instance: %v, want not found", err)
	}
	if ops, err := client.ListOperations(t.Context()); err != nil || len(ops) != 0 {
		t.Fatalf("operations: %+v %v", ops, err)
	}
	stream, err := client.ListenEvents(t.Context(), "lifecycle")
	if err != nil {
		t.Fatal(err)
	}
	next := make(chan error, 1)
	go func() { _, err := stream.Next(); next <- err }()
	select {
	case err := <-next:
		t.Fatalf("the quiet stream delivered or ended: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	if err := srv.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-next:
		if err == nil {
			t.Fatal("an event after Close")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close left the event stream open")
	}
}
