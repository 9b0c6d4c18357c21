// Command lsconform runs the controller-plane conformance suite (package
// conformance) against a provider controller and prints one line per check
// (PASS, FAIL or SKIP, with the reason) and a closing "N passed, N failed"
// line. It exits 1 when any check failed and 2 on a usage error.
//
//	lsconform -url ws://127.0.0.1:8480/control -credential-file /etc/incus-provider/credential
//
// Every flag can also be set by an environment variable (LSCONFORM_URL,
// LSCONFORM_CREDENTIAL_FILE, …; see -help); a flag wins over its variable.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/lightspeed-dev/incus-provider/conformance"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr, conformance.Run)
	stop()
	os.Exit(code)
}

// suiteFunc is conformance.Run, replaced in tests.
type suiteFunc func(context.Context, conformance.Config) []conformance.Result

const (
	exitPassed = 0
	exitFailed = 1
	exitUsage  = 2
)

func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer, suite suiteFunc) int {
	cfg, list, err := parse(args, getenv, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return exitPassed
	}
	if err != nil {
		writeLine(stderr, "lsconform: "+err.Error())
		return exitUsage
	}
	if list {
		for _, name := range conformance.CheckNames() {
			writeLine(stdout, name+"\t"+conformance.CheckRule(name))
		}
		return exitPassed
	}
	results := suite(ctx, cfg)
	failed := false
	for _, r := range results {
		writeLine(stdout, r.String())
		failed = failed || r.Failed()
	}
	writeLine(stdout, conformance.Summary(results))
	if failed {
		return exitFailed
	}
	return exitPassed
}

// writeLine writes one line of the report. A failed write is deliberately
// ignored: the exit code carries the verdict on its own, and with stdout or
// stderr gone there is nowhere left to say so.
func writeLine(w io.Writer, line string) {
	_, _ = fmt.Fprintln(w, line)
}

