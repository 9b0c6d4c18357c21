package main

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"reflect"
	"strings"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// readSettingsFile reads a file of settings in systemd's EnvironmentFile
// syntax, as the unit hands them to the process: VAR=value lines, blank
// lines and # or ; comments skipped, a value in matching single or double
// quotes unquoted. It answers the lines as os.Environ does.
func readSettingsFile(path string) ([]string, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var out []string
	sc := bufio.NewScanner(bytes.NewReader(raw))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' || line[0] == ';' {
			continue
		}
		name, value, ok := strings.Cut(line, "=")
		name = strings.TrimSpace(name)
		if !ok || name == "" || strings.ContainsAny(name, " \t") {
			return nil, fmt.Errorf("line %d is not VAR=value", n)
		}
		value = strings.TrimSpace(value)
		if len(value) >= 2 && (value[0] == '"' || value[0] == '\'') && value[len(value)-1] == value[0] {
			value = value[1 : len(value)-1]
		}
		out = append(out, name+"="+value)
	}
	return out, sc.Err()
}

// reloadSettings reads PROVIDER_SETTINGS_FILE again on SIGHUP. The settings
// it holds are checked as at start, over the rest of the process's
// environment; a file that is refused changes nothing. PROVIDER_LOG_LEVEL
// is applied in place; every other setting that differs from the one in
// force is named as taking a restart (the one in force stays).
func (r *reloader) reloadSettings() {
	path := r.cfg.SettingsFile
	lines, err := readSettingsFile(path)
	if err != nil {
		r.log.Error("SIGHUP: the settings file is refused; the settings in force stay", zap.String("file", path), zap.Error(err))
		return
	}
	// The file's lines over the environment, as the unit would give them
	// (loadConfig takes the last of a variable's assignments).
	next, err := loadConfig(append(os.Environ(), lines...))
	if err != nil {
		r.log.Error("SIGHUP: the settings file is refused; the settings in force stay", zap.String("file", path), zap.Error(err))
		return
	}
	cur, nxt := reflect.ValueOf(r.cfg), reflect.ValueOf(next)
	for _, s := range settings() {
		if reflect.DeepEqual(cur.FieldByName(s.field).Interface(), nxt.FieldByName(s.field).Interface()) {
			continue
		}
		if s.Name == "PROVIDER_LOG_LEVEL" {
			lvl, _ := zapcore.ParseLevel(next.LogLevel) // checked by loadConfig
			r.level.SetLevel(lvl)
			r.cfg.LogLevel = next.LogLevel
			r.log.Info("SIGHUP: the log level is now "+next.LogLevel, zap.String("file", path))
			continue
		}
		r.log.Warn("SIGHUP: "+s.Name+" differs in the settings file; it takes a restart, and the value in force stays", zap.String("file", path))
	}
}
