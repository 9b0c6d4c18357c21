package main

import (
	"fmt"
	"io"
	"reflect"
	"strings"

	"github.com/lightspeed-dev/incus-provider/internal/buildinfo"
)

// setting is one configuration variable as the config struct's tags
// define it.
type setting struct {
	Name    string // the environment variable
	Default string // empty: unset
	Allowed string // what a value may be; also the refusal's last words
	Help    string // what it does
	field   string
}

// settings reads every variable from the config struct's tags, in their
// order there: the one list --help, refusals and the tests share.
func settings() []setting {
	t := reflect.TypeFor[config]()
	var out []setting
	for i := range t.NumField() {
		f := t.Field(i)
		name, ok := f.Tag.Lookup("env")
		if !ok {
			continue
		}
		out = append(out, setting{Name: name, Default: f.Tag.Get("envDefault"), Allowed: f.Tag.Get("allowed"),
			Help: f.Tag.Get("help"), field: f.Name})
	}
	return out
}

// settingOf finds a variable by its name or by its struct field's.
func settingOf(name string) (setting, bool) {
	for _, s := range settings() {
		if s.Name == name || s.field == name {
			return s, true
		}
	}
	return setting{}, false
}

// allowed is what a variable allows, for its refusal: "use …".
func allowed(name string) string {
	s, ok := settingOf(name)
	if !ok || s.Allowed == "" {
		panic("config: no allowed tag for " + name)
	}
	return "use " + s.Allowed
}

// writeUsage prints the configuration reference: --help.
func writeUsage(w io.Writer) {
	var b strings.Builder
	b.WriteString(`incus-provider serves Lightspeed's controller plane and data routes on Incus.

Usage: incus-provider            serve, configured by the environment below
       incus-provider check      check that configuration without serving:
                                 the settings, Incus and the rights in its
                                 project, the templates' images, the guest
                                 dialer, the listeners' addresses; exit 0,
                                 2 for a setting, 1 for the environment
       incus-provider targets list [--json]
       incus-provider targets show TARGET_ID|UNIVERSE/ENVIRONMENT [--json]
                                 what Incus records of the targets, read
                                 with the provider's own settings and code
       incus-provider targets close TARGET_ID|UNIVERSE/ENVIRONMENT
                                 ask the running provider to close one, as
                                 a runtime would, and follow it to closed
       incus-provider --help     print this reference and exit
       incus-provider --version  print the build and exit

Every setting is an environment variable (under systemd, from EnvironmentFile).
Bad values stop start-up before anything touches Incus, each refused in one
sentence on stderr, all at once, with exit status 2. So does a PROVIDER_* or
INCUS_* variable that is not a setting below (Incus's own variables, such as
INCUS_DIR, pass), and a listener beyond loopback with no credential.
SIGTERM or SIGINT stops gracefully; SIGHUP reloads PROVIDER_TEMPLATES, the
TLS certificates (controller and ingress edge) and the credential file,
keeping the old ones if the new ones are refused; open connections stay.

`)
	for _, s := range settings() {
		def := s.Default
		if def == "" {
			def = "(unset)"
		}
		fmt.Fprintf(&b, "%s\n    %s.\n    default: %s\n    allowed: %s\n", s.Name, s.Help, def, s.Allowed)
	}
	_, _ = io.WriteString(w, b.String())
}

// writeVersion prints the build: --version.
func writeVersion(w io.Writer) {
	bi := buildinfo.Read()
	sha := bi.GitSha
	if sha == "" {
		sha = "unknown"
	}
	_, _ = fmt.Fprintf(w, "incus-provider %s (git %s, %s, %s)\n", bi.Version, sha, bi.Target, bi.GoVersion)
}
