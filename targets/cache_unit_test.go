package targets

import (
	"testing"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/incus"
)

func newTestCache(t *testing.T) *obsCache {
	t.Helper()
	client, err := incus.New(incus.Config{Socket: "/nonexistent/unix.socket"})
	if err != nil {
		t.Fatal(err)
	}
	c := newObsCache(client, zap.NewNop(), nil, 0, nil)
	c.connected, c.confirmed = true, true
	return c
}

func running(name, v string) *incus.Instance {
	return &incus.Instance{Name: name, Status: incus.InstanceRunning, Config: map[string]string{"user.v": v}}
}

// The rules that keep reads truthful, without Incus: a read begun before
// a touch, or before the stream was up, is never stored; a touched entry
// is not served; an unconfirmed cache serves nothing.
func TestCacheStoresOnlyReadsNewerThanEveryTouch(t *testing.T) {
	c := newTestCache(t)
	c.offer("a", c.mark("a"), running("a", "1"))
	if inst, hit := c.get("a"); !hit || inst.Config["user.v"] != "1" {
		t.Fatalf("a stored read is not served: %v %+v", hit, inst)
	}

	at := c.mark("a")
	c.touch("a", "", false) // an event or a write of this process, while the read is out
	c.offer("a", at, running("a", "2"))
	if _, hit := c.get("a"); hit {
		t.Fatal("a touched entry is served before it was read again")
	}
	c.offer("a", c.mark("a"), running("a", "3"))
	if inst, hit := c.get("a"); !hit || inst.Config["user.v"] != "3" {
		t.Fatalf("a read after the touch is not served: %v %+v", hit, inst)
	}

	c.connected = false
	at = c.mark("b")
	c.connected = true
	c.epoch++ // what a new session does
	c.offer("b", at, running("b", "1"))
	if inst, hit := c.get("b"); !hit || inst != nil {
		t.Fatalf("a read begun while the stream was down was stored: %v %+v", hit, inst)
	}

	c.touch("gone", "", false)
	c.offer("gone", c.mark("gone"), nil)
	if inst, hit := c.get("gone"); !hit || inst != nil {
		t.Fatalf("an instance read as not found is not answered as absent: %v %+v", hit, inst)
	}

	c.offer("err", c.mark("err"), &incus.Instance{Name: "err", Status: incus.InstanceError})
	if _, hit := c.get("err"); hit {
		t.Fatal("an instance in status Error is served from the cache")
	}

	// The listing names what it may show from before a write: an entry
	// touched and not read again since.
	c.touch("a", "", false)
	list, stale, ok := c.listing()
	if !ok || !stale["a"] || stale["b"] || len(list) == 0 {
		t.Fatalf("a touched entry is not named stale in the listing: %v %v", stale, ok)
	}
	c.offer("a", c.mark("a"), running("a", "4"))
	if _, stale, _ := c.listing(); stale["a"] {
		t.Fatal("an entry read again after its touch is still named stale")
	}

	c.unconfirm("stream_ended")
	if _, hit := c.get("a"); hit {
		t.Fatal("an unconfirmed cache serves a read")
	}
	if _, _, ok := c.listing(); ok {
		t.Fatal("an unconfirmed cache serves a listing")
	}
}

func TestCacheOverflowingQueueAsksForAList(t *testing.T) {
	c := newTestCache(t)
	for i := range rereadQueue + 1 {
		c.touch("i"+string(rune('a'+i%26))+string(rune(i)), "", false)
	}
	select {
	case <-c.relist:
	default:
		t.Fatal("touches beyond the re-read queue did not ask for a full list")
	}
}
