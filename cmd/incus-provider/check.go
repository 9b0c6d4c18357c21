package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/lightspeed-dev/incus-provider/incus"
)

// checkBudget bounds the whole of `incus-provider check`: every Incus call
// it makes shares it, so a hung Incus is reported, never waited on.
const checkBudget = 30 * time.Second

// checkNeverMatches is the ETag of the conditional write that tests the
// right to edit the project: Incus checks the caller's rights before the
// ETag, so this write is refused either way and never applied (a real
// ETag is a hex digest; this cannot be one).
const checkNeverMatches = "incus-provider-check: never an ETag"

// checker is one run of `incus-provider check`: what it found, line by
// line on out, and the worst exit status so far.
type checker struct {
	out  io.Writer
	code int
}

func (k *checker) ok(format string, a ...any) {
	_, _ = fmt.Fprintf(k.out, "ok      "+format+"\n", a...)
}

// fail reports a problem: a setting's (exit 2) or the environment's (1).
func (k *checker) fail(err error) {
	code := exitCode(err)
	_, _ = fmt.Fprintf(k.out, "FAILED  %s\n", err)
	if code == exitBadSetting || k.code == 0 {
		k.code = code
	}
}

func (k *checker) skip(format string, a ...any) {
	_, _ = fmt.Fprintf(k.out, "skipped "+format+"\n", a...)
}

// runCheck validates a configuration without serving: every setting, the
// files they name, Incus reachable with the rights the provider needs in
// its project, the templates and their images, the guest dialer, and the
// listeners' addresses free. It changes nothing in Incus. It answers 0
// when all of it holds, 2 when a setting is refused, else 1.
func runCheck(ctx context.Context, environ []string, out io.Writer) int {
	k := &checker{out: out}
	cfg, err := loadConfig(environ)
	if err != nil {
		printRefusals(out, "FAILED  ", err)
		k.code = exitBadSetting
		k.skip("Incus, the templates and the listeners: the settings come first")
		return k.code
	}
	k.ok("settings: %s", settingsSummary(cfg))
	ctx, cancel := context.WithTimeout(ctx, checkBudget)
	defer cancel()
	k.checkIncus(ctx, cfg)
	k.checkListeners(ctx, cfg)
	if k.code == 0 {
		_, _ = fmt.Fprintln(out, "the configuration holds: incus-provider would serve with it")
	}
	return k.code
}

// settingsSummary says what the settings amount to, the way an operator
// would want them read back.
func settingsSummary(cfg config) string {
	scheme := "ws"
	if cfg.TLSCert != "" {
		scheme = "wss"
	}
	if strings.HasPrefix(cfg.Listen, "unix:") {
		scheme = "unix"
	}
	parts := []string{"controller " + controlURL(cfg, scheme)}
	if base := routeBaseURL(cfg, scheme); base != "" {
		parts = append(parts, "data route base "+base)
	}
	if cfg.CredentialFile != "" {
		parts = append(parts, "credential required")
	} else {
		parts = append(parts, "no credential (loopback or unix only, or PROVIDER_ALLOW_NO_CREDENTIAL=yes)")
	}
	if cfg.ingressBase != nil {
		parts = append(parts, "public ingress "+cfg.ingressBase.String())
	} else {
		parts = append(parts, "public ingress off")
	}
	parts = append(parts, "Incus project "+cfg.IncusProject+" via "+incusWhere(cfg))
	return strings.Join(parts, "; ")
}

// checkIncus asks Incus what a start would: the server, the project, the
// rights in it, the templates' images and placement, and whether the
// guest dialer can work from here.
func (k *checker) checkIncus(ctx context.Context, cfg config) {
	client, err := incus.New(cfg.incusConfig())
	if err != nil {
		k.fail(badSetting(fmt.Errorf("incus client (%s): %w", incusWhere(cfg), err)))
		return
	}
	server, err := client.GetServer(ctx)
	if err != nil {
		k.fail(fmt.Errorf("incus is not reachable (%s): %w", incusWhere(cfg), err))
		k.skip("the project, the templates and the guest dialer: they need Incus")
		return
	}
	if server.Auth != "trusted" {
		k.fail(badSetting(fmt.Errorf("incus (%s) answers, but does not trust this client (auth %q); add its certificate to Incus's trust store", incusWhere(cfg), server.Auth)))
		return
	}
	where := "standalone"
	if server.Environment.ServerClustered {
		where = "cluster member " + server.Environment.ServerName
	}
	k.ok("incus: %s answers: %s %s (%s), %s", incusWhere(cfg), server.Environment.Server, server.Environment.ServerVersion, server.Environment.Storage, where)
	if err := checkProject(ctx, client, cfg); err != nil {
		k.fail(err)
		k.skip("the rights in the project and the templates: they need the project")
		return
	}
	k.checkRights(ctx, client, cfg)
	if catalog, err := loadCatalog(ctx, cfg, client, server); err != nil {
		k.fail(fmt.Errorf("PROVIDER_TEMPLATES=%q: %w", cfg.Templates, err))
	} else {
		var ts []string
		for _, t := range catalog.All() {
			image := t.Fingerprint
			if len(image) > 12 {
				image = image[:12]
			}
			if t.ImageAlias != "" {
				image = t.ImageAlias + " = " + image
			}
			ts = append(ts, warmWords(t.Wire.TemplateID, image, t.Warm, t.WarmMax))
		}
		k.ok("templates: %d from %s, every image present: %s", len(ts), cfg.Templates, strings.Join(ts, ", "))
	}
	kind, member := guestDialerFor(cfg, server)
	if err := checkSeesIncus(cfg, server, kind); err != nil {
		k.fail(err)
	} else {
		k.ok("guest dialer: %s%s", kind, map[bool]string{true: " (member " + member + ")", false: ""}[member != ""])
	}
}

