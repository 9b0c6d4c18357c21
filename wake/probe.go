package wake

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/clock"
	"github.com/lightspeed-dev/incus-provider/internal/envd"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/targets"
)

// probeAnswer is what the readiness probe found of a daemon.
type probeAnswer int

const (
	// probeSilent: no answer to initialize yet (see probeUntil).
	probeSilent probeAnswer = iota
	// probeReady: a data-plane initialize success of this version.
	probeReady
	// probeIncompatible: an answer all the same, such as versionMismatch
	// or a result of another plane (an *envd.AnsweredError). The daemon is
	// there; the runtime's own handshake meets the answer and fails the
	// environment if it must, which a refusal as booting would keep it
	// from ever doing.
	probeIncompatible
)

func (a probeAnswer) outcome() string {
	if a == probeIncompatible {
		return outcomeIncompatible
	}
	return outcomeReady
}

// wakeFailed logs a wake's failure, which the flight retries. A busy
// refusal can only come from outside this process (another replica, an
// operator: targets holds one writer per instance) and is routine.
func (w *Waker) wakeFailed(msg, instance string, err error) {
	log := w.log.Warn
	if errors.Is(err, incus.ErrBusy) {
		log = w.log.Info
	}
	log(msg, zap.String("instance", instance), zap.Error(err))
}

// probeUntil proves the daemon answers: a data-plane initialize through the
// GuestDialer, repeated with a short backoff until it is answered or ctx
// ends. A TCP connect alone proves nothing (a frozen guest's kernel accepts
// it), nor does a WebSocket upgrade (a daemon's listener may be up before
// it serves), nor a frame that is no JSON-RPC response to the request
// (something other than a daemon of any version holds the port): these
// keep the target booting, so the runtime is told to come back. An answer
// that is not a compatible success ends the probe like a success.
//
// The flight's trace, when it has one, gets every attempt; the caller owns
// it meanwhile. A device that stays dead on a running instance is
// restarted once per flight (restartDeadDevice).
func (w *Waker) probeUntil(ctx context.Context, f *Flight, r targets.Route) probeAnswer {
	tr := f.trace
	delay := 5 * time.Millisecond
	var deviceDownSince time.Time
	for {
		var start time.Time
		if tr != nil {
			start = time.Now()
		}
		actx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err := w.probeOnce(actx, r.Daemon)
		cancel()
		var answered *envd.AnsweredError
		isAnswer := err == nil || errors.As(err, &answered)
		if tr != nil {
			tr.probe(start, time.Now(), isAnswer)
		}
		if err == nil {
			w.ready.compatible(r.Name)
			return probeReady
		}
		if answered != nil {
			w.noteIncompatible(r.Name, answered)
			return probeIncompatible
		}
		w.ready.silent(r.Name, time.Now())
		if !errors.Is(err, guest.ErrDeviceDown) {
			deviceDownSince = time.Time{}
		} else if deviceDownSince.IsZero() {
			deviceDownSince = time.Now()
		} else if time.Since(deviceDownSince) >= deviceDeadAfter && !f.deviceRestarted {
			f.deviceRestarted = w.restartDeadDevice(ctx, r.Name, err)
			if !f.deviceRestarted {
				deviceDownSince = time.Now() // started moments ago: look again later
			}
		}
		if !clock.Sleep(ctx, delay) {
			if w.ctx.Err() == nil {
				w.log.Debug("the daemon has not answered the readiness probe", zap.String("instance", r.Name), zap.Error(err))
			}
			return probeSilent
		}
		delay = min(delay*2, 100*time.Millisecond)
	}
}

// deviceDeadAfter is how long a device on the host may refuse the probe
// before it is taken for dead: long enough to ride out a read of the
// instance older than a stop. targets refuses the restart for an instance
// started moments ago, whose device may still be starting.
const deviceDeadAfter = 2 * time.Second

// restartDeadDevice has the daemon's device restarted, within the flight's
// budget and at most deviceRestartWait, and says whether the flight's one
// restart is spent: not while the instance has only just started
// (targets.ErrDeviceStarting). An instance that turns out not to run is
// left alone by targets; a failure is logged, and the probe goes on either
// way.
func (w *Waker) restartDeadDevice(ctx context.Context, name string, probeErr error) bool {
	rctx, cancel := context.WithTimeout(ctx, deviceRestartWait)
	defer cancel()
	err := w.opts.Targets.RestartDaemonDevice(rctx, name)
	if errors.Is(err, targets.ErrDeviceStarting) {
		return false
	}
	if err != nil && ctx.Err() == nil {
		w.log.Warn("the daemon's device does not listen and restarting it failed",
			zap.String("instance", name), zap.NamedError("probe", probeErr), zap.Error(err))
	}
	return true
}

// deviceRestartWait bounds a device restart: one read and one write of
// the instance, after whatever holds its turn.
const deviceRestartWait = 5 * time.Second

// noteIncompatible logs a daemon's incompatible answer once per instance
// and answer: every wake of the target probes it again, and an operator
// needs to hear of a daemon of another version once, naming both versions.
func (w *Waker) noteIncompatible(instance string, answered *envd.AnsweredError) {
	field, daemon, provider, mismatch := answered.Mismatch()
	var key string
	var rpc *jsonrpc.Error
	switch {
	case mismatch:
		key = field + " " + daemon + " " + provider
	case errors.As(answered, &rpc):
		key = "error " + string(rpc.Kind)
	default:
		key = "result"
	}
	if !w.ready.oddAnswer(instance, key) {
		return
	}
	if mismatch {
		w.log.Warn("the guest daemon answered initialize with another "+field+"; its dials are relayed so that the runtime's handshake fails the environment",
			zap.String("instance", instance), zap.String("daemon", daemon), zap.String("provider", provider), zap.Error(answered))
		return
	}
	w.log.Warn("the guest daemon answered initialize, but not with a data-plane success of this version; its dials are relayed so that the runtime sees the answer",
		zap.String("instance", instance), zap.Error(answered))
}

func (w *Waker) probeOnce(ctx context.Context, t guest.Target) error {
	conn, err := w.opts.Dialer.DialContext(ctx, t)
	if err != nil {
		return err
	}
	sess, err := envd.Handshake(ctx, conn, w.opts.ClientInfo)
	if err != nil {
		return err
	}
	// Closed on this flight's goroutine, which owns it: nothing outlives the probe.
	_ = sess.Close()
	return nil
}

// bootingRetry grows with how long the daemon has been silent: 1 s at
// first, up to 10 s for a daemon that has not answered for minutes.
func (w *Waker) bootingRetry(instance string) time.Duration {
	since, ok := w.ready.silentSince(instance)
	if !ok {
		return time.Second
	}
	return max(time.Second, min(10*time.Second, time.Since(since)/10))
}
