package deploy_test

import (
	"bytes"
	"encoding/json"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.yaml.in/yaml/v3"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/idle"
	"github.com/lightspeed-dev/incus-provider/ingress"
	"github.com/lightspeed-dev/incus-provider/internal/serve"
	"github.com/lightspeed-dev/incus-provider/routes"
	"github.com/lightspeed-dev/incus-provider/targets"
	"github.com/lightspeed-dev/incus-provider/wake"
)

const (
	dashboardFile  = "grafana/incus-provider.json"
	alertsFile     = "prometheus/alerts.yaml"
	envExampleFile = "provider.env.example"
	unitFile       = "systemd/incus-provider.service"
	readmeFile     = "../README.md"
	metricsDoc     = "../docs/metrics.md"
	configDoc      = "../docs/configuration.md"
	operationsDoc  = "../docs/operations.md"
	configFile     = "../cmd/incus-provider/config.go"
	// The files of cmd/incus-provider that declare metrics of their own.
	incusMetricsFiles = "../cmd/incus-provider/metrics.go ../cmd/incus-provider/peers.go"
)

// metricName is how a reference to one of the provider's own metrics looks
// in PromQL, the README or anywhere else.
var metricName = regexp.MustCompile(`incus_provider_[a-z_]+`)

// family is one registered metric family.
type family struct {
	name string
	kind string // "counter/gauge", "histogram" or "summary"
}

// series are the names a family exposes: histograms and summaries only as
// their suffixed series (a summary's quantiles are a label of the bare name).
func (f family) series() []string {
	switch f.kind {
	case "histogram":
		return []string{f.name + "_bucket", f.name + "_sum", f.name + "_count"}
	case "summary":
		return []string{f.name, f.name + "_sum", f.name + "_count"}
	default:
		return []string{f.name}
	}
}

// recorder is a Registerer that registers on a real registry and records
// every collector's descriptors, so that vectors no label set has touched
// yet (absent from Gather) are known too.
type recorder struct {
	reg      *prometheus.Registry
	families map[string]family
	t        *testing.T
}

func (r *recorder) Register(c prometheus.Collector) error {
	if err := r.reg.Register(c); err != nil {
		return err
	}
	kind := kindOf(r.t, c)
	descs := make(chan *prometheus.Desc, 16)
	go func() { c.Describe(descs); close(descs) }()
	for d := range descs {
		name := fqName(r.t, d)
		r.families[name] = family{name: name, kind: kind}
	}
	return nil
}

func (r *recorder) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

func (r *recorder) Unregister(c prometheus.Collector) bool { return r.reg.Unregister(c) }

var descName = regexp.MustCompile(`fqName: "([^"]+)"`)

func fqName(t *testing.T, d *prometheus.Desc) string {
	m := descName.FindStringSubmatch(d.String())
	if m == nil {
		t.Fatalf("cannot read the metric name from descriptor %s", d)
	}
	return m[1]
}

// kindOf tells histograms and summaries from the rest: a vector by its
// type, a single metric by what it writes.
func kindOf(t *testing.T, c prometheus.Collector) string {
	switch c.(type) {
	case *prometheus.HistogramVec:
		return "histogram"
	case *prometheus.SummaryVec:
		return "summary"
	case *prometheus.CounterVec, *prometheus.GaugeVec:
		return "counter/gauge"
	}
	m, ok := c.(prometheus.Metric)
	if !ok {
		t.Fatalf("collector %T is neither a vector nor a single metric; teach kindOf about it", c)
	}
	var out dto.Metric
	if err := m.Write(&out); err != nil {
		t.Fatalf("write %T: %v", c, err)
	}
	switch {
	case out.Histogram != nil:
		return "histogram"
	case out.Summary != nil:
		return "summary"
	default:
		return "counter/gauge"
	}
}

// incusMetrics reads the Incus call metrics from cmd/incus-provider/metrics.go.
// They are registered there by the unexported newIncusMetrics, which this
// package cannot call; README names them as incus_provider_incus_requests_total
// (a counter) and incus_provider_incus_request_duration_seconds (a histogram).
// Parsing the source keeps the set exact without touching that package.
func incusMetrics(t *testing.T) []family {
	var out []family
	for _, file := range strings.Fields(incusMetricsFiles) {
		out = append(out, metricsOf(t, file)...)
	}
	return out
}

