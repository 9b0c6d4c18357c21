package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/lightspeed-dev/incus-provider/incus"
)

// Exit statuses. The systemd unit's RestartPreventExitStatus names
// exitBadSetting: restarting cannot fix a setting, so a loop would only
// bury the sentence that says what to fix.
const (
	exitFailed     = 1 // something that may pass: Incus down, an address still held
	exitBadSetting = 2 // a setting (or a file one names) is refused; fix it and restart
)

// settingError marks a failure that a setting (or a file it names) causes.
type settingError struct{ err error }

func (e *settingError) Error() string { return e.err.Error() }
func (e *settingError) Unwrap() error { return e.err }

func badSetting(err error) error { return &settingError{err: err} }

// unlessRetryable is a setting error unless Incus may answer otherwise
// later (it did not answer, or answered a server error).
func unlessRetryable(err error) error {
	if incus.IsRetryable(err) {
		return err
	}
	return badSetting(err)
}

// bindError: an address another process holds may be free at the next
// start; any other refusal (no such address here, a bad path) is the
// setting's.
func bindError(err error) error {
	if errors.Is(err, syscall.EADDRINUSE) {
		return err
	}
	return badSetting(err)
}

func exitCode(err error) int {
	if _, ok := errors.AsType[*settingError](err); ok {
		return exitBadSetting
	}
	return exitFailed
}

// checkProject refuses an INCUS_PROJECT that Incus does not have, in
// those words: every later call would otherwise fail with a 404 that
// reads as something else (an image that cannot be resolved).
func checkProject(ctx context.Context, client *incus.Client, cfg config) error {
	_, err := client.GetProject(ctx, cfg.IncusProject)
	switch {
	case err == nil:
		return nil
	case errors.Is(err, incus.ErrNotFound):
		return badSetting(fmt.Errorf("INCUS_PROJECT=%q is not valid: Incus (%s) has no project %q; create it (incus project create %s) or name an existing one",
			cfg.IncusProject, incusWhere(cfg), cfg.IncusProject, cfg.IncusProject))
	default:
		return unlessRetryable(fmt.Errorf("INCUS_PROJECT=%q cannot be read from Incus (%s): %w", cfg.IncusProject, incusWhere(cfg), err))
	}
}

// handleArgs answers the command line. The service takes no arguments
// (settings come from the environment); check validates them without
// serving; done says the process ends now with code.
func handleArgs(args []string, stdout, stderr io.Writer) (code int, done bool) {
	if len(args) == 0 {
		return 0, false
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		if len(args) == 1 {
			writeUsage(stdout)
			return 0, true
		}
	case "-version", "--version", "version":
		if len(args) == 1 {
			writeVersion(stdout)
			return 0, true
		}
	case "targets":
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		return runTargets(ctx, args[1:], os.Environ(), stdout, stderr), true
	case "check":
		if len(args) == 1 {
			ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			return runCheck(ctx, os.Environ(), stdout), true
		}
	}
	_, _ = fmt.Fprintf(stderr, "incus-provider: %q is not an argument it takes; it takes check, targets, --help or --version, and reads every setting from the environment (see --help).\n", args[0])
	return exitBadSetting, true
}
