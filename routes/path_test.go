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
	"github.com/lightspeed-dev/incus-provider/wake"
)

// ParsePath and Path are internal/routepath's parser and encoder (tested
// there against the contract); what is left here is the mapping to a Route
// and that a refusal is still a *PathError with its status.
func TestParsePath(t *testing.T) {
	want := Route{controller.Owner{UniverseID: "u1", EnvironmentID: "e:2"}, "a/b"}
	got, err := ParsePath("/routes", "/routes/u%31/e%3A2/a%2Fb")
	if err != nil || got != want {
		t.Fatalf("got %+v, %v; want %+v", got, err, want)
	}
	if p := Path("/routes", want); p != "/routes/u1/e%3A2/a%2Fb" {
		t.Fatalf("Path(%+v) = %s", want, p)
	}
	for path, status := range map[string]int{"/routes/u/e": http.StatusNotFound, "/routes/u/e/%zz": http.StatusBadRequest} {
		got, err := ParsePath("/routes", path)
		var pe *PathError
		if !errors.As(err, &pe) || pe.Status != status || got != (Route{}) {
			t.Errorf("%s: got %+v, %v; want a *PathError %d", path, got, err, status)
		}
	}
}

func TestRefusalWrite(t *testing.T) {
	cases := []struct {
		ref        *wake.Refusal
		status     int
		body       string
		retryAfter string
	}{
		{refuse(wake.StateWaking, 0), 503, `{"state":"waking"}`, "1"},
		{refuse(wake.StateWaking, 1500*time.Millisecond), 503, `{"state":"waking"}`, "2"},
		{refuse(wake.StateBooting, time.Hour), 503, `{"state":"booting"}`, "60"},
		{refuse(wake.StateBooting, -time.Second), 503, `{"state":"booting"}`, "1"},
		{refuse(wake.StateGone, 5*time.Second), 410, `{"state":"gone"}`, ""},
		{&wake.Refusal{State: wake.StateFailed, Message: "disk\x00 broken\n"}, 409, `{"state":"failed","message":"disk broken"}`, ""},
		{&wake.Refusal{State: wake.StateFailed}, 409, `{"state":"failed","message":"` + wake.DefaultFailedMessage + `"}`, ""},
		{&wake.Refusal{State: wake.StateFailed, Message: strings.Repeat("é", 600)}, 409, "", ""},
	}
	for _, c := range cases {
		rec := httptest.NewRecorder()
		writeRefusal(rec, c.ref)
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
		if c.ref.State == wake.StateFailed && (len(body.Message) == 0 || len(body.Message) > 1024) {
			t.Errorf("%v: message of %d bytes", c.ref, len(body.Message))
		}
		if c.ref.State != wake.StateFailed && body.Message != "" {
			t.Errorf("%v: a message on a %s refusal", c.ref, c.ref.State)
		}
		if statusOf(c.ref.State) != c.status {
			t.Errorf("%s: statusOf = %d", c.ref.State, statusOf(c.ref.State))
		}
	}
	if http.StatusText(statusOf(wake.StateWaking)) != "Service Unavailable" {
		t.Fatal("waking is not a 503")
	}
}