func metricsOf(t *testing.T, incusMetricsFile string) []family {
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, incusMetricsFile, nil, 0)
	if err != nil {
		t.Fatalf("parse %s: %v", incusMetricsFile, err)
	}
	var out []family
	ast.Inspect(f, func(n ast.Node) bool {
		lit, ok := n.(*ast.CompositeLit)
		if !ok {
			return true
		}
		sel, ok := lit.Type.(*ast.SelectorExpr)
		if !ok {
			return true
		}
		if pkg, ok := sel.X.(*ast.Ident); !ok || pkg.Name != "prometheus" {
			return true
		}
		kind := map[string]string{"CounterOpts": "counter/gauge", "GaugeOpts": "counter/gauge",
			"HistogramOpts": "histogram", "SummaryOpts": "summary"}[sel.Sel.Name]
		if kind == "" {
			return true
		}
		for _, el := range lit.Elts {
			kv, ok := el.(*ast.KeyValueExpr)
			if !ok {
				continue
			}
			if key, ok := kv.Key.(*ast.Ident); !ok || key.Name != "Name" {
				continue
			}
			bl, ok := kv.Value.(*ast.BasicLit)
			if !ok || bl.Kind != token.STRING {
				t.Fatalf("%s: a metric Name is not a string literal (%s); update this test", incusMetricsFile, fset.Position(kv.Pos()))
			}
			name, err := strconv.Unquote(bl.Value)
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, family{name: name, kind: kind})
		}
		return true
	})
	if len(out) == 0 {
		t.Fatalf("%s declares no metrics any more; update this test", incusMetricsFile)
	}
	return out
}

// registered builds the registry as cmd/incus-provider does (its own
// constructors, the Incus call metrics from source) and returns the
// provider's families by name.
func registered(t *testing.T) map[string]family {
	t.Helper()
	r := &recorder{reg: prometheus.NewRegistry(), families: map[string]family{}, t: t}
	controller.NewMetrics(r)
	serve.NewMetrics(r)
	routes.NewMetrics(r)
	wake.NewMetrics(r)
	idle.NewMetrics(r)
	ingress.NewMetrics(r)
	targets.NewWarmMetrics(r)
	targets.NewCacheMetrics(r)
	for _, f := range incusMetrics(t) {
		if _, dup := r.families[f.name]; dup {
			t.Fatalf("%s is registered twice", f.name)
		}
		r.families[f.name] = f
	}
	// Cross-check against Gather: every gathered family must be known, with
	// the same type.
	got, err := r.reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	for _, mf := range got {
		f, ok := r.families[mf.GetName()]
		if !ok {
			t.Fatalf("gathered %s, which Describe did not report", mf.GetName())
		}
		gk := map[dto.MetricType]string{dto.MetricType_HISTOGRAM: "histogram", dto.MetricType_SUMMARY: "summary"}[mf.GetType()]
		if gk == "" {
			gk = "counter/gauge"
		}
		if gk != f.kind {
			t.Fatalf("%s: Gather says %s, this test decided %s", f.name, gk, f.kind)
		}
	}
	for name := range r.families {
		if !strings.HasPrefix(name, "incus_provider_") {
			t.Fatalf("registered metric %s lacks the incus_provider_ prefix", name)
		}
	}
	return r.families
}

// seriesNames is every name a query can select.
func seriesNames(fams map[string]family) map[string]bool {
	out := map[string]bool{}
	for _, f := range fams {
		for _, s := range f.series() {
			out[s] = true
		}
	}
	return out
}

func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// checkRefs fails for every provider metric name in text that the registry
// does not expose.
func checkRefs(t *testing.T, where, text string, known map[string]bool) {
	t.Helper()
	seen := map[string]bool{}
	for _, name := range metricName.FindAllString(text, -1) {
		if !known[name] && !seen[name] {
			seen[name] = true
			t.Errorf("%s references %s, which the provider does not expose (it exposes %s)", where, name, strings.Join(sortedKeys(known), ", "))
		}
	}
}

