package targets

import (
	"fmt"
	"testing"
	"time"
)

func TestClosedTableRemembersForAWhile(t *testing.T) {
	var c closedTable
	t0 := time.Unix(1_800_000_000, 0)
	c.note("a", t0)
	if !c.has("a", t0.Add(closedMemory-time.Second)) {
		t.Fatal("a closed answer was forgotten within closedMemory")
	}
	if c.has("a", t0.Add(closedMemory)) {
		t.Fatal("a closed answer was remembered past closedMemory")
	}
	if c.has("b", t0) {
		t.Fatal("a name never answered closed is remembered")
	}
	c.forget("a")
	if c.has("a", t0) {
		t.Fatal("a forgotten name is still remembered")
	}
	// Noted again after it was forgotten: remembered from the new time.
	c.note("a", t0.Add(time.Minute))
	c.note("z", t0.Add(closedMemory+time.Second)) // prunes the first "a" entry
	if !c.has("a", t0.Add(closedMemory+time.Second)) {
		t.Fatal("a name noted again lost its newer time to its older entry")
	}
}

func TestClosedTableIsBounded(t *testing.T) {
	var c closedTable
	t0 := time.Unix(1_800_000_000, 0)
	n := closedMost + 1000
	for i := range n {
		c.note(fmt.Sprintf("n%d", i), t0.Add(time.Duration(i)*time.Microsecond))
		if i%3 == 0 {
			c.forget(fmt.Sprintf("n%d", i))
		}
	}
	now := t0.Add(time.Second)
	if len(c.at) > closedMost {
		t.Fatalf("%d names held, more than closedMost %d", len(c.at), closedMost)
	}
	if len(c.order) > 2*len(c.at)+64 {
		t.Fatalf("%d order entries for %d names: never compacted", len(c.order), len(c.at))
	}
	if !c.has(fmt.Sprintf("n%d", n-1), now) {
		t.Fatal("the newest closed answer was dropped")
	}
	// Everything expires with time, in one later note.
	c.note("last", t0.Add(closedMemory+2*time.Second))
	if len(c.at) != 1 {
		t.Fatalf("%d names held after all but one expired", len(c.at))
	}
}
