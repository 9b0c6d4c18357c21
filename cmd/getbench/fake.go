package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/lightspeed-dev/incus-provider/internal/fakeincus"
	"github.com/lightspeed-dev/incus-provider/targets"
)

// runFake serves n stopped targets over socket (internal/fakeincus) until
// the parent ends it.
func runFake(socket string, n int) error {
	if socket == "" {
		return fmt.Errorf("-serve-fake needs -socket")
	}
	created := time.Now().Add(-time.Hour).UTC()
	list := make([]json.RawMessage, n)
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
		raw, err := fakeincus.Instance(name, false, config, created)
		if err != nil {
			return err
		}
		list[i] = raw
	}
	srv, err := fakeincus.Serve(socket, list)
	if err != nil {
		return err
	}
	done := make(chan struct{})
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-stop
		_ = srv.Close()
		close(done)
	}()
	// The parent kills this process when its row is done; a parent that
	// died leaves this one's stdin closed, which ends it as well.
	go func() {
		var b [1]byte
		_, _ = os.Stdin.Read(b[:])
		select {
		case stop <- syscall.SIGTERM:
		default: // a signal is already there
		}
	}()
	<-done
	return nil
}
