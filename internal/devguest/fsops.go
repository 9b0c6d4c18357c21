package devguest

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"unicode/utf8"

	"golang.org/x/sys/unix"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

func (d *Daemon) createDirectory(_ context.Context, raw json.RawMessage) (any, error) {
	var p CreateDirectoryParams
	if err := jsonrpc.DecodeParams(raw, &p); err != nil {
		return nil, err
	}
	if e := checkPath("path", p.Path); e != nil {
		return nil, e
	}
	notDirectory := func() error {
		return jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "notDirectory", "%s exists and is not a directory.", p.Path)
	}
	if !p.Parents {
		if err := os.Mkdir(p.Path, 0o755); err != nil {
			if errors.Is(err, fs.ErrExist) {
				return nil, jsonrpc.Errorf(jsonrpc.KindAlreadyExists, "Something already exists at %s; set parents to accept an existing directory.", p.Path)
			}
			return nil, fsError(p.Path, err)
		}
		return Empty{}, nil
	}
	if fi, err := os.Stat(p.Path); err == nil {
		if !fi.IsDir() {
			return nil, notDirectory()
		}
		return Empty{}, nil
	}
	if err := os.MkdirAll(p.Path, 0o755); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return nil, notDirectory() // a dangling symlink, say
		}
		return nil, fsError(p.Path, err)
	}
	return Empty{}, nil
}

func (d *Daemon) getMetadata(_ context.Context, raw json.RawMessage) (any, error) {
	var p GetMetadataParams
	if err := jsonrpc.DecodeParams(raw, &p); err != nil {
		return nil, err
	}
	if e := checkPath("path", p.Path); e != nil {
		return nil, e
	}
	stat := os.Lstat
	if p.FollowSymlink {
		stat = os.Stat
	}
	fi, err := stat(p.Path)
	if err != nil {
		return nil, fsError(p.Path, err)
	}
	return metadataOf(p.Path, fi), nil
}

// entryKind is the wire kind of an entry described without following it.
func entryKind(fi fs.FileInfo) string {
	switch mode := fi.Mode(); {
	case mode.IsRegular():
		return EntryFile
	case mode.IsDir():
		return EntryDirectory
	case mode&fs.ModeSymlink != 0:
		return EntrySymlink
	}
	return EntryOther
}

func sizeOf(fi fs.FileInfo) uint64 { return uint64(max(fi.Size(), 0)) }

// metadataOf describes the entry at path, whose FileInfo is fi.
func metadataOf(path string, fi fs.FileInfo) Metadata {
	m := Metadata{Kind: entryKind(fi), SizeBytes: sizeOf(fi), ModifiedAtMs: fi.ModTime().UnixMilli()}
	switch m.Kind {
	case EntryFile:
		m.Executable = fi.Mode()&0o111 != 0
		m.Version = fileVersion(fi)
	case EntrySymlink:
		if target, err := os.Readlink(path); err == nil && utf8.ValidString(target) {
			m.SymlinkTarget = target
		}
	}
	return m
}

// A directory cursor names the last name a page covered: the next page
// starts after it, whatever was added or removed in between.
const cursorPrefix = "dir:v1:"

func encodeCursor(name string) string {
	return cursorPrefix + base64.RawURLEncoding.EncodeToString([]byte(name))
}

func decodeCursor(cursor string) (string, bool) {
	rest, ok := strings.CutPrefix(cursor, cursorPrefix)
	if !ok {
		return "", false
	}
	name, err := base64.RawURLEncoding.DecodeString(rest)
	if err != nil || len(name) == 0 || len(name) > MaxPathBytes || strings.ContainsAny(string(name), "/\x00") {
		return "", false
	}
	return string(name), true
}

func (d *Daemon) readDirectory(_ context.Context, raw json.RawMessage) (any, error) {
	var p ReadDirectoryParams
	if err := jsonrpc.DecodeParams(raw, &p); err != nil {
		return nil, err
	}
	if e := checkPath("path", p.Path); e != nil {
		return nil, e
	}
	if p.MaxEntries == 0 {
		return nil, jsonrpc.InvalidParams("maxEntries", "The member maxEntries must be at least 1.")
	}
	if ceiling := d.limits.Filesystem.MaxDirectoryEntries; p.MaxEntries > ceiling {
		return nil, ceilingError("maxEntries", uint64(ceiling), uint64(p.MaxEntries))
	}
	var after string
	if p.Cursor != "" {
		var ok bool
		if after, ok = decodeCursor(p.Cursor); !ok {
			return nil, jsonrpc.InvalidParams("cursor", "The member cursor must be a nextCursor an earlier fs/readDirectory answered.")
		}
	}
	names, err := directoryNames(p.Path)
	if err != nil {
		return nil, err
	}
	sort.Strings(names)
	i := sort.SearchStrings(names, after)
	if i < len(names) && names[i] == after {
		i++
	}
	var res ReadDirectoryResult
	for ; i < len(names) && len(res.Entries) < int(p.MaxEntries); i++ {
		name := names[i]
		if !utf8.ValidString(name) {
			res.SkippedCount++
			continue
		}
		fi, err := os.Lstat(filepath.Join(p.Path, name))
		if err != nil {
			res.SkippedCount++ // it vanished, or cannot be looked at
			continue
		}
		res.Entries = append(res.Entries, DirectoryEntry{Name: name, Kind: entryKind(fi), SizeBytes: sizeOf(fi)})
	}
	if i < len(names) {
		res.NextCursor = encodeCursor(names[i-1])
	}
	return res, nil
}

