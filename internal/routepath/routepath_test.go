package routepath

import (
	"errors"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	ok := []struct {
		path string
		want IDs
	}{
		{"/routes/u1/env_1/ls-0123456789abcdef0123", IDs{"u1", "env_1", "ls-0123456789abcdef0123"}},
		// Each segment is percent-decoded on its own: an encoded "/" stays
		// inside the target id, and encoded unreserved characters decode.
		{"/routes/u%31/e%3A2/a%2Fb", IDs{"u1", "e:2", "a/b"}},
		{"/routes/U.1/E-2/t%20x", IDs{"U.1", "E-2", "t x"}},
		{"/routes/u/e/%C3%A9t%C3%A9", IDs{"u", "e", "été"}},
	}
	for _, c := range ok {
		got, err := Parse("/routes", c.path)
		if err != nil {
			t.Errorf("%s: %v", c.path, err)
			continue
		}
		if got != c.want {
			t.Errorf("%s: got %+v, want %+v", c.path, got, c.want)
		}
		// Format is Parse's inverse.
		if again, err := Parse("/routes", Format("/routes", got)); err != nil || again != got {
			t.Errorf("Format(%+v) = %s does not parse back: %+v, %v", got, Format("/routes", got), again, err)
		}
	}

	bad := []struct {
		path   string
		status int
	}{
		{"/route/u/e/t", 404},
		{"/routes", 404},
		{"/routes/", 404},
		{"/routes/u/e", 404},
		{"/routes/u/e/t/x", 404},
		{"/routes/u//t", 404},
		{"/routes//e/t", 404},
		{"/routes/u/e/", 404},
		{"/routesx/u/e/t", 404},
		{"/routes/u/e/%zz", 400},   // not percent-encoding
		{"/routes/u/e/%4", 400},    // truncated escape
		{"/routes/u%2Fx/e/t", 400}, // "/" is outside the Lightspeed id grammar
		{"/routes/_u/e/t", 400},    // must start with a letter or digit
		{"/routes/u/e%20x/t", 400}, // space
		{"/routes/u/e/t%00", 400},  // control character in the target id
		{"/routes/u/e/t%0A", 400},  // line feed too
		{"/routes/u/e/%FF", 400},   // not UTF-8
		{"/routes/" + strings.Repeat("u", 129) + "/e/t", 400},
		{"/routes/u/e/" + strings.Repeat("t", 256), 400},
	}
	for _, c := range bad {
		_, err := Parse("/routes", c.path)
		var pe *Error
		if !errors.As(err, &pe) {
			t.Errorf("%s: got %v, want an *Error", c.path, err)
			continue
		}
		if pe.Status != c.status || pe.Message == "" {
			t.Errorf("%s: status %d (%q), want %d", c.path, pe.Status, pe.Message, c.status)
		}
	}
	// Longest ids allowed.
	long := "/routes/" + strings.Repeat("u", 128) + "/" + strings.Repeat("e", 128) + "/" + strings.Repeat("t", 255)
	if _, err := Parse("/routes", long); err != nil {
		t.Errorf("longest ids: %v", err)
	}
}
