package main

import (
	"encoding/json"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// sample is one exposed series.
type sample struct {
	name   string
	labels map[string]string
	value  float64
}

var sampleLine = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$`)
var labelPair = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"`)

func (c *child) scrape(t *testing.T) []sample {
	t.Helper()
	var out []sample
	for _, line := range c.scrapeLines(t) {
		m := sampleLine.FindStringSubmatch(line)
		if m == nil || strings.HasPrefix(line, "#") {
			continue
		}
		v, err := strconv.ParseFloat(m[3], 64)
		if err != nil {
			t.Fatalf("sample %q: %v", line, err)
		}
		s := sample{name: m[1], labels: map[string]string{}, value: v}
		for _, p := range labelPair.FindAllStringSubmatch(m[2], -1) {
			s.labels[p[1]] = p[2]
		}
		out = append(out, s)
	}
	return out
}

// selector is one metric selection in PromQL: a name and its matchers.
var selector = regexp.MustCompile(`(incus_provider_[a-z_]+)\{([^}]*)\}`)
var matcher = regexp.MustCompile(`([a-z_]+)\s*(=~|!~|!=|=)\s*"([^"]*)"`)

// queries are every alert expression and dashboard query in deploy/.
func queries(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{}
	var rules struct {
		Groups []struct {
			Rules []struct {
				Alert string `yaml:"alert"`
				Expr  string `yaml:"expr"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	raw, err := os.ReadFile("../../deploy/prometheus/alerts.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(raw, &rules); err != nil {
		t.Fatal(err)
	}
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			out["alert "+r.Alert] = r.Expr
		}
	}
	raw, err = os.ReadFile("../../deploy/grafana/incus-provider.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatal(err)
	}
	for _, p := range dash.Panels {
		for i, tg := range p.Targets {
			out["panel "+p.Title+" #"+strconv.Itoa(i)] = tg.Expr
		}
	}
	return out
}

// A fresh process exposes, before any event, every series that an alert
// or a dashboard panel selects: each value an equality or an alternation
// names exists (at zero), so rate() and increase() count the first event.
func TestFreshProcessExposesEverySelectedSeries(t *testing.T) {
	// With its public ingress edge on, as it ships: the ingress panels'
	// series are the edge's.
	edge := freePort(t)
	c := startProvider(t, "PROVIDER_INGRESS_LISTEN="+edge, "PROVIDER_INGRESS_BASE_URL=http://{label}.localhost:"+edge[strings.LastIndexByte(edge, ':')+1:])
	samples := c.scrape(t)
	exists := func(name, label, value string) bool {
		for _, s := range samples {
			if s.name == name && (label == "" || s.labels[label] == value) {
				return true
			}
		}
		return false
	}
	checked := 0
	for where, expr := range queries(t) {
		for _, sel := range selector.FindAllStringSubmatch(expr, -1) {
			name := sel[1]
			if name == "incus_provider_targets_by_member" || name == "incus_provider_peer_dials_total" {
				// Per cluster member: a standalone server has none. On a
				// cluster every phase of a member appears (at zero) with its
				// first target, and every outcome of each member in
				// PROVIDER_PEERS from the start (TestClusterForwardedDials).
				continue
			}
			if !exists(name, "", "") {
				t.Errorf("%s selects %s, which a fresh process does not expose", where, name)
				continue
			}
			for _, m := range matcher.FindAllStringSubmatch(sel[2], -1) {
				label, op, value := m[1], m[2], m[3]
				if label == "job" || label == "instance" || op == "!=" || op == "!~" {
					continue
				}
				values := []string{value}
				if op == "=~" {
					if !regexp.MustCompile(`^[a-z_|]+$`).MatchString(value) {
						continue // a pattern, not a list of values
					}
					values = strings.Split(value, "|")
				}
				for _, v := range values {
					checked++
					if !exists(name, label, v) {
						t.Errorf("%s selects %s{%s=%q}, which a fresh process does not expose", where, name, label, v)
					}
				}
			}
		}
	}
	if checked < 20 {
		t.Fatalf("only %d labelled selections checked; the parsing here missed them", checked)
	}
	// The build, and zero for the error series alerts divide by.
	for _, want := range []struct {
		name   string
		labels map[string]string
	}{
		{"incus_provider_build_info", map[string]string{"version": testVersion}},
		{"incus_provider_controller_requests_total", map[string]string{"method": "target/create", "kind": "internal"}},
		{"incus_provider_incus_requests_total", map[string]string{"operation": "instance.create", "status": "transport"}},
		{"incus_provider_incus_endpoint_requests_total", map[string]string{"endpoint": "unix", "status": "timeout"}},
		{"incus_provider_route_wake_duration_seconds_count", map[string]string{"from": "stopped", "outcome": "ready"}},
	} {
		found := false
		for _, s := range samples {
			if s.name != want.name {
				continue
			}
			match := true
			for k, v := range want.labels {
				match = match && s.labels[k] == v
			}
			if match {
				found = true
				wantValue := 0.0
				if want.name == "incus_provider_build_info" {
					wantValue = 1
					if s.labels["goversion"] == "" || s.labels["target"] == "" {
						t.Errorf("build_info lacks goversion or target: %v", s.labels)
					}
				}
				if s.value != wantValue {
					t.Errorf("%s%v = %v on a fresh process, want %v", want.name, want.labels, s.value, wantValue)
				}
			}
		}
		if !found {
			t.Errorf("a fresh process does not expose %s%v", want.name, want.labels)
		}
	}
}