// directoryNames lists the names in the directory at path (a symlink there
// is followed), unsorted.
func directoryNames(path string) ([]string, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, fsError(path, err)
	}
	if !fi.IsDir() {
		return nil, jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "notDirectory", "%s is not a directory.", path)
	}
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_DIRECTORY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, fsError(path, err)
	}
	// Opened read-only: nothing is lost if its close fails.
	defer func() { _ = f.Close() }()
	names, err := f.Readdirnames(-1)
	if err != nil {
		return nil, fsError(path, err)
	}
	return names, nil
}

func filesystemRoot(what string) error {
	return jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "filesystemRoot", "The filesystem root / cannot be %s.", what)
}

func (d *Daemon) remove(_ context.Context, raw json.RawMessage) (any, error) {
	var p RemoveParams
	if err := jsonrpc.DecodeParams(raw, &p); err != nil {
		return nil, err
	}
	if e := checkPath("path", p.Path); e != nil {
		return nil, e
	}
	if p.Path == "/" {
		return nil, filesystemRoot("removed")
	}
	fi, err := os.Lstat(p.Path)
	if err != nil {
		return nil, fsError(p.Path, err)
	}
	switch {
	case !fi.IsDir():
		err = unix.Unlink(p.Path) // a symlink goes, its target stays
	case p.Recursive:
		err = os.RemoveAll(p.Path) // never follows links
	default:
		err = unix.Rmdir(p.Path)
		if errors.Is(err, syscall.ENOTEMPTY) || errors.Is(err, syscall.EEXIST) {
			return nil, jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "notEmpty", "The directory %s is not empty; set recursive to remove it with its contents.", p.Path)
		}
	}
	if err != nil {
		return nil, fsError(p.Path, err)
	}
	return Empty{}, nil
}

func (d *Daemon) rename(_ context.Context, raw json.RawMessage) (any, error) {
	var p RenameParams
	if err := jsonrpc.DecodeParams(raw, &p); err != nil {
		return nil, err
	}
	if e := checkPath("source", p.Source); e != nil {
		return nil, e
	}
	if e := checkPath("destination", p.Destination); e != nil {
		return nil, e
	}
	if p.Source == "/" || p.Destination == "/" {
		return nil, filesystemRoot("renamed or replaced")
	}
	if strings.HasPrefix(p.Destination, p.Source+"/") {
		return nil, jsonrpc.InvalidParams("destination", "The destination %s lies inside the source %s.", p.Destination, p.Source)
	}
	if _, err := os.Lstat(p.Source); err != nil {
		return nil, fsError(p.Source, err)
	}
	var err error
	if p.Overwrite {
		err = unix.Rename(p.Source, p.Destination)
	} else {
		err = unix.Renameat2(unix.AT_FDCWD, p.Source, unix.AT_FDCWD, p.Destination, unix.RENAME_NOREPLACE)
		if errors.Is(err, syscall.ENOSYS) || errors.Is(err, syscall.EINVAL) {
			// A filesystem without RENAME_NOREPLACE: check, then rename.
			// Only another writer racing in between can defeat this.
			unlock := d.writeLocks.lock(p.Destination)
			defer unlock()
			if _, lerr := os.Lstat(p.Destination); lerr == nil {
				err = syscall.EEXIST
			} else {
				err = unix.Rename(p.Source, p.Destination)
			}
		}
	}
	if err != nil {
		return nil, renameError(p, err)
	}
	return Empty{}, nil
}

// renameError maps a failed rename(2) to the protocol's kinds: the errno
// means something specific to the pair of paths.
func renameError(p RenameParams, err error) error {
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return fsError(p.Source, err)
	}
	switch errno {
	case syscall.EEXIST, syscall.ENOTEMPTY:
		if !p.Overwrite {
			return jsonrpc.Errorf(jsonrpc.KindAlreadyExists, "%s already exists; set overwrite to replace it.", p.Destination)
		}
		return jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "notEmpty", "%s is a directory that is not empty, so it cannot be replaced.", p.Destination)
	case syscall.EXDEV:
		return jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "crossDevice", "%s and %s are on different filesystems; a rename cannot move between them.", p.Source, p.Destination)
	case syscall.EISDIR:
		return jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "isDirectory", "%s is a directory and %s is not; one cannot replace the other.", p.Destination, p.Source)
	case syscall.ENOTDIR:
		return jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "notDirectory", "%s is a directory and %s is not (or a parent of one of them is not a directory).", p.Source, p.Destination)
	case syscall.ENOENT:
		return jsonrpc.Errorf(jsonrpc.KindNotFound, "The parent directory of %s does not exist (or %s vanished).", p.Destination, p.Source)
	case syscall.EINVAL:
		return jsonrpc.InvalidParams("destination", "The destination %s lies inside the source %s.", p.Destination, p.Source)
	}
	return fsError(p.Source, err)
}