func read(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// collect walks a decoded JSON value and gathers the strings under key.
func collect(v any, key string, out *[]string) {
	switch v := v.(type) {
	case map[string]any:
		for k, child := range v {
			if s, ok := child.(string); ok && k == key {
				*out = append(*out, s)
				continue
			}
			collect(child, key, out)
		}
	case []any:
		for _, child := range v {
			collect(child, key, out)
		}
	}
}

func TestDashboardUsesOnlyRegisteredMetrics(t *testing.T) {
	fams := registered(t)
	known := seriesNames(fams)
	raw := read(t, dashboardFile)
	var dash map[string]any
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatalf("%s is not JSON: %v", dashboardFile, err)
	}

	var exprs []string
	collect(dash["panels"], "expr", &exprs)
	if len(exprs) == 0 {
		t.Fatalf("%s has no panel queries", dashboardFile)
	}
	used := map[string]bool{}
	for _, e := range exprs {
		checkRefs(t, dashboardFile+" expr "+strconv.Quote(e), e, known)
		for _, n := range metricName.FindAllString(e, -1) {
			used[n] = true
		}
	}
	// Template variable queries, and anything else in the file.
	var queries []string
	collect(dash["templating"], "query", &queries)
	collect(dash["templating"], "definition", &queries)
	for _, q := range queries {
		checkRefs(t, dashboardFile+" templating "+strconv.Quote(q), q, known)
	}
	checkRefs(t, dashboardFile, string(raw), known)

	// Every family has at least one panel.
	for name, f := range fams {
		if !slices.ContainsFunc(f.series(), func(s string) bool { return used[s] }) {
			t.Errorf("%s has no panel for %s", dashboardFile, name)
		}
	}
}

// projectWide are the gauges every replica serving a project reports for
// the whole project; summed across replicas they would count each target
// once per replica.
var projectWide = []string{"incus_provider_targets", "incus_provider_targets_by_member", "incus_provider_warm_instances"}

// TestDashboardCountsAProjectOnce: a panel that adds up a project-wide
// gauge takes one replica's value per project first (max by project), so
// two replicas behind a load balancer show the project's count, not twice
// it. Expressions that only take a maximum need no such step.
func TestDashboardCountsAProjectOnce(t *testing.T) {
	var dash map[string]any
	if err := json.Unmarshal(read(t, dashboardFile), &dash); err != nil {
		t.Fatal(err)
	}
	var exprs []string
	collect(dash["panels"], "expr", &exprs)
	for _, e := range exprs {
		for _, name := range projectWide {
			if !regexp.MustCompile(`\b` + name + `\{`).MatchString(e) {
				continue
			}
			if strings.Contains(e, "sum") && !strings.Contains(e, "max by (project") {
				t.Errorf("%s adds up %s across replicas: %s", dashboardFile, name, e)
			}
		}
	}
}

