package main

import (
	"crypto/tls"
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
	"github.com/lightspeed-dev/incus-provider/internal/bearer"
	"github.com/lightspeed-dev/incus-provider/internal/ingressurl"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/targets"
)

// memberName is what Incus accepts as a cluster member's name (a host name).
// routePath is a data route base's path as the contract has it, kept to
// characters that need no escaping.
var routePath = regexp.MustCompile(`^(/[A-Za-z0-9._~-]+)+$`)

var memberName = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9.-]{0,61}[A-Za-z0-9])?$`)

// config is every setting, from the environment. The tags are the one
// definition of each: its variable, its default, what it allows (the text
// of its refusal, too) and what it means; --help prints them (reference.go).
type config struct {
	Listen            string        `env:"PROVIDER_LISTEN" envDefault:"127.0.0.1:8480" allowed:"host:port (such as 127.0.0.1:8480) or unix:/absolute/path" help:"the controller listener: the controller plane on any path, the data routes under PROVIDER_ROUTE_PATH"`
	RouteListen       string        `env:"PROVIDER_ROUTE_LISTEN" allowed:"host:port (such as 0.0.0.0:8481), or empty" help:"a second listener serving what PROVIDER_LISTEN serves, for a data route base a runtime can dial when PROVIDER_LISTEN is a unix socket"`
	RoutePath         string        `env:"PROVIDER_ROUTE_PATH" envDefault:"/routes" allowed:"an absolute path of one or more segments of letters, digits and - . _ ~, not ending in /, such as /routes" help:"the path of the data route base the provider is registered with; the runtime's default is /routes"`
	TLSCert           string        `env:"PROVIDER_TLS_CERT" allowed:"a readable PEM file; set PROVIDER_TLS_CERT and PROVIDER_TLS_KEY together, or neither" help:"serve wss:// with this certificate (reloaded on SIGHUP)"`
	TLSKey            string        `env:"PROVIDER_TLS_KEY" allowed:"a readable PEM file; set PROVIDER_TLS_CERT and PROVIDER_TLS_KEY together, or neither" help:"the private key of PROVIDER_TLS_CERT"`
	CredentialFile    string        `env:"PROVIDER_CREDENTIAL_FILE" allowed:"a readable file holding the bearer credential" help:"when set, /control and every route answer 401 without Authorization: Bearer <credential>"`
	AllowNoCredential string        `env:"PROVIDER_ALLOW_NO_CREDENTIAL" envDefault:"no" allowed:"no or yes" help:"yes lets PROVIDER_LISTEN or PROVIDER_ROUTE_LISTEN serve beyond loopback with no PROVIDER_CREDENTIAL_FILE (only where something in front checks every caller); no refuses to start that way"`
	MetricsListen     string        `env:"PROVIDER_METRICS_LISTEN" envDefault:"127.0.0.1:9480" allowed:"host:port (such as 127.0.0.1:9480), or off" help:"Prometheus /metrics, /healthz and /readyz"`
	Templates         string        `env:"PROVIDER_TEMPLATES" envDefault:"/etc/incus-provider/templates.yaml" allowed:"a readable templates file (YAML or JSON)" help:"the templates offered, each with an optional warm pool (warm: 0-32 instances created ahead); reloaded on SIGHUP"`
	MaxInFlight       int           `env:"PROVIDER_MAX_IN_FLIGHT" envDefault:"64" allowed:"a whole number from 16 (the protocol's floor) to 4096" help:"requests in flight per controller connection; past it, busy/requestLimit"`
	GracefulStop      time.Duration `env:"PROVIDER_GRACEFUL_STOP" envDefault:"10s" allowed:"a duration from 1s to 10m (Incus caps a graceful stop at 10 minutes)" help:"how long a close or stop waits for a graceful shutdown before forcing it"`
	DrainDelay        time.Duration `env:"PROVIDER_DRAIN_DELAY" envDefault:"0s" allowed:"a duration from 0s to 1m" help:"on SIGTERM, how long /readyz answers 503 draining while everything is still served, so a load balancer's health check takes this replica out before its listeners close (about its interval times its fall count)"`
	DrainTimeout      time.Duration `env:"PROVIDER_DRAIN_TIMEOUT" envDefault:"20s" allowed:"a duration from 1s to 10m" help:"on SIGTERM, after the delay, how long controller calls in flight may take to be answered (new ones are refused as unavailable) before every connection and relay is closed with 1001 and the process exits"`
	ReconcileInterval time.Duration `env:"PROVIDER_RECONCILE_INTERVAL" envDefault:"10s" allowed:"a duration from 1s to 1h" help:"period of the full reconcile pass"`
	ObservationCache  string        `env:"PROVIDER_OBSERVATION_CACHE" envDefault:"on" allowed:"on or off" help:"answer reads from a cache kept by Incus's event stream and corrected by a full list every PROVIDER_CACHE_CORRECTION_INTERVAL; off: every read asks Incus"`
	WarmBurstWindow   time.Duration `env:"PROVIDER_WARM_BURST_WINDOW" envDefault:"30s" allowed:"a duration from 1s to 1h" help:"a pool with warmMax grows to the largest burst of creates within this span, and a quarter more"`
	WarmShrinkAfter   time.Duration `env:"PROVIDER_WARM_SHRINK_AFTER" envDefault:"10m" allowed:"a duration from 10s to 24h" help:"how long a burst keeps a pool large, and how long a spare above the size wanted waits, ready and unclaimed, before it is deleted"`
	WarmMemoryMax     string        `env:"PROVIDER_WARM_MEMORY_MAX" envDefault:"off" allowed:"a size such as 8GiB, or off" help:"the memory the warm instances may hold on one member, each counted at its template's resources.memoryBytes; a refill that would pass it waits"`
	CacheCorrection   time.Duration `env:"PROVIDER_CACHE_CORRECTION_INTERVAL" envDefault:"1m" allowed:"a duration from 10s to 1h" help:"period of the observation cache's correcting full list of the project; shorter catches an event lost without a gap sooner, and each list decodes every instance"`
	GuestDialer       string        `env:"PROVIDER_GUEST_DIALER" envDefault:"auto" allowed:"auto, netns, proxy, exec or member" help:"how the provider reaches each guest's daemon"`
	IncusMember       string        `env:"PROVIDER_INCUS_MEMBER" allowed:"the name of the Incus cluster member this provider runs on, as incus cluster list shows it" help:"whose guests are reached through netns on a cluster"`
	Replica           string        `env:"PROVIDER_REPLICA_ID" allowed:"1 to 32 lowercase letters, digits and dashes, starting with a letter or digit, different for every replica" help:"this process's name among replicas; default: host name and listen port"`
	PeerListen        string        `env:"PROVIDER_PEER_LISTEN" envDefault:"off" allowed:"host:port on an address the other replicas reach (such as the member's own address), or off" help:"where this replica serves its member's guests to the other replicas (TLS, PROVIDER_PEER_SECRET_FILE)"`
	Peers             string        `env:"PROVIDER_PEERS" allowed:"member=host:port for each replica's PROVIDER_PEER_LISTEN, separated by commas, such as node1=10.0.0.1:8483,node2=10.0.0.2:8483" help:"where the replicas serve their members' guests; one list for every replica"`
	PeerSecretFile    string        `env:"PROVIDER_PEER_SECRET_FILE" allowed:"a file of mode 0600 or stricter holding a secret of at least 32 bytes on a line, or two such lines while rotating; needed by PROVIDER_PEER_LISTEN and PROVIDER_PEERS" help:"the replicas' shared forwarding secret (reloaded on SIGHUP; while rotating, the first line proves this replica and either is accepted)"`
	GuestSocketDir    string        `env:"PROVIDER_GUEST_SOCKET_DIR" envDefault:"/run/incus-provider/guests" allowed:"an absolute directory path" help:"host directory for the proxy dialer's sockets"`
	AuditLog          string        `env:"PROVIDER_AUDIT_LOG" envDefault:"on" allowed:"on or off" help:"a log line (logger audit) for every controller call answered: method, owner, target, outcome kind, time taken, caller; never a credential or a payload"`
	AccessLog         string        `env:"PROVIDER_ACCESS_LOG" envDefault:"off" allowed:"on or off" help:"a log line (logger access) for every request the public ingress edge answers: method, host label, status, bytes, time taken, caller"`
	SettingsFile      string        `env:"PROVIDER_SETTINGS_FILE" allowed:"the absolute path of a readable file of VAR=value lines (systemd's EnvironmentFile syntax), or empty" help:"the file these settings were read from (the unit's EnvironmentFile): SIGHUP reads it again, applies PROVIDER_LOG_LEVEL in place and names every other setting that differs as taking a restart"`
	LogLevel          string        `env:"PROVIDER_LOG_LEVEL" envDefault:"info" allowed:"debug, info, warn or error" help:"JSON logs on stderr"`
	RelayIdleTimeout  time.Duration `env:"PROVIDER_RELAY_IDLE_TIMEOUT" envDefault:"60s" allowed:"a duration from 60s (the protocol's floor for idle closes) to 24h" help:"a data relay with no frame either way for this long is closed"`
	RouteMaxHeld      int           `env:"PROVIDER_ROUTE_MAX_HELD" envDefault:"256" allowed:"a whole number from 1 to 65536" help:"data-route dials held at once while targets wake; past it, 503 at once"`
	MaxConnections    int           `env:"PROVIDER_MAX_CONNECTIONS" envDefault:"4096" allowed:"a whole number from 16 to 1048576" help:"open connections on the controller listener, of every kind"`
	MaxControl        int           `env:"PROVIDER_MAX_CONTROL_CONNECTIONS" envDefault:"64" allowed:"a whole number from 1 to 65536" help:"open controller connections; past it /control answers 503"`
	DecodeBudget      string        `env:"PROVIDER_DECODE_BUDGET" envDefault:"64MiB" allowed:"a size from 16MiB (one message of the protocol's largest) to 64GiB, such as 64MiB" help:"bytes of large controller frames decoded at once"`
	MemoryLimit       string        `env:"PROVIDER_MEMORY_LIMIT" envDefault:"768MiB" allowed:"a size from 64MiB, such as 768MiB or 2GiB, or off" help:"the Go runtime's soft memory limit"`
	IncusSocket       string        `env:"INCUS_SOCKET" envDefault:"/var/lib/incus/unix.socket" allowed:"the path of the local Incus API socket" help:"used when INCUS_URL is empty"`
	IncusURL          string        `env:"INCUS_URL" allowed:"one https://host:port URL, or several (the members of one cluster) separated by commas, or empty to use INCUS_SOCKET" help:"remote Incus over HTTPS"`
	IncusClientCert   string        `env:"INCUS_CLIENT_CERT" allowed:"a PEM file; needed with INCUS_URL" help:"client certificate for INCUS_URL"`
	IncusClientKey    string        `env:"INCUS_CLIENT_KEY" allowed:"a PEM file; needed with INCUS_URL" help:"client key for INCUS_URL"`
	IncusServerCert   string        `env:"INCUS_SERVER_CERT" allowed:"a PEM file; needed with INCUS_URL" help:"the pinned server certificate of INCUS_URL"`
	IncusProject      string        `env:"INCUS_PROJECT" envDefault:"default" allowed:"the name of an existing Incus project, such as default" help:"the Incus project targets live in"`
	IngressListen     string        `env:"PROVIDER_INGRESS_LISTEN" envDefault:"127.0.0.1:8482" allowed:"host:port, or off" help:"the public ingress edge's listener"`
	IngressBaseURL    string        `env:"PROVIDER_INGRESS_BASE_URL" envDefault:"http://{label}.localhost:8482" allowed:"an http or https URL with {label} exactly once in its host and no user, path or query, such as https://{label}.env.example.com" help:"the public base of routed targets' endpoints"`
	IngressTLSCert    string        `env:"PROVIDER_INGRESS_TLS_CERT" allowed:"a readable PEM file; set PROVIDER_INGRESS_TLS_CERT and PROVIDER_INGRESS_TLS_KEY together, or neither" help:"serve the edge over TLS (and HTTP/2) with this certificate"`
	IngressTLSKey     string        `env:"PROVIDER_INGRESS_TLS_KEY" allowed:"a readable PEM file; set PROVIDER_INGRESS_TLS_CERT and PROVIDER_INGRESS_TLS_KEY together, or neither" help:"the private key of PROVIDER_INGRESS_TLS_CERT"`

	// Set by check from the strings above.
	incusURLs         []string
	decodeBudgetBytes int64
	// warmMemoryMaxBytes is PROVIDER_WARM_MEMORY_MAX; 0 when off.
	warmMemoryMaxBytes int64
	memoryLimitBytes   int64 // 0: off
	peers              map[string]string
	peerSecrets        [][]byte         // PROVIDER_PEER_SECRET_FILE's lines
	ingressBase        *ingressurl.Base // nil: PROVIDER_INGRESS_LISTEN=off
	cacheOn            bool             // PROVIDER_OBSERVATION_CACHE=on
	credential         bearer.Credential
	tlsCert            *tls.Certificate // nil: PROVIDER_TLS_CERT unset
	edgeCert           *tls.Certificate // nil: PROVIDER_INGRESS_TLS_CERT unset or the edge off
}

// loadConfig reads and checks the environment (as os.Environ gives it). Every refusal is one
// sentence naming the variable, the value and what is allowed, and every
// one is reported at once (a *configError, one sentence a line).
func loadConfig(environ []string) (config, error) {
	var c config
	var r refusals
	vars := make(map[string]string, len(environ))
	for _, kv := range environ {
		if k, v, ok := strings.Cut(kv, "="); ok {
			vars[k] = v
		}
	}
	if err := env.ParseWithOptions(&c, env.Options{Environment: vars}); err != nil {
		var agg env.AggregateError
		errs := []error{err}
		if errors.As(err, &agg) && len(agg.Errors) > 0 {
			errs = agg.Errors
		}
		for _, err := range errs {
			var pe env.ParseError
			if !errors.As(err, &pe) {
				return c, fmt.Errorf("configuration: %w", err)
			}
			name := varName(pe.Name)
			r.add(name, vars[name], allowed(name))
		}
	}
	unknownVariables(environ, &r)
	c.check(&r)
	return c, r.err()
}

// varName is the variable a config field is read from.
func varName(field string) string {
	if s, ok := settingOf(field); ok {
		return s.Name
	}
	return field
}

// check refuses what the values' types alone do not, reads the files the
// settings name (the credential, certificates, the peers' secret) so that
// a bad one stops the start before anything touches Incus, and fills the
// derived fields. A value r already refused is not looked at again.
func (c *config) check(r *refusals) {
	bad := r.add
	listenOK := func(name, value string, unixOK bool, want string) bool {
		if r.refused(name) {
			return false
		}
		if err := checkListen(value); err != nil || (!unixOK && strings.HasPrefix(value, "unix:")) {
			if want == "" {
				want = err.Error()
			}
			bad(name, value, want)
			return false
		}
		return true
	}
	listenOK("PROVIDER_LISTEN", c.Listen, true, "")
	if c.RouteListen != "" {
		listenOK("PROVIDER_ROUTE_LISTEN", c.RouteListen, false, allowed("PROVIDER_ROUTE_LISTEN"))
	}
	if !routePath.MatchString(c.RoutePath) {
		bad("PROVIDER_ROUTE_PATH", c.RoutePath, allowed("PROVIDER_ROUTE_PATH"))
	}
	if c.MetricsListen != "off" {
		listenOK("PROVIDER_METRICS_LISTEN", c.MetricsListen, false, allowed("PROVIDER_METRICS_LISTEN"))
	}
	c.checkFiles(r)
	if c.AllowNoCredential != "no" && c.AllowNoCredential != "yes" {
		bad("PROVIDER_ALLOW_NO_CREDENTIAL", c.AllowNoCredential, allowed("PROVIDER_ALLOW_NO_CREDENTIAL"))
	} else if c.CredentialFile == "" && c.AllowNoCredential == "no" {
		for name, addr := range map[string]string{"PROVIDER_LISTEN": c.Listen, "PROVIDER_ROUTE_LISTEN": c.RouteListen} {
			if addr != "" && !r.refused(name) && !loopbackOnly(addr) {
				bad(name, addr, "it reaches beyond this host and PROVIDER_CREDENTIAL_FILE is unset, so anyone who reaches it could create, power and close targets and reach every guest; set PROVIDER_CREDENTIAL_FILE, listen on loopback or a unix socket, or set PROVIDER_ALLOW_NO_CREDENTIAL=yes where something in front checks callers")
			}
		}
	}
	if !r.refused("PROVIDER_MAX_IN_FLIGHT") && (c.MaxInFlight < jsonrpc.MinInFlight || c.MaxInFlight > 4096) {
		bad("PROVIDER_MAX_IN_FLIGHT", fmt.Sprint(c.MaxInFlight), allowed("PROVIDER_MAX_IN_FLIGHT"))
	}
	if !r.refused("PROVIDER_GRACEFUL_STOP") && (c.GracefulStop < time.Second || c.GracefulStop > 10*time.Minute) {
		bad("PROVIDER_GRACEFUL_STOP", c.GracefulStop.String(), allowed("PROVIDER_GRACEFUL_STOP"))
	}
	if !r.refused("PROVIDER_DRAIN_DELAY") && (c.DrainDelay < 0 || c.DrainDelay > time.Minute) {
		bad("PROVIDER_DRAIN_DELAY", c.DrainDelay.String(), allowed("PROVIDER_DRAIN_DELAY"))
	}
	if !r.refused("PROVIDER_DRAIN_TIMEOUT") && (c.DrainTimeout < time.Second || c.DrainTimeout > 10*time.Minute) {
		bad("PROVIDER_DRAIN_TIMEOUT", c.DrainTimeout.String(), allowed("PROVIDER_DRAIN_TIMEOUT"))
	}
	if !r.refused("PROVIDER_RECONCILE_INTERVAL") && (c.ReconcileInterval < time.Second || c.ReconcileInterval > time.Hour) {
		bad("PROVIDER_RECONCILE_INTERVAL", c.ReconcileInterval.String(), allowed("PROVIDER_RECONCILE_INTERVAL"))
	}
	if c.ObservationCache != "on" && c.ObservationCache != "off" {
		bad("PROVIDER_OBSERVATION_CACHE", c.ObservationCache, allowed("PROVIDER_OBSERVATION_CACHE"))
	}
	c.cacheOn = c.ObservationCache == "on"
	if !r.refused("PROVIDER_WARM_BURST_WINDOW") && (c.WarmBurstWindow < time.Second || c.WarmBurstWindow > time.Hour) {
		bad("PROVIDER_WARM_BURST_WINDOW", c.WarmBurstWindow.String(), allowed("PROVIDER_WARM_BURST_WINDOW"))
	}
	if !r.refused("PROVIDER_WARM_SHRINK_AFTER") && (c.WarmShrinkAfter < 10*time.Second || c.WarmShrinkAfter > 24*time.Hour) {
		bad("PROVIDER_WARM_SHRINK_AFTER", c.WarmShrinkAfter.String(), allowed("PROVIDER_WARM_SHRINK_AFTER"))
	}
	if !r.refused("PROVIDER_CACHE_CORRECTION_INTERVAL") && (c.CacheCorrection < 10*time.Second || c.CacheCorrection > time.Hour) {
		bad("PROVIDER_CACHE_CORRECTION_INTERVAL", c.CacheCorrection.String(), allowed("PROVIDER_CACHE_CORRECTION_INTERVAL"))
	}
	if !r.refused("PROVIDER_RELAY_IDLE_TIMEOUT") && (c.RelayIdleTimeout < time.Minute || c.RelayIdleTimeout > 24*time.Hour) {
		bad("PROVIDER_RELAY_IDLE_TIMEOUT", c.RelayIdleTimeout.String(), allowed("PROVIDER_RELAY_IDLE_TIMEOUT"))
	}
	if !r.refused("PROVIDER_ROUTE_MAX_HELD") && (c.RouteMaxHeld < 1 || c.RouteMaxHeld > 65536) {
		bad("PROVIDER_ROUTE_MAX_HELD", fmt.Sprint(c.RouteMaxHeld), allowed("PROVIDER_ROUTE_MAX_HELD"))
	}
	if !r.refused("PROVIDER_MAX_CONNECTIONS") && (c.MaxConnections < 16 || c.MaxConnections > 1<<20) {
		bad("PROVIDER_MAX_CONNECTIONS", fmt.Sprint(c.MaxConnections), allowed("PROVIDER_MAX_CONNECTIONS"))
	}
	if !r.refused("PROVIDER_MAX_CONTROL_CONNECTIONS") && (c.MaxControl < 1 || c.MaxControl > 65536) {
		bad("PROVIDER_MAX_CONTROL_CONNECTIONS", fmt.Sprint(c.MaxControl), allowed("PROVIDER_MAX_CONTROL_CONNECTIONS"))
	}
	if c.WarmMemoryMax != "off" {
		if n, ok := parseBytes(c.WarmMemoryMax); ok && n > 0 {
			c.warmMemoryMaxBytes = n
		} else {
			bad("PROVIDER_WARM_MEMORY_MAX", c.WarmMemoryMax, allowed("PROVIDER_WARM_MEMORY_MAX"))
		}
	}
	if budget, ok := parseBytes(c.DecodeBudget); !ok || budget < jsonrpc.MaxMessageBytes || budget > 64<<30 {
		bad("PROVIDER_DECODE_BUDGET", c.DecodeBudget, allowed("PROVIDER_DECODE_BUDGET"))
	} else {
		c.decodeBudgetBytes = budget
	}
	if c.MemoryLimit != "off" {
		if n, ok := parseBytes(c.MemoryLimit); !ok || n < 64<<20 {
			bad("PROVIDER_MEMORY_LIMIT", c.MemoryLimit, allowed("PROVIDER_MEMORY_LIMIT"))
		} else {
			c.memoryLimitBytes = n
		}
	}
	switch c.GuestDialer {
	case "auto", guest.KindNetns, guest.KindProxy, guest.KindExec, guest.KindMember:
	default:
		bad("PROVIDER_GUEST_DIALER", c.GuestDialer, allowed("PROVIDER_GUEST_DIALER"))
	}
	if c.Replica != "" && !targets.ValidReplica(c.Replica) {
		bad("PROVIDER_REPLICA_ID", c.Replica, allowed("PROVIDER_REPLICA_ID"))
	}
	if c.IncusMember != "" && !memberName.MatchString(c.IncusMember) {
		bad("PROVIDER_INCUS_MEMBER", c.IncusMember, allowed("PROVIDER_INCUS_MEMBER"))
	}
	if !strings.HasPrefix(c.GuestSocketDir, "/") {
		bad("PROVIDER_GUEST_SOCKET_DIR", c.GuestSocketDir, allowed("PROVIDER_GUEST_SOCKET_DIR"))
	}
	c.checkPeers(r)
	for _, sw := range []struct{ name, value string }{{"PROVIDER_AUDIT_LOG", c.AuditLog}, {"PROVIDER_ACCESS_LOG", c.AccessLog}} {
		if sw.value != "on" && sw.value != "off" {
			bad(sw.name, sw.value, allowed(sw.name))
		}
	}
	switch c.LogLevel {
	case "debug", "info", "warn", "error":
	default:
		bad("PROVIDER_LOG_LEVEL", c.LogLevel, allowed("PROVIDER_LOG_LEVEL"))
	}
	if c.IncusURL != "" {
		if urls, why := splitIncusURLs(c.IncusURL); why != "" {
			bad("INCUS_URL", c.IncusURL, why+"; "+allowed("INCUS_URL"))
		} else {
			c.incusURLs = urls
		}
		var unset []string
		for _, f := range []struct{ name, path string }{{"INCUS_CLIENT_CERT", c.IncusClientCert}, {"INCUS_CLIENT_KEY", c.IncusClientKey}, {"INCUS_SERVER_CERT", c.IncusServerCert}} {
			if f.path == "" {
				unset = append(unset, f.name)
			}
		}
		if len(unset) > 0 {
			r.addLine(unset[0], strings.Join(unset, ", ")+" unset: INCUS_URL needs INCUS_CLIENT_CERT, INCUS_CLIENT_KEY and INCUS_SERVER_CERT (the pinned server certificate)")
		}
	}
	if c.IncusProject == "" {
		bad("INCUS_PROJECT", c.IncusProject, allowed("INCUS_PROJECT"))
	}
	if c.IngressListen != "off" {
		listenOK("PROVIDER_INGRESS_LISTEN", c.IngressListen, false, "use host:port (such as 127.0.0.1:8482), or off to serve no public ingress")
		if base, err := ingressurl.Parse(c.IngressBaseURL); err != nil {
			bad("PROVIDER_INGRESS_BASE_URL", c.IngressBaseURL, err.Error())
		} else {
			c.ingressBase = &base
		}
	}
}

// checkFiles reads the files the settings name, each once, at start: a
// credential, a certificate or a key that cannot be used is refused here,
// not at the first request or handshake, when the service already
// answers and systemd would restart it for ever.
func (c *config) checkFiles(r *refusals) {
	if c.Templates != "" {
		if _, err := os.Stat(c.Templates); err != nil {
			r.add("PROVIDER_TEMPLATES", c.Templates, "it must name a readable file ("+err.Error()+")")
		}
	}
	if c.SettingsFile != "" {
		if !strings.HasPrefix(c.SettingsFile, "/") {
			r.add("PROVIDER_SETTINGS_FILE", c.SettingsFile, allowed("PROVIDER_SETTINGS_FILE"))
		} else if _, err := readSettingsFile(c.SettingsFile); err != nil {
			r.add("PROVIDER_SETTINGS_FILE", c.SettingsFile, "it must name a readable file of VAR=value lines ("+err.Error()+")")
		}
	}
	if c.CredentialFile != "" {
		cred, err := bearer.Load(c.CredentialFile)
		if err != nil {
			r.add("PROVIDER_CREDENTIAL_FILE", c.CredentialFile, "it must name a readable file holding the credential ("+err.Error()+")")
		}
		c.credential = cred
	}
	pair := func(certName, cert, keyName, key string) *tls.Certificate {
		switch {
		case cert == "" && key == "":
			return nil
		case cert == "" || key == "":
			r.add(certName, cert, "set "+certName+" and "+keyName+" together, or neither")
			return nil
		}
		for _, f := range []struct{ name, path string }{{certName, cert}, {keyName, key}} {
			if _, err := os.Stat(f.path); err != nil {
				r.add(f.name, f.path, "it must name a readable file ("+err.Error()+")")
				return nil
			}
		}
		kp, err := tls.LoadX509KeyPair(cert, key)
		if err != nil {
			r.add(certName, cert, "it and "+keyName+" are not a usable pair: a PEM certificate and its key ("+err.Error()+")")
			return nil
		}
		return &kp
	}
	c.tlsCert = pair("PROVIDER_TLS_CERT", c.TLSCert, "PROVIDER_TLS_KEY", c.TLSKey)
	if c.IngressListen != "off" {
		c.edgeCert = pair("PROVIDER_INGRESS_TLS_CERT", c.IngressTLSCert, "PROVIDER_INGRESS_TLS_KEY", c.IngressTLSKey)
	}
}

// incusConfig is how the service and its commands (check, targets) reach
// Incus: one client configuration from the settings.
func (c *config) incusConfig() incus.Config {
	return incus.Config{Socket: c.IncusSocket, URLs: c.incusURLs, ClientCert: c.IncusClientCert, ClientKey: c.IncusClientKey,
		ServerCert: c.IncusServerCert, Project: c.IncusProject}
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

// checkPeers reads the replica-to-replica forwarding settings: where this
// replica serves its member's guests to the others, where the others
// serve theirs, and the secret they share.
func (c *config) checkPeers(r *refusals) {
	bad := r.add
	if c.PeerListen != "off" {
		if err := checkListen(c.PeerListen); err != nil || strings.HasPrefix(c.PeerListen, "unix:") {
			bad("PROVIDER_PEER_LISTEN", c.PeerListen, "use host:port on an address the other replicas reach (such as the member's own address), or off")
		}
	}
	if c.Peers != "" {
		c.peers = map[string]string{}
		for _, item := range strings.Split(c.Peers, ",") {
			m, addr, ok := strings.Cut(strings.TrimSpace(item), "=")
			_, _, err := net.SplitHostPort(addr)
			if !ok || !memberName.MatchString(m) || err != nil {
				bad("PROVIDER_PEERS", c.Peers, "give member=host:port for each replica's PROVIDER_PEER_LISTEN, separated by commas, such as node1=10.0.0.1:8483,node2=10.0.0.2:8483")
				break
			}
			if _, dup := c.peers[m]; dup {
				bad("PROVIDER_PEERS", c.Peers, "it names member "+m+" twice; one replica serves each member's guests to the others")
				break
			}
			c.peers[m] = addr
		}
	}
	if c.PeerListen == "off" && c.Peers == "" {
		if c.PeerSecretFile != "" {
			bad("PROVIDER_PEER_SECRET_FILE", c.PeerSecretFile, "it is used only with PROVIDER_PEER_LISTEN or PROVIDER_PEERS; set one of them, or leave this empty")
		}
		return
	}
	if c.PeerSecretFile == "" {
		bad("PROVIDER_PEER_SECRET_FILE", "", "PROVIDER_PEER_LISTEN and PROVIDER_PEERS need the replicas' shared secret in a file")
		return
	}
	secrets, why := readPeerSecrets(c.PeerSecretFile)
	if why != "" {
		bad("PROVIDER_PEER_SECRET_FILE", c.PeerSecretFile, why)
		return
	}
	c.peerSecrets = secrets
}

// readPeerSecrets reads the replicas' forwarding secrets: one line, or two
// while they are rotated (the first proves this replica, either is
// accepted from a peer; see guest.PeerSecrets). why says what is wrong,
// if anything. Start-up and SIGHUP read it alike.
func readPeerSecrets(path string) (secrets [][]byte, why string) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, "it must name a readable file (" + err.Error() + ")"
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Sprintf("its mode is %04o: a secret that opens every guest must be readable by its owner only (chmod 600)", fi.Mode().Perm())
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, "it must name a readable file (" + err.Error() + ")"
	}
	for line := range strings.SplitSeq(string(raw), "\n") {
		if line = strings.TrimSpace(line); line != "" {
			secrets = append(secrets, []byte(line))
		}
	}
	switch {
	case len(secrets) == 0:
		return nil, fmt.Sprintf("it holds no secret; use at least %d bytes, such as the output of `openssl rand -hex 32`", guest.MinForwardSecret)
	case len(secrets) > 2:
		return nil, fmt.Sprintf("it holds %d lines; hold one secret, or two while rotating (the one this replica proves itself with first)", len(secrets))
	}
	for i, s := range secrets {
		if len(s) < guest.MinForwardSecret {
			return nil, fmt.Sprintf("its line %d holds %d bytes; use at least %d, such as the output of `openssl rand -hex 32`", i+1, len(s), guest.MinForwardSecret)
		}
	}
	return secrets, ""
}