// parse reads flags over their environment variables into a validated Config.
func parse(args []string, getenv func(string) string, stderr io.Writer) (conformance.Config, bool, error) {
	fs := flag.NewFlagSet("lsconform", flag.ContinueOnError)
	fs.SetOutput(stderr)
	env := func(name, fallback string) string {
		if v := getenv(name); v != "" {
			return v
		}
		return fallback
	}
	var (
		url            = fs.String("url", env("LSCONFORM_URL", ""), "the controller: ws://host:port/path, wss://…, or unix:///socket/path ($LSCONFORM_URL; also the one positional argument)")
		credentialFile = fs.String("credential-file", env("LSCONFORM_CREDENTIAL_FILE", ""), "a file holding the provider's bearer credential ($LSCONFORM_CREDENTIAL_FILE)")
		credential     = fs.String("credential", env("LSCONFORM_CREDENTIAL", ""), "the bearer credential itself; prefer the file or the variable, a flag shows in the process list ($LSCONFORM_CREDENTIAL)")
		template       = fs.String("template", env("LSCONFORM_TEMPLATE", ""), "the template to create targets from; default the first non-deprecated one template/list offers ($LSCONFORM_TEMPLATE)")
		universe       = fs.String("universe", env("LSCONFORM_UNIVERSE", conformance.DefaultUniverseID), "the universe id of the owners the suite invents ($LSCONFORM_UNIVERSE)")
		unixPath       = fs.String("unix-request-path", env("LSCONFORM_UNIX_REQUEST_PATH", conformance.DefaultUnixRequestPath), "the HTTP request path sent over a unix:// socket ($LSCONFORM_UNIX_REQUEST_PATH)")
		caFile         = fs.String("ca-file", env("LSCONFORM_CA_FILE", ""), "PEM certificates to trust for wss:// instead of the system's ($LSCONFORM_CA_FILE)")
		routeBase      = fs.String("route-base", env("LSCONFORM_ROUTE_BASE", ""), "the provider's data route base (ws://… or wss://…); default the controller's scheme, host and port, then /routes; required for the data route checks of a unix:// controller ($LSCONFORM_ROUTE_BASE)")
		checks         = fs.String("checks", env("LSCONFORM_CHECKS", ""), "a comma-separated list of checks to run; default all (see -list) ($LSCONFORM_CHECKS)")
		list           = fs.Bool("list", false, "print the checks' names, each with the contract's section and sentence it enforces, and exit")
		timeout        durationFlag
		answer         durationFlag
		settle         durationFlag
		poll           durationFlag
		idleAfter      durationFlag
		idleGrace      durationFlag
	)
	for _, d := range []struct {
		f        *durationFlag
		name     string
		variable string
		fallback time.Duration
		usage    string
	}{
		{&timeout, "timeout", "LSCONFORM_TIMEOUT", conformance.DefaultTimeout, "the bound on each dial and each answer"},
		{&answer, "answer-bound", "LSCONFORM_ANSWER_BOUND", conformance.DefaultAnswerBound, "the longest answer taken as the contract's \"a few seconds\" (bounded-calls, set-power)"},
		{&settle, "settle-timeout", "LSCONFORM_SETTLE_TIMEOUT", conformance.DefaultSettleTimeout, "the bound on a target becoming active, or a close reaching closed"},
		{&poll, "poll", "LSCONFORM_POLL", conformance.DefaultPollInterval, "the pause between two observations while waiting"},
		{&idleAfter, "idle-after", "LSCONFORM_IDLE_AFTER", conformance.DefaultIdleAfter, "the threshold of the idle policy idle-obligations gives its target"},
		{&idleGrace, "idle-grace", "LSCONFORM_IDLE_GRACE", conformance.DefaultIdleGrace, "how long past that threshold the provider may take to apply it (idle-obligations watches windows of both together)"},
	} {
		*d.f = durationFlag(d.fallback)
		if v := getenv(d.variable); v != "" {
			if err := d.f.Set(v); err != nil {
				return conformance.Config{}, false, fmt.Errorf("%s=%q: %w", d.variable, v, err)
			}
		}
		fs.Var(d.f, d.name, fmt.Sprintf("%s ($%s)", d.usage, d.variable))
	}
	if err := fs.Parse(args); err != nil {
		return conformance.Config{}, false, err
	}
	if *list {
		return conformance.Config{}, true, nil
	}
	urlFlag := false
	fs.Visit(func(f *flag.Flag) { urlFlag = urlFlag || f.Name == "url" })
	switch rest := fs.Args(); {
	case len(rest) > 1:
		return conformance.Config{}, false, fmt.Errorf("give one controller URL, not %d arguments", len(rest))
	case len(rest) == 1 && urlFlag:
		return conformance.Config{}, false, errors.New("give the controller URL once: as -url or as the argument")
	case len(rest) == 1:
		*url = rest[0] // the argument wins over $LSCONFORM_URL
	}
	cfg := conformance.Config{
		URL:             *url,
		TemplateID:      *template,
		UniverseID:      *universe,
		UnixRequestPath: *unixPath,
		RouteBase:       *routeBase,
		Timeout:         time.Duration(timeout),
		AnswerBound:     time.Duration(answer),
		SettleTimeout:   time.Duration(settle),
		PollInterval:    time.Duration(poll),
		IdleAfter:       time.Duration(idleAfter),
		IdleGrace:       time.Duration(idleGrace),
	}
	if *checks != "" {
		for _, c := range strings.Split(*checks, ",") {
			if c = strings.TrimSpace(c); c != "" {
				cfg.Checks = append(cfg.Checks, c)
			}
		}
	}
	switch {
	case *credentialFile != "" && *credential != "":
		return cfg, false, errors.New("give the credential once: as a file (-credential-file) or as a value (-credential), not both")
	case *credentialFile != "":
		raw, err := os.ReadFile(*credentialFile)
		if err != nil {
			return cfg, false, fmt.Errorf("read the credential file: %w", err)
		}
		cfg.Credential = strings.TrimSpace(string(raw))
		if cfg.Credential == "" {
			return cfg, false, fmt.Errorf("the credential file %s is empty", *credentialFile)
		}
	default:
		cfg.Credential = strings.TrimSpace(*credential)
	}
	if *caFile != "" {
		pem, err := os.ReadFile(*caFile)
		if err != nil {
			return cfg, false, fmt.Errorf("read the CA file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return cfg, false, fmt.Errorf("the CA file %s holds no PEM certificate", *caFile)
		}
		cfg.TLSConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	}
	if err := cfg.Validate(); err != nil {
		return cfg, false, err
	}
	return cfg, false, nil
}

// durationFlag is a positive duration.
type durationFlag time.Duration

func (d *durationFlag) String() string { return time.Duration(*d).String() }

func (d *durationFlag) Set(s string) error {
	v, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	if v <= 0 {
		return errors.New("must be positive")
	}
	*d = durationFlag(v)
	return nil
}