func TestDashboardUsesTheDatasourceVariable(t *testing.T) {
	var dash struct {
		UID        string `json:"uid"`
		Templating struct {
			List []struct {
				Name  string `json:"name"`
				Type  string `json:"type"`
				Query any    `json:"query"`
			} `json:"list"`
		} `json:"templating"`
		Panels []json.RawMessage `json:"panels"`
	}
	if err := json.Unmarshal(read(t, dashboardFile), &dash); err != nil {
		t.Fatal(err)
	}
	if dash.UID == "" {
		t.Error("the dashboard has no uid")
	}
	if !slices.ContainsFunc(dash.Templating.List, func(v struct {
		Name  string `json:"name"`
		Type  string `json:"type"`
		Query any    `json:"query"`
	}) bool {
		return v.Name == "datasource" && v.Type == "datasource" && v.Query == "prometheus"
	}) {
		t.Error(`the dashboard lacks a Prometheus datasource variable named "datasource"`)
	}
	type ds struct {
		Type string `json:"type"`
		UID  string `json:"uid"`
	}
	ids := map[int]bool{}
	for _, raw := range dash.Panels {
		var p struct {
			ID         int    `json:"id"`
			Type       string `json:"type"`
			Title      string `json:"title"`
			Datasource *ds    `json:"datasource"`
			Targets    []struct {
				Datasource *ds    `json:"datasource"`
				Expr       string `json:"expr"`
			} `json:"targets"`
		}
		if err := json.Unmarshal(raw, &p); err != nil {
			t.Fatal(err)
		}
		if ids[p.ID] {
			t.Errorf("panel id %d is used twice", p.ID)
		}
		ids[p.ID] = true
		if p.Type == "row" {
			continue
		}
		if p.Datasource == nil || p.Datasource.UID != "${datasource}" || p.Datasource.Type != "prometheus" {
			t.Errorf("panel %q does not use the ${datasource} Prometheus variable", p.Title)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no queries", p.Title)
		}
		for _, tg := range p.Targets {
			if tg.Datasource == nil || tg.Datasource.UID != "${datasource}" {
				t.Errorf("a query of panel %q does not use ${datasource}", p.Title)
			}
			if strings.TrimSpace(tg.Expr) == "" {
				t.Errorf("panel %q has an empty query", p.Title)
			}
		}
	}
}

type ruleFile struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []struct {
			Alert       string            `yaml:"alert"`
			Record      string            `yaml:"record"`
			Expr        string            `yaml:"expr"`
			For         string            `yaml:"for"`
			Labels      map[string]string `yaml:"labels"`
			Annotations map[string]string `yaml:"annotations"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

func TestAlertsUseOnlyRegisteredMetrics(t *testing.T) {
	known := seriesNames(registered(t))
	raw := read(t, alertsFile)
	var rf ruleFile
	dec := yaml.NewDecoder(strings.NewReader(string(raw)))
	dec.KnownFields(true)
	if err := dec.Decode(&rf); err != nil {
		t.Fatalf("%s is not a Prometheus rule file: %v", alertsFile, err)
	}
	if len(rf.Groups) == 0 {
		t.Fatalf("%s has no groups", alertsFile)
	}
	names := map[string]bool{}
	for _, g := range rf.Groups {
		if g.Name == "" || len(g.Rules) == 0 {
			t.Errorf("%s: group %q is unnamed or empty", alertsFile, g.Name)
		}
		for _, r := range g.Rules {
			if r.Alert == "" {
				t.Errorf("%s: group %q has a rule that is not an alert", alertsFile, g.Name)
				continue
			}
			if names[r.Alert] {
				t.Errorf("%s: alert %s is defined twice", alertsFile, r.Alert)
			}
			names[r.Alert] = true
			if strings.TrimSpace(r.Expr) == "" {
				t.Errorf("%s: alert %s has no expr", alertsFile, r.Alert)
			}
			checkRefs(t, alertsFile+" alert "+r.Alert, r.Expr, known)
			if r.Labels["severity"] == "" {
				t.Errorf("%s: alert %s has no severity label", alertsFile, r.Alert)
			}
			for _, a := range []string{"summary", "description"} {
				if strings.TrimSpace(r.Annotations[a]) == "" {
					t.Errorf("%s: alert %s has no %s annotation", alertsFile, r.Alert, a)
				}
				checkRefs(t, alertsFile+" alert "+r.Alert+" "+a, r.Annotations[a], known)
			}
		}
	}
	checkRefs(t, alertsFile, string(raw), known)
}

func TestMetricsDocListsEveryRegisteredMetric(t *testing.T) {
	fams := registered(t)
	readme := string(read(t, metricsDoc))
	readmeFile := metricsDoc
	_, section, ok := strings.Cut(readme, "\n## Metrics\n")
	if !ok {
		t.Fatalf("%s has no \"## Metrics\" section", readmeFile)
	}
	if i := strings.Index(section, "\n## "); i >= 0 {
		section = section[:i]
	}
	named := map[string]bool{}
	for _, name := range metricName.FindAllString(section, -1) {
		named[name] = true
		if _, ok := fams[name]; !ok {
			t.Errorf("%s's metrics section names %s, which is not registered", readmeFile, name)
		}
	}
	for name := range fams {
		if !named[name] {
			t.Errorf("%s's metrics section does not list the registered %s", readmeFile, name)
		}
	}
}

var envTag = regexp.MustCompile(`env:"([A-Za-z0-9_]+)"(?:\s+envDefault:"([^"]*)")?`)

