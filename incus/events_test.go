package incus

import (
	"errors"
	"slices"
	"testing"
)

func TestDecodeEvent(t *testing.T) {
	types := []string{EventLifecycle, EventOperation}
	for _, tc := range []struct {
		name, raw string
		want      []string // instances of project p; nil with ok false when unnamed
		ok        bool
		malformed bool
	}{
		{name: "lifecycle", raw: `{"type":"lifecycle","project":"p","metadata":{"action":"instance-started","source":"/1.0/instances/a?project=p","extra":1},"new_field":true}`,
			want: []string{"a"}, ok: true},
		{name: "rename names both", raw: `{"type":"lifecycle","project":"p","metadata":{"action":"instance-renamed","source":"/1.0/instances/b?project=p","context":{"old_name":"a"}}}`,
			want: []string{"b", "a"}, ok: true},
		{name: "snapshot is its instance's", raw: `{"type":"lifecycle","project":"p","metadata":{"action":"instance-snapshot-created","source":"/1.0/instances/a/snapshots/s?project=p"}}`,
			want: []string{"a"}, ok: true},
		{name: "another project", raw: `{"type":"lifecycle","project":"q","metadata":{"action":"instance-started","source":"/1.0/instances/a?project=q"}}`,
			ok: true},
		{name: "no project: the source tells (LXD)", raw: `{"type":"lifecycle","metadata":{"action":"instance-started","source":"/1.0/instances/a?project=p"}}`,
			want: []string{"a"}, ok: true},
		{name: "not an instance", raw: `{"type":"lifecycle","project":"p","metadata":{"action":"network-updated","source":"/1.0/networks/n"}}`,
			ok: true},
		{name: "operation", raw: `{"type":"operation","project":"p","metadata":{"id":"x","status_code":103,"resources":{"instances":["/1.0/instances/a?project=p","/1.0/instances/b?project=p"]}}}`,
			want: []string{"a", "b"}, ok: true},
		{name: "instances path without a name", raw: `{"type":"lifecycle","project":"p","metadata":{"action":"instance-started","source":"/1.0/instances"}}`},
		{name: "not JSON", raw: `{"type":`, malformed: true},
		{name: "a type not asked for", raw: `{"type":"logging","metadata":{"message":"x"}}`, malformed: true},
		{name: "metadata not an object", raw: `{"type":"lifecycle","metadata":[1]}`, malformed: true},
		{name: "lifecycle without action", raw: `{"type":"lifecycle","metadata":{"source":"/1.0/instances/a"}}`, malformed: true},
		{name: "lifecycle field of the wrong type", raw: `{"type":"lifecycle","metadata":{"action":1,"source":"/1.0/instances/a"}}`, malformed: true},
		{name: "operation without id", raw: `{"type":"operation","metadata":{"status_code":103}}`, malformed: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ev, err := decodeEvent([]byte(tc.raw), types)
			if tc.malformed {
				if !errors.Is(err, ErrMalformedEvent) {
					t.Fatalf("decoded %+v, %v; want ErrMalformedEvent", ev, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got, ok := ev.Instances("p")
			if ok != tc.ok || !slices.Equal(got, tc.want) {
				t.Fatalf("Instances = %v, %v; want %v, %v", got, ok, tc.want, tc.ok)
			}
		})
	}
}

func TestWroteInstances(t *testing.T) {
	for _, tc := range []struct {
		r    request
		want []string
	}{
		{request{method: "POST", scoped: true, path: "/1.0/instances", body: InstancesPost{Name: "a"}}, []string{"a"}},
		{request{method: "PATCH", scoped: true, path: instancePath("a")}, []string{"a"}},
		{request{method: "PUT", scoped: true, path: instancePath("a") + "/state"}, []string{"a"}},
		{request{method: "POST", scoped: true, path: instancePath("a"), body: map[string]string{"name": "b"}}, []string{"a", "b"}},
		{request{method: "POST", scoped: true, path: instancePath("a") + "/exec"}, nil},
		{request{method: "GET", scoped: true, path: instancePath("a")}, nil},
		{request{method: "DELETE", scoped: true, path: "/1.0/projects/x"}, nil},
	} {
		if got := wroteInstances(tc.r); !slices.Equal(got, tc.want) {
			t.Errorf("%s %s: %v, want %v", tc.r.method, tc.r.path, got, tc.want)
		}
	}
}
