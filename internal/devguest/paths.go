package devguest

import (
	"errors"
	"io/fs"
	"strings"
	"syscall"
	"unicode/utf8"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// MaxPathBytes bounds an EnvironmentPath.
const MaxPathBytes = 4096

// checkPath enforces the EnvironmentPath grammar: absolute, normalized, at
// most 4096 bytes, UTF-8, no "." or ".." segments (refused, never
// rewritten). field is the wire path named in the refusal.
func checkPath(field, p string) *jsonrpc.Error {
	refuse := func(problem string) *jsonrpc.Error {
		return jsonrpc.InvalidParams(field, "The member %s %s.", field, problem)
	}
	switch {
	case p == "":
		return refuse("must be an absolute path, not empty")
	case len(p) > MaxPathBytes:
		return refuse("must be at most 4096 bytes long")
	case !utf8.ValidString(p):
		return refuse("must be valid UTF-8")
	case strings.IndexByte(p, 0) >= 0:
		return refuse("must not contain NUL")
	case p[0] != '/':
		return refuse("must be an absolute path starting with /")
	case p == "/":
		return nil
	case strings.HasSuffix(p, "/"):
		return refuse("must not end with /")
	}
	for _, seg := range strings.Split(p[1:], "/") {
		switch seg {
		case "":
			return refuse("must not contain an empty segment (//)")
		case ".", "..":
			return refuse("must not contain . or .. segments")
		}
	}
	return nil
}

// fsError maps an operating-system error on path to the protocol's kinds.
// Errors it does not recognise stay plain and go out as internal.
func fsError(path string, err error) error {
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		if errors.Is(err, fs.ErrNotExist) {
			return jsonrpc.Errorf(jsonrpc.KindNotFound, "Nothing exists at %s.", path)
		}
		return err
	}
	switch errno {
	case syscall.ENOENT:
		return jsonrpc.Errorf(jsonrpc.KindNotFound, "Nothing exists at %s (or one of its parent directories is missing).", path)
	case syscall.ENOTDIR:
		return jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "notDirectory", "A parent of %s is not a directory.", path)
	case syscall.EISDIR:
		return jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "isDirectory", "%s is a directory.", path)
	case syscall.EACCES, syscall.EPERM, syscall.EROFS:
		return jsonrpc.WithReason(jsonrpc.KindPermissionDenied, "filePermission", "The operating system refused access to %s: %v.", path, errno)
	case syscall.ELOOP:
		return jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "symlinkLoop", "Resolving %s met too many symbolic links.", path)
	case syscall.ENOSPC, syscall.EDQUOT:
		return jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "noSpace", "No space is left to write %s.", path)
	case syscall.ENAMETOOLONG:
		return jsonrpc.InvalidParams("path", "A name in %s is longer than the filesystem allows.", path)
	}
	return err
}
