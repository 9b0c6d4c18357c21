// Command lsenvd-dev is a development stand-in for lightspeed-envd: a small
// guest daemon that serves the environment protocol's data plane (version 5)
// over WebSocket JSON-RPC at path "/", so the provider runs end to end on one
// machine with no internet. It implements initialize, env/getIdle,
// $/cancelRequest, the whole fs/* family (read, write, createDirectory,
// getMetadata, readDirectory, remove, rename, searchText, globFiles, scan)
// and process/start, read, write and terminate, advertises exactly that, and
// nothing else; see package internal/devguest.
//
// Usage:
//
//	lsenvd-dev [--listen 127.0.0.1:19091] [--web 127.0.0.1:8080] [--cwd /root]
//
// --web serves the dev web app behind public ingress (devguest.WebApp; off
// serves none). It listens before the daemon does, so a daemon that answers
// means the app answers too. Flags fall back to the environment variables
// LSENVD_DEV_LISTEN, LSENVD_DEV_WEB and LSENVD_DEV_CWD. The default cwd is /root when it is a directory, else /.
// SIGTERM, SIGINT and SIGPWR stop it gracefully: connections get a
// going-away close frame, and running process groups get SIGTERM, then
// SIGKILL after 300 ms. Exit status: 0 after such a stop, 1 on a failure
// while serving, 2 for a configuration error.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/internal/devguest"
)

// version is serverInfo.version; release builds may set it with -ldflags "-X main.version=…".
var version = "0.1.0-dev"

func main() {
	os.Exit(run())
}

func defaultCwd() string {
	if v := os.Getenv("LSENVD_DEV_CWD"); v != "" {
		return v
	}
	if fi, err := os.Stat("/root"); err == nil && fi.IsDir() {
		return "/root"
	}
	return "/"
}

func run() int {
	logger := log.New(os.Stderr, "lsenvd-dev: ", log.LstdFlags|log.Lmsgprefix)
	listen := os.Getenv("LSENVD_DEV_LISTEN")
	if listen == "" {
		listen = net.JoinHostPort("127.0.0.1", strconv.Itoa(guest.DefaultPort))
	}
	fl := flag.NewFlagSet("lsenvd-dev", flag.ContinueOnError)
	fl.StringVar(&listen, "listen", listen, "TCP address to serve the data plane on (env LSENVD_DEV_LISTEN)")
	web := os.Getenv("LSENVD_DEV_WEB")
	if web == "" {
		web = net.JoinHostPort("127.0.0.1", strconv.Itoa(devguest.DefaultWebPort))
	}
	fl.StringVar(&web, "web", web, "TCP address to serve the dev web app on, or off (env LSENVD_DEV_WEB)")
	cwd := fl.String("cwd", defaultCwd(), "default cwd of commands, an absolute directory (env LSENVD_DEV_CWD)")
	if err := fl.Parse(os.Args[1:]); err != nil {
		return 2
	}
	if fl.NArg() > 0 {
		logger.Printf("unexpected argument %q; the flags are --listen, --web and --cwd", fl.Arg(0))
		return 2
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT, syscall.SIGPWR)
	defer stop()

	if err := os.Chdir(*cwd); err != nil {
		logger.Printf("cannot use %q as the default cwd: %v", *cwd, err)
		return 2
	}
	d, err := devguest.New(ctx, devguest.Config{Cwd: *cwd, Version: version, Logf: logger.Printf})
	if err != nil {
		logger.Print(err)
		return 2
	}
	var lc net.ListenConfig
	var webSrv *http.Server
	webServed := make(chan error, 1)
	if web != "off" {
		wln, err := lc.Listen(ctx, "tcp", web)
		if err != nil {
			logger.Printf("cannot listen on %s for the web app: %v", web, err)
			return 2
		}
		webSrv = &http.Server{Handler: devguest.WebApp(), ReadHeaderTimeout: 10 * time.Second}
		go func() { webServed <- webSrv.Serve(wln) }()
		logger.Printf("serving the web app on http://%s/", wln.Addr())
	}
	ln, err := lc.Listen(ctx, "tcp", listen)
	if err != nil {
		logger.Printf("cannot listen on %s: %v", listen, err)
		return 2
	}
	srv := &http.Server{Handler: d, ReadHeaderTimeout: 10 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	logger.Printf("serving data plane v%d on ws://%s/ (daemonInstanceId %s, cwd %s)", devguest.ProtocolVersion, ln.Addr(), d.InstanceID(), *cwd)

	select {
	case err := <-served:
		logger.Printf("serving stopped: %v", err)
		return 1
	case err := <-webServed:
		logger.Printf("serving the web app stopped: %v", err)
		return 1
	case <-ctx.Done():
	}
	logger.Print("stopping")
	shutdownCtx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = srv.Shutdown(shutdownCtx) // closes the listener; upgraded connections are the daemon's
	if webSrv != nil {
		_ = webSrv.Close() // streams and echoes end with the guest
	}
	if err := d.Shutdown(shutdownCtx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		logger.Printf("shutdown: %v", err)
	}
	fmt.Fprintln(os.Stderr, "lsenvd-dev: stopped")
	return 0
}
