package main

import (
	"errors"
	"fmt"
	"math"
	"net"
	"net/url"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/caarlos0/env/v11"

	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/ingressurl"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/targets"
)

// memberName is what Incus accepts as a cluster member's name (a host name).
var memberName = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9.-]{0,61}[A-Za-z0-9])?$`)

// config is every setting, from the environment. README.md documents each
// variable with its default; keep the two in step.
type config struct {
	Listen            string        `env:"PROVIDER_LISTEN" envDefault:"127.0.0.1:8480"`
	TLSCert           string        `env:"PROVIDER_TLS_CERT"`
	TLSKey            string        `env:"PROVIDER_TLS_KEY"`
	CredentialFile    string        `env:"PROVIDER_CREDENTIAL_FILE"`
	MetricsListen     string        `env:"PROVIDER_METRICS_LISTEN" envDefault:"127.0.0.1:9480"`
	Templates         string        `env:"PROVIDER_TEMPLATES" envDefault:"/etc/incus-provider/templates.yaml"`
	MaxInFlight       int           `env:"PROVIDER_MAX_IN_FLIGHT" envDefault:"64"`
	GracefulStop      time.Duration `env:"PROVIDER_GRACEFUL_STOP" envDefault:"10s"`
	ReconcileInterval time.Duration `env:"PROVIDER_RECONCILE_INTERVAL" envDefault:"10s"`
	GuestDialer       string        `env:"PROVIDER_GUEST_DIALER" envDefault:"auto"`
	IncusMember       string        `env:"PROVIDER_INCUS_MEMBER"`
	Replica           string        `env:"PROVIDER_REPLICA_ID"`
	GuestSocketDir    string        `env:"PROVIDER_GUEST_SOCKET_DIR" envDefault:"/run/incus-provider/guests"`
	LogLevel          string        `env:"PROVIDER_LOG_LEVEL" envDefault:"info"`
	RelayIdleTimeout  time.Duration `env:"PROVIDER_RELAY_IDLE_TIMEOUT" envDefault:"60s"`
	RouteMaxHeld      int           `env:"PROVIDER_ROUTE_MAX_HELD" envDefault:"256"`
	MaxConnections    int           `env:"PROVIDER_MAX_CONNECTIONS" envDefault:"4096"`
	MaxControl        int           `env:"PROVIDER_MAX_CONTROL_CONNECTIONS" envDefault:"64"`
	DecodeBudget      string        `env:"PROVIDER_DECODE_BUDGET" envDefault:"64MiB"`
	MemoryLimit       string        `env:"PROVIDER_MEMORY_LIMIT" envDefault:"768MiB"`
	IncusSocket       string        `env:"INCUS_SOCKET" envDefault:"/var/lib/incus/unix.socket"`
	IncusURL          string        `env:"INCUS_URL"`
	IncusClientCert   string        `env:"INCUS_CLIENT_CERT"`
	IncusClientKey    string        `env:"INCUS_CLIENT_KEY"`
	IncusServerCert   string        `env:"INCUS_SERVER_CERT"`
	IncusProject      string        `env:"INCUS_PROJECT" envDefault:"default"`
	IngressListen     string        `env:"PROVIDER_INGRESS_LISTEN" envDefault:"127.0.0.1:8482"`
	IngressBaseURL    string        `env:"PROVIDER_INGRESS_BASE_URL" envDefault:"http://{label}.localhost:8482"`
	IngressTLSCert    string        `env:"PROVIDER_INGRESS_TLS_CERT"`
	IngressTLSKey     string        `env:"PROVIDER_INGRESS_TLS_KEY"`

	// Set by check from the strings above.
	incusURLs         []string
	decodeBudgetBytes int64
	memoryLimitBytes  int64            // 0: off
	ingressBase       *ingressurl.Base // nil: PROVIDER_INGRESS_LISTEN=off
}

// loadConfig reads and checks the environment. Every refusal is one
// sentence naming the variable, the value and what is allowed.
func loadConfig() (config, error) {
	var c config
	if err := env.Parse(&c); err != nil {
		var agg env.AggregateError
		if errors.As(err, &agg) && len(agg.Errors) > 0 {
			err = agg.Errors[0]
		}
		var pe env.ParseError
		if errors.As(err, &pe) {
			return c, fmt.Errorf("%s=%q is not valid: %s expected (%w)", varName(pe.Name), os.Getenv(varName(pe.Name)), pe.Type, pe.Err)
		}
		return c, fmt.Errorf("configuration: %w", err)
	}
	return c, c.check()
}

func varName(field string) string {
	names := map[string]string{"MaxInFlight": "PROVIDER_MAX_IN_FLIGHT", "GracefulStop": "PROVIDER_GRACEFUL_STOP",
		"ReconcileInterval": "PROVIDER_RECONCILE_INTERVAL", "RelayIdleTimeout": "PROVIDER_RELAY_IDLE_TIMEOUT",
		"RouteMaxHeld": "PROVIDER_ROUTE_MAX_HELD", "MaxConnections": "PROVIDER_MAX_CONNECTIONS",
		"MaxControl": "PROVIDER_MAX_CONTROL_CONNECTIONS"}
	if n, ok := names[field]; ok {
		return n
	}
	return field
}

func (c *config) check() error {
	bad := func(name, value, allowed string) error {
		return fmt.Errorf("%s=%q is not valid: %s", name, value, allowed)
	}
	if err := checkListen(c.Listen); err != nil {
		return bad("PROVIDER_LISTEN", c.Listen, err.Error())
	}
	if c.MetricsListen != "off" {
		if err := checkListen(c.MetricsListen); err != nil || strings.HasPrefix(c.MetricsListen, "unix:") {
			return bad("PROVIDER_METRICS_LISTEN", c.MetricsListen, "use host:port (such as 127.0.0.1:9480), or off")
		}
	}
	if (c.TLSCert == "") != (c.TLSKey == "") {
		return bad("PROVIDER_TLS_CERT", c.TLSCert, "set PROVIDER_TLS_CERT and PROVIDER_TLS_KEY together, or neither")
	}
	for name, path := range map[string]string{"PROVIDER_TLS_CERT": c.TLSCert, "PROVIDER_TLS_KEY": c.TLSKey,
		"PROVIDER_CREDENTIAL_FILE": c.CredentialFile, "PROVIDER_TEMPLATES": c.Templates} {
		if path == "" {
			continue
		}
		if _, err := os.Stat(path); err != nil {
			return bad(name, path, "it must name a readable file ("+err.Error()+")")
		}
	}
	if c.MaxInFlight < jsonrpc.MinInFlight || c.MaxInFlight > 4096 {
		return bad("PROVIDER_MAX_IN_FLIGHT", fmt.Sprint(c.MaxInFlight), "use a whole number from 16 (the protocol's floor) to 4096")
	}
	if c.GracefulStop < time.Second || c.GracefulStop > 10*time.Minute {
		return bad("PROVIDER_GRACEFUL_STOP", c.GracefulStop.String(), "use a duration from 1s to 10m (Incus caps a graceful stop at 10 minutes)")
	}
	if c.ReconcileInterval < time.Second || c.ReconcileInterval > time.Hour {
		return bad("PROVIDER_RECONCILE_INTERVAL", c.ReconcileInterval.String(), "use a duration from 1s to 1h")
	}
	if c.RelayIdleTimeout < time.Minute || c.RelayIdleTimeout > 24*time.Hour {
		return bad("PROVIDER_RELAY_IDLE_TIMEOUT", c.RelayIdleTimeout.String(), "use a duration from 60s (the protocol's floor for idle closes) to 24h")
	}
	if c.RouteMaxHeld < 1 || c.RouteMaxHeld > 65536 {
		return bad("PROVIDER_ROUTE_MAX_HELD", fmt.Sprint(c.RouteMaxHeld), "use a whole number from 1 to 65536")
	}
	if c.MaxConnections < 16 || c.MaxConnections > 1<<20 {
		return bad("PROVIDER_MAX_CONNECTIONS", fmt.Sprint(c.MaxConnections), "use a whole number from 16 to 1048576")
	}
	if c.MaxControl < 1 || c.MaxControl > 65536 {
		return bad("PROVIDER_MAX_CONTROL_CONNECTIONS", fmt.Sprint(c.MaxControl), "use a whole number from 1 to 65536")
	}
	budget, ok := parseBytes(c.DecodeBudget)
	if !ok || budget < jsonrpc.MaxMessageBytes || budget > 64<<30 {
		return bad("PROVIDER_DECODE_BUDGET", c.DecodeBudget, "use a size from 16MiB (one message of the protocol's largest) to 64GiB, such as 64MiB")
	}
	c.decodeBudgetBytes = budget
	if c.MemoryLimit != "off" {
		n, ok := parseBytes(c.MemoryLimit)
		if !ok || n < 64<<20 {
			return bad("PROVIDER_MEMORY_LIMIT", c.MemoryLimit, "use a size from 64MiB, such as 768MiB or 2GiB, or off")
		}
		c.memoryLimitBytes = n
	}
	switch c.GuestDialer {
	case "auto", guest.KindNetns, guest.KindProxy, guest.KindExec, guest.KindMember:
	default:
		return bad("PROVIDER_GUEST_DIALER", c.GuestDialer, "use auto, netns, proxy, exec or member")
	}
	if c.Replica != "" && !targets.ValidReplica(c.Replica) {
		return bad("PROVIDER_REPLICA_ID", c.Replica, "use 1 to 32 lowercase letters, digits and dashes, starting with a letter or digit, different for every replica")
	}
	if c.IncusMember != "" && !memberName.MatchString(c.IncusMember) {
		return bad("PROVIDER_INCUS_MEMBER", c.IncusMember, "name the Incus cluster member this provider runs on, as `incus cluster list` shows it")
	}
	switch c.LogLevel {
	case "debug", "info", "warn", "error":
	default:
		return bad("PROVIDER_LOG_LEVEL", c.LogLevel, "use debug, info, warn or error")
	}
	if c.IncusURL != "" {
		urls, why := splitIncusURLs(c.IncusURL)
		if why != "" {
			return bad("INCUS_URL", c.IncusURL, why+"; give one https://host:port URL, or several (the members of one cluster) separated by commas, or leave it empty to use INCUS_SOCKET")
		}
		c.incusURLs = urls
		for name, path := range map[string]string{"INCUS_CLIENT_CERT": c.IncusClientCert, "INCUS_CLIENT_KEY": c.IncusClientKey, "INCUS_SERVER_CERT": c.IncusServerCert} {
			if path == "" {
				return bad(name, path, "INCUS_URL needs INCUS_CLIENT_CERT, INCUS_CLIENT_KEY and INCUS_SERVER_CERT (the pinned server certificate)")
			}
		}
	}
	if c.IncusProject == "" {
		return bad("INCUS_PROJECT", c.IncusProject, "name an Incus project, such as default")
	}
	if c.IngressListen != "off" {
		if err := checkListen(c.IngressListen); err != nil || strings.HasPrefix(c.IngressListen, "unix:") {
			return bad("PROVIDER_INGRESS_LISTEN", c.IngressListen, "use host:port (such as 127.0.0.1:8482), or off to serve no public ingress")
		}
		base, err := ingressurl.Parse(c.IngressBaseURL)
		if err != nil {
			return bad("PROVIDER_INGRESS_BASE_URL", c.IngressBaseURL, err.Error())
		}
		c.ingressBase = &base
		if (c.IngressTLSCert == "") != (c.IngressTLSKey == "") {
			return bad("PROVIDER_INGRESS_TLS_CERT", c.IngressTLSCert, "set PROVIDER_INGRESS_TLS_CERT and PROVIDER_INGRESS_TLS_KEY together, or neither")
		}
		for name, path := range map[string]string{"PROVIDER_INGRESS_TLS_CERT": c.IngressTLSCert, "PROVIDER_INGRESS_TLS_KEY": c.IngressTLSKey} {
			if path == "" {
				continue
			}
			if _, err := os.Stat(path); err != nil {
				return bad(name, path, "it must name a readable file ("+err.Error()+")")
			}
		}
	}
	return nil
}

// splitIncusURLs reads INCUS_URL: https://host:port URLs separated by
// commas, each naming another member. why says what is wrong, if anything.
func splitIncusURLs(v string) (urls []string, why string) {
	seen := map[string]string{}
	for _, item := range strings.Split(v, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			return nil, "it has an empty entry"
		}
		if err := incus.CheckURL(item); err != nil {
			return nil, fmt.Sprintf("%q %s", item, err)
		}
		u, _ := url.Parse(item)
		host := strings.ToLower(u.Host)
		if first, dup := seen[host]; dup {
			return nil, fmt.Sprintf("%q and %q name the same endpoint twice", first, item)
		}
		seen[host] = item
		urls = append(urls, item)
	}
	return urls, ""
}

func checkListen(addr string) error {
	if path, ok := strings.CutPrefix(addr, "unix:"); ok {
		if !strings.HasPrefix(path, "/") {
			return errors.New("a unix listener needs an absolute path, as unix:/run/incus-provider.sock")
		}
		return nil
	}
	if _, port, err := net.SplitHostPort(addr); err != nil || port == "" {
		return errors.New("use host:port (such as 127.0.0.1:8480) or unix:/absolute/path")
	}
	return nil
}

// parseBytes reads a size: a whole number of bytes, or one with a binary
// suffix (KiB, MiB, GiB, TiB).
func parseBytes(s string) (int64, bool) {
	units := []struct {
		suffix string
		shift  uint
	}{{"KiB", 10}, {"MiB", 20}, {"GiB", 30}, {"TiB", 40}, {"B", 0}, {"", 0}}
	for _, u := range units {
		digits, ok := strings.CutSuffix(s, u.suffix)
		if !ok || digits == "" {
			continue
		}
		n, err := strconv.ParseInt(digits, 10, 64)
		if err != nil || n < 0 || n > math.MaxInt64>>u.shift || digits[0] == '+' {
			return 0, false
		}
		return n << u.shift, true
	}
	return 0, false
}