func TestEnvExampleDocumentsEveryVariable(t *testing.T) {
	cfg := string(read(t, configFile))
	example := string(read(t, envExampleFile))
	matches := envTag.FindAllStringSubmatch(cfg, -1)
	if len(matches) == 0 {
		t.Fatalf("%s declares no env:\"…\" variables; update this test", configFile)
	}
	declared := map[string]bool{}
	for _, m := range matches {
		name, def := m[1], m[2]
		declared[name] = true
		line := regexp.MustCompile(`(?m)^#?` + regexp.QuoteMeta(name) + `=(.*)$`)
		got := line.FindAllStringSubmatch(example, -1)
		if len(got) == 0 {
			t.Errorf("%s does not document %s (declared in %s)", envExampleFile, name, configFile)
			continue
		}
		if def != "" && !slices.ContainsFunc(got, func(g []string) bool { return g[1] == def }) {
			t.Errorf("%s does not show %s's default %q", envExampleFile, name, def)
		}
	}
	for _, m := range regexp.MustCompile(`(?m)^#?([A-Z][A-Z0-9_]+)=`).FindAllStringSubmatch(example, -1) {
		if !declared[m[1]] {
			t.Errorf("%s documents %s, which %s does not declare", envExampleFile, m[1], configFile)
		}
	}
}

func TestSystemdUnit(t *testing.T) {
	unit := string(read(t, unitFile))
	for _, want := range []string{
		"Type=simple",
		"ExecStart=/usr/local/bin/incus-provider",
		"EnvironmentFile=/etc/incus-provider/provider.env",
		"Environment=PROVIDER_SETTINGS_FILE=/etc/incus-provider/provider.env",
		"Restart=on-failure",
		"User=root",
	} {
		if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(want) + `$`).MatchString(unit) {
			t.Errorf("%s lacks the line %q", unitFile, want)
		}
	}
	if !regexp.MustCompile(`(?m)^After=.*\bincus\.service\b`).MatchString(unit) {
		t.Errorf("%s does not order itself After=incus.service", unitFile)
	}
}

// maxExposure is the most `systemd-analyze security` may score the unit.
const maxExposure = 3.0

var exposure = regexp.MustCompile(`Overall exposure level for incus-provider\.service: ([0-9.]+)`)

// The unit is hardened (scored offline by systemd's own analyser) and
// valid (systemd-analyze verify, with ExecStart pointed at a real binary,
// since none is installed here), and it does not restart a refused setting.
func TestSystemdUnitHardenedAndValid(t *testing.T) {
	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Fatalf("systemd-analyze is needed to check %s (Debian: apt-get install systemd): %v", unitFile, err)
	}
	out, err := exec.Command(analyze, "security", "--offline=yes", unitFile).CombinedOutput()
	m := exposure.FindSubmatch(out)
	if m == nil {
		t.Fatalf("systemd-analyze security gave no score (%v):\n%s", err, out)
	}
	score, err := strconv.ParseFloat(string(m[1]), 64)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("systemd-analyze security --offline=yes: %.1f", score)
	if score > maxExposure {
		t.Errorf("%s scores %.1f, above %.1f:\n%s", unitFile, score, maxExposure, out)
	}

	unit := string(read(t, unitFile))
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	const exec0 = "ExecStart=/usr/local/bin/incus-provider\n"
	if !strings.Contains(unit, exec0) {
		t.Fatalf("%s lacks %q", unitFile, exec0)
	}
	tmp := filepath.Join(t.TempDir(), "incus-provider.service")
	if err := os.WriteFile(tmp, []byte(strings.Replace(unit, exec0, "ExecStart="+self+"\n", 1)), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(analyze, "verify", tmp).CombinedOutput(); err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Errorf("systemd-analyze verify %s: %v\n%s", unitFile, err, out)
	}

	// Exit 2 is a refused setting (cmd/incus-provider exitBadSetting): a
	// restart cannot fix it.
	if !regexp.MustCompile(`(?m)^RestartPreventExitStatus=2$`).MatchString(unit) {
		t.Errorf("%s does not stop restarting on exit 2", unitFile)
	}
	if !regexp.MustCompile(`(?m)^ExecReload=/bin/sh -c 'kill -HUP "\$\$MAINPID"'$`).MatchString(unit) {
		t.Errorf("%s does not reload with SIGHUP", unitFile)
	}
	if !regexp.MustCompile(`(?m)^CapabilityBoundingSet=CAP_SYS_ADMIN CAP_SYS_PTRACE$`).MatchString(unit) {
		t.Errorf("%s does not bound capabilities to what the netns dialer needs", unitFile)
	}
}

