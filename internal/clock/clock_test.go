package clock

import (
	"context"
	"testing"
	"time"
)

func TestSleepWaitsTheWholeDuration(t *testing.T) {
	start := time.Now()
	if !Sleep(context.Background(), 20*time.Millisecond) {
		t.Fatal("Sleep with a live context reported it ended")
	}
	if took := time.Since(start); took < 20*time.Millisecond {
		t.Fatalf("Sleep returned after %v, before its 20ms", took)
	}
}

func TestSleepEndsWithItsContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(10*time.Millisecond, cancel)
	start := time.Now()
	if Sleep(ctx, time.Hour) {
		t.Fatal("Sleep reported the hour passed")
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("Sleep took %v to notice the cancel", took)
	}
	if Sleep(ctx, time.Hour) {
		t.Fatal("Sleep with an ended context reported the hour passed")
	}
}
