package targets

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/clock"
)

// ErrNoDevice: the dialer reaches daemons through no device of the
// instance's that could be restarted (netns, exec), or the instance does
// not have it.
var ErrNoDevice = errors.New("targets: no restartable device to the daemon")

// ErrDeviceStarting: the instance started less than deviceSettle ago, and
// the server may not have started its devices yet (LXD starts a proxy
// device after the container); a restart now could cut the one it starts.
var ErrDeviceStarting = errors.New("targets: the instance started moments ago; its devices may still be starting")

// deviceSettle is how long after a start a device that does not listen is
// taken for dead rather than still starting.
const deviceSettle = 3 * time.Second

// RestartDaemonDevice makes Incus stop and start the device the dialer
// reaches the daemon through, on an instance that runs: a wake whose probe
// finds nothing listening on it while the instance runs asks for it (see
// guest.RestartedDevice for how LXD 5.0 leaves one dead). It is one
// ETag-guarded write of the whole instance, under the instance's turn, that
// changes the device's config to an equivalent one. An instance that does
// not run is left alone: its next start starts the device.
func (s *Service) RestartDaemonDevice(ctx context.Context, name string) error {
	return s.owned(ctx, name, func(ctx context.Context) error {
		for attempt := 0; ; attempt++ {
			inst, etag, err := s.incus.GetInstance(ctx, name)
			if err != nil {
				return fmt.Errorf("restart the daemon's device of %s: %w", name, err)
			}
			if inst.Status != incus.InstanceRunning {
				return nil
			}
			if since := time.Since(inst.LastUsedAt); !inst.LastUsedAt.IsZero() && since < deviceSettle {
				return fmt.Errorf("instance %s started %s ago: %w", name, since.Round(time.Millisecond), ErrDeviceStarting)
			}
			dev, config, ok := guest.RestartedDevice(s.dialer, inst.Devices)
			if !ok {
				return fmt.Errorf("instance %s: %w", name, ErrNoDevice)
			}
			put := inst.Writable()
			put.Devices[dev] = config
			err = s.incus.UpdateInstance(ctx, name, put, etag)
			s.listingChanged()
			if err == nil {
				s.log.Warn("the daemon's device did not listen on a running instance; restarted it",
					zap.String("instance", name), zap.String("device", dev))
				return nil
			}
			// Incus rewrites volatile keys as an instance moves: read again
			// shortly, as every ETag-guarded write here does.
			if !errors.Is(err, incus.ErrPreconditionFailed) || attempt >= 3 {
				return fmt.Errorf("restart the daemon's device of %s: %w", name, err)
			}
			if !clock.Sleep(ctx, 10*time.Millisecond<<attempt) {
				return fmt.Errorf("restart the daemon's device of %s: %w", name, ctx.Err())
			}
		}
	})
}