// Every incusd a script starts looks nothing up off this machine: each line
// that runs "$INCUSD" sets INCUS_SKIP_INSTANCE_TYPES=1.
func TestScriptsStartIncusdOffline(t *testing.T) {
	scripts := []string{"dev/incus-up.sh", "dev/incus-cluster-member.sh"}
	starts := 0
	for _, f := range scripts {
		for i, line := range strings.Split(string(read(t, f)), "\n") {
			if strings.HasPrefix(strings.TrimSpace(line), "#") || !strings.Contains(line, `setsid "$INCUSD"`) {
				continue
			}
			starts++
			if !strings.Contains(line, "INCUS_SKIP_INSTANCE_TYPES=1 ") {
				t.Errorf("%s:%d starts incusd without INCUS_SKIP_INSTANCE_TYPES=1: %s", f, i+1, strings.TrimSpace(line))
			}
		}
	}
	if starts < len(scripts) {
		t.Fatalf("found %d incusd starts in %v; update this test", starts, scripts)
	}
	if !strings.Contains(string(read(t, "dev/incus-up.sh")), "Environment=INCUS_SKIP_INSTANCE_TYPES=1") {
		t.Error("dev/incus-up.sh does not give a systemd-started incusd INCUS_SKIP_INSTANCE_TYPES=1")
	}
}

const (
	alertTestsFile = "prometheus/alerts_test.yaml"
	runbooksFile   = "prometheus/README.md"
)

// Every alert has a runbook_url naming a section of deploy/prometheus's
// README (a file in this repository, not a page to fetch), and a case in
// the promtool tests in which it fires.
func TestAlertsHaveRunbooksAndTests(t *testing.T) {
	var rf ruleFile
	dec := yaml.NewDecoder(strings.NewReader(string(read(t, alertsFile))))
	dec.KnownFields(true)
	if err := dec.Decode(&rf); err != nil {
		t.Fatal(err)
	}
	anchors := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^### (\S+)$`).FindAllStringSubmatch(string(read(t, runbooksFile)), -1) {
		anchors[strings.ToLower(m[1])] = true
	}
	var tests struct {
		RuleFiles []string `yaml:"rule_files"`
		Tests     []struct {
			AlertRuleTest []struct {
				Alertname string           `yaml:"alertname"`
				ExpAlerts []map[string]any `yaml:"exp_alerts"`
			} `yaml:"alert_rule_test"`
		} `yaml:"tests"`
	}
	if err := yaml.Unmarshal(read(t, alertTestsFile), &tests); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(tests.RuleFiles, []string{"alerts.yaml"}) {
		t.Errorf("%s tests %v, want alerts.yaml", alertTestsFile, tests.RuleFiles)
	}
	fires, quiet := map[string]bool{}, map[string]bool{}
	for _, tc := range tests.Tests {
		for _, a := range tc.AlertRuleTest {
			if len(a.ExpAlerts) > 0 {
				fires[a.Alertname] = true
			} else {
				quiet[a.Alertname] = true
			}
		}
	}
	n := 0
	for _, g := range rf.Groups {
		for _, r := range g.Rules {
			n++
			anchor, ok := strings.CutPrefix(r.Annotations["runbook_url"], runbooksDir+"README.md#")
			if !ok || !anchors[anchor] {
				t.Errorf("alert %s: runbook_url %q does not name a section of %s", r.Alert, r.Annotations["runbook_url"], runbooksFile)
			}
			if anchor != strings.ToLower(r.Alert) {
				t.Errorf("alert %s: its runbook is the section named after it, not %q", r.Alert, anchor)
			}
			if !fires[r.Alert] {
				t.Errorf("alert %s has no case in %s in which it fires", r.Alert, alertTestsFile)
			}
		}
	}
	if n == 0 {
		t.Fatal("no alerts read")
	}
	t.Logf("%d alerts, %d with a quiet case too", n, len(quiet))
}