// checkRights reads the project's instances (every pass does) and tests
// the right to edit the project (where requests are kept across restarts)
// with a write Incus refuses on its ETag, after its rights check.
func (k *checker) checkRights(ctx context.Context, client *incus.Client, cfg config) {
	list, err := client.ListInstances(ctx)
	if err != nil {
		k.fail(rightsError(cfg, "list its instances", err))
		return
	}
	p, err := client.GetProject(ctx, cfg.IncusProject)
	if err != nil {
		k.fail(rightsError(cfg, "read it", err))
		return
	}
	err = client.UpdateProjectIf(ctx, cfg.IncusProject, p.Description, p.Config, checkNeverMatches)
	switch {
	case errors.Is(err, incus.ErrPreconditionFailed):
		k.ok("project %s: %d instances readable; its config writable (a write conditional on an ETag that never matches was refused on the ETag alone)", cfg.IncusProject, len(list))
	case err == nil:
		// Not reachable with a real Incus; said rather than passed over.
		k.fail(fmt.Errorf("INCUS_PROJECT=%q: Incus applied a write whose ETag cannot match; it does not check ETags, and the provider relies on them", cfg.IncusProject))
	default:
		k.fail(rightsError(cfg, "edit its config (where requests are kept across restarts)", err))
	}
}

func rightsError(cfg config, what string, err error) error {
	var ie *incus.Error
	if errors.As(err, &ie) && (ie.Status == http.StatusForbidden || ie.Status == http.StatusUnauthorized) {
		return fmt.Errorf("INCUS_PROJECT=%q: this client may not %s (%s): %w; give its certificate that right in Incus", cfg.IncusProject, what, incusWhere(cfg), err)
	}
	return unlessRetryable(fmt.Errorf("INCUS_PROJECT=%q: could not %s (%s): %w", cfg.IncusProject, what, incusWhere(cfg), err))
}

// checkListeners binds each address the provider would listen on, and
// lets it go at once: in use is the environment's (another process, maybe
// a running provider); an address this host cannot have is the setting's.
func (k *checker) checkListeners(ctx context.Context, cfg config) {
	for _, l := range []struct{ name, addr string }{
		{"PROVIDER_LISTEN", cfg.Listen}, {"PROVIDER_ROUTE_LISTEN", cfg.RouteListen},
		{"PROVIDER_METRICS_LISTEN", cfg.MetricsListen}, {"PROVIDER_INGRESS_LISTEN", cfg.IngressListen},
		{"PROVIDER_PEER_LISTEN", cfg.PeerListen},
	} {
		if l.addr == "" || l.addr == "off" {
			continue
		}
		if err := tryListen(ctx, l.addr); err != nil {
			k.fail(bindError(fmt.Errorf("%s=%q cannot be bound: %w", l.name, l.addr, err)))
			continue
		}
		k.ok("%s=%s: free", l.name, l.addr)
	}
}

// tryListen binds addr and closes it. A unix socket path is free when no
// process answers on it (a stale file from an earlier run is what a start
// removes) and its directory is there.
func tryListen(ctx context.Context, addr string) error {
	if path, ok := strings.CutPrefix(addr, "unix:"); ok {
		if fi, err := os.Stat(filepath.Dir(path)); err != nil || !fi.IsDir() {
			return fmt.Errorf("its directory %s is not there: %w", filepath.Dir(path), fs.ErrNotExist)
		}
		d := net.Dialer{Timeout: time.Second}
		if c, err := d.DialContext(ctx, "unix", path); err == nil {
			_ = c.Close()
			return fmt.Errorf("a process answers on it: %w", syscall.EADDRINUSE)
		}
		return nil
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	return ln.Close()
}

// warmWords is a template as check prints it: its image and its pool.
func warmWords(id, image string, warm, warmMax int) string {
	if warmMax > warm {
		return fmt.Sprintf("%s (image %s, warm %d to %d)", id, image, warm, warmMax)
	}
	return fmt.Sprintf("%s (image %s, warm %d)", id, image, warm)
}
