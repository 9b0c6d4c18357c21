package routes

import (
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
)

func TestParsePath(t *testing.T) {
	ok := []struct {
		path string
		want Route
	}{
		{"/routes/u1/env_1/ls-0123456789abcdef0123", Route{controller.Owner{UniverseID: "u1", EnvironmentID: "env_1"}, "ls-0123456789abcdef0123"}},
		// Each segment is percent-decoded on its own: an encoded "/" stays
		// inside the target id, and encoded unreserved characters decode.
		{"/routes/u%31/e%3A2/a%2Fb", Route{controller.Owner{UniverseID: "u1", EnvironmentID: "e:2"}, "a/b"}},
		{"/routes/U.1/E-2/t%20x", Route{controller.Owner{UniverseID: "U.1", EnvironmentID: "E-2"}, "t x"}},
		{"/routes/u/e/%C3%A9t%C3%A9", Route{controller.Owner{UniverseID: "u", EnvironmentID: "e"}, "été"}},
	}
	for _, c := range ok {
		got, err := ParsePath("/routes", c.path)
		if err != nil {
			t.Errorf("%s: %v", c.path, err)
			continue
		}
		if got != c.want {
			t.Errorf("%s: got %+v, want %+v", c.path, got, c.want)
		}
		// Path is ParsePath's inverse.
		if again, err := ParsePath("/routes", Path("/routes", got)); err != nil || again != got {
			t.Errorf("Path(%+v) = %s does not parse back: %+v, %v", got, Path("/routes", got), again, err)
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
		_, err := ParsePath("/routes", c.path)
		var pe *PathError
		if !errors.As(err, &pe) {
			t.Errorf("%s: got %v, want a PathError", c.path, err)
			continue
		}
		if pe.Status != c.status || pe.Message == "" {
			t.Errorf("%s: status %d (%q), want %d", c.path, pe.Status, pe.Message, c.status)
		}
	}
	// Longest ids allowed.
	long := "/routes/" + strings.Repeat("u", 128) + "/" + strings.Repeat("e", 128) + "/" + strings.Repeat("t", 255)
	if _, err := ParsePath("/routes", long); err != nil {
		t.Errorf("longest ids: %v", err)
	}
}

func TestRefusalWrite(t *testing.T) {
	cases := []struct {
		ref        *Refusal
		status     int
		body       string
		retryAfter string
	}{
		{refuse(StateWaking, 0), 503, `{"state":"waking"}`, "1"},
		{refuse(StateWaking, 1500*time.Millisecond), 503, `{"state":"waking"}`, "2"},
		{refuse(StateBooting, time.Hour), 503, `{"state":"booting"}`, "60"},
		{refuse(StateBooting, -time.Second), 503, `{"state":"booting"}`, "1"},
		{refuse(StateGone, 5*time.Second), 410, `{"state":"gone"}`, ""},
		{&Refusal{State: StateFailed, Message: "disk\x00 broken\n"}, 409, `{"state":"failed","message":"disk broken"}`, ""},
		{&Refusal{State: StateFailed}, 409, `{"state":"failed","message":"` + defaultFailedMessage + `"}`, ""},
		{&Refusal{State: StateFailed, Message: strings.Repeat("é", 600)}, 409, "", ""},
	}
	for _, c := range cases {
		rec := httptest.NewRecorder()
		c.ref.Write(rec)
		if rec.Code != c.status {
			t.Errorf("%v: status %d, want %d", c.ref, rec.Code, c.status)
		}
		if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
			t.Errorf("%v: Content-Type %q", c.ref, ct)
		}
		if got := rec.Header().Get("Retry-After"); got != c.retryAfter {
			t.Errorf("%v: Retry-After %q, want %q", c.ref, got, c.retryAfter)
		}
		if c.body != "" && rec.Body.String() != c.body {
			t.Errorf("%v: body %s, want %s", c.ref, rec.Body.String(), c.body)
		}
		// Every body decodes strictly as the contract's shape.
		var body struct {
			State   string `json:"state"`
			Message string `json:"message"`
		}
		dec := json.NewDecoder(rec.Body)
		dec.DisallowUnknownFields()
		if err := dec.Decode(&body); err != nil {
			t.Errorf("%v: body does not decode: %v", c.ref, err)
		}
		if c.ref.State == StateFailed && (len(body.Message) == 0 || len(body.Message) > 1024) {
			t.Errorf("%v: message of %d bytes", c.ref, len(body.Message))
		}
		if c.ref.State != StateFailed && body.Message != "" {
			t.Errorf("%v: a message on a %s refusal", c.ref, c.ref.State)
		}
		if c.ref.State.Status() != c.status {
			t.Errorf("%s: Status() = %d", c.ref.State, c.ref.State.Status())
		}
	}
	if http.StatusText(StateWaking.Status()) != "Service Unavailable" {
		t.Fatal("waking is not a 503")
	}
}
