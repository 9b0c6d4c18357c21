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
