package ingressurl

import (
	"strings"
	"testing"
)

func TestParseAndLabel(t *testing.T) {
	b, err := Parse("https://{label}.env.example.com")
	if err != nil {
		t.Fatal(err)
	}
	l := NewLabel()
	if !Valid(l) || l == NewLabel() {
		t.Fatalf("label %q is not a fresh valid label", l)
	}
	ep := b.Endpoint(l)
	if ep != "https://"+l+".env.example.com" {
		t.Fatalf("endpoint %q", ep)
	}
	for host, want := range map[string]bool{
		l + ".env.example.com":                      true,
		strings.ToUpper(l) + ".ENV.example.com:443": true,
		l + ".env.example.com.":                     true,
		"x" + l + ".env.example.com":                false,
		l + ".other.example.com":                    false,
		"a.b.env.example.com":                       false,
		".env.example.com":                          false,
		"":                                          false,
	} {
		got, ok := b.Label(host)
		if ok != want || (ok && got != l) {
			t.Errorf("Label(%q) = %q, %t; want ok=%t", host, got, ok, want)
		}
	}
	if _, err := Parse(DefaultBase); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"ftp://{label}.x.com", "https://x.com", "https://{label}{label}.x.com",
		"https://a{label}.x.com/path", "https://{label}", "https://a.{label}.com", "https://u@{label}.x.com"} {
		if _, err := Parse(bad); err == nil {
			t.Errorf("Parse(%q) accepted", bad)
		}
	}
}

// TestBaseIsCanonicalWhateverItsCase: an operator's HTTPS://{label}.Env.Example.COM
// hands out https://….env.example.com endpoints and forwards the scheme
// https, as the lowercase base does.
func TestBaseIsCanonicalWhateverItsCase(t *testing.T) {
	for _, c := range []struct{ base, endpoint, scheme string }{
		{"HTTPS://{label}.Env.Example.COM", "https://L.env.example.com", "https"},
		{"Https://{label}.env.example.com:8443/", "https://L.env.example.com:8443", "https"},
		{"HTTP://{label}.LOCALHOST:8482", "http://L.localhost:8482", "http"},
		{"http://{label}.localhost:8482", "http://L.localhost:8482", "http"},
	} {
		b, err := Parse(c.base)
		if err != nil {
			t.Fatalf("%s: %v", c.base, err)
		}
		if got := b.Endpoint("L"); got != c.endpoint || b.Scheme() != c.scheme {
			t.Errorf("%s: endpoint %s, scheme %s; want %s, %s", c.base, got, b.Scheme(), c.endpoint, c.scheme)
		}
	}
}