// runbooksDir is where runbook_url points, from the repository's root.
const runbooksDir = "deploy/prometheus/"

// docs/configuration.md's configuration section names every variable
// config.go reads (--help prints the reference itself from config.go; this
// keeps the table from missing one).
func TestConfigDocNamesEveryVariable(t *testing.T) {
	readme := string(read(t, configDoc))
	readmeFile := configDoc
	_, section, ok := strings.Cut(readme, "\n## Configuration\n")
	if !ok {
		t.Fatalf("%s has no \"## Configuration\" section", readmeFile)
	}
	if i := strings.Index(section, "\n## "); i >= 0 {
		section = section[:i]
	}
	matches := envTag.FindAllStringSubmatch(string(read(t, configFile)), -1)
	if len(matches) == 0 {
		t.Fatalf("%s declares no variables; update this test", configFile)
	}
	for _, m := range matches {
		if !strings.Contains(section, "`"+m[1]+"`") {
			t.Errorf("%s's configuration section does not name %s", readmeFile, m[1])
		}
	}
}

// The README is the overview a newcomer reads first: its two commands, what
// the provider is, the architecture, and where the rest lives. Everything
// else is under docs/; a README that grows past this has taken in a
// document.
func TestReadmeIsAnOverview(t *testing.T) {
	const most = 15 << 10
	readme := read(t, readmeFile)
	if len(readme) > most {
		t.Errorf("%s is %d bytes, over %d: move what is not an overview to docs/", readmeFile, len(readme), most)
	}
	head := strings.Join(strings.SplitN(string(readme), "\n", 8)[:7], "\n")
	for _, cmd := range []string{"make run ", "make test "} {
		if !strings.Contains(head, "    "+cmd) {
			t.Errorf("%s's first lines do not give %q", readmeFile, cmd)
		}
	}
	for _, m := range regexp.MustCompile(`\]\(((?:docs/)?[A-Za-z]+\.md)(#[a-z0-9-]+)?\)`).FindAllStringSubmatch(string(readme), -1) {
		if _, err := os.Stat(filepath.Join("..", m[1])); err != nil {
			t.Errorf("%s links to %s, which is not there", readmeFile, m[1])
		}
	}
}

// docs/operations.md has what an operator looks for, each under its own
// heading.
func TestOperationsDocCoversOperations(t *testing.T) {
	doc := string(read(t, operationsDoc))
	for _, h := range []string{"## Install", "### From a release build", "### As a systemd unit", "### As a container",
		"## Upgrade and rollback", "## Backup and restore", "## Troubleshooting by symptom", "## Security model", "## Versions"} {
		if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(h) + `$`).MatchString(doc) {
			t.Errorf("%s has no heading %q", operationsDoc, h)
		}
	}
}

// CHANGELOG.md's newest entry is the version VERSION holds.
func TestChangelogNamesTheVersion(t *testing.T) {
	version := strings.TrimSpace(string(read(t, "../internal/buildinfo/VERSION")))
	if !regexp.MustCompile(`^[0-9]+\.[0-9]+\.[0-9]+$`).MatchString(version) {
		t.Fatalf("VERSION holds %q, not MAJOR.MINOR.PATCH", version)
	}
	first := regexp.MustCompile(`(?m)^## ([0-9]+\.[0-9]+\.[0-9]+)`).FindStringSubmatch(string(read(t, "../CHANGELOG.md")))
	if first == nil || first[1] != version {
		t.Errorf("CHANGELOG.md's newest entry is %v, VERSION says %s", first, version)
	}
}
