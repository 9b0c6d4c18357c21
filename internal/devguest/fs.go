package devguest

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"hash/fnv"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// fileVersion is an opaque fingerprint of a file's identity and last
// change: device, inode, size, mtime and ctime. A write through
// fs/writeFile renames a new inode into place, so every write changes it.
func fileVersion(fi fs.FileInfo) string {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return "file:v1:" + hex.EncodeToString([]byte(fi.ModTime().String()))
	}
	var b [8 * 7]byte
	for i, v := range []uint64{st.Dev, st.Ino, uint64(st.Size),
		uint64(st.Mtim.Sec), uint64(st.Mtim.Nsec), uint64(st.Ctim.Sec), uint64(st.Ctim.Nsec)} {
		binary.BigEndian.PutUint64(b[i*8:], v)
	}
	sum := sha256.Sum256(b[:])
	return "file:v1:" + hex.EncodeToString(sum[:16])
}

func ceilingError(field string, ceiling, got uint64) *jsonrpc.Error {
	e := jsonrpc.InvalidParams(field, "The member %s is %d, above this daemon's ceiling of %d (see limits in the initialize response).", field, got, ceiling)
	e.Ceiling = &ceiling
	return e
}

func (d *Daemon) readFile(_ context.Context, raw json.RawMessage) (any, error) {
	var p ReadFileParams
	if err := jsonrpc.DecodeParams(raw, &p); err != nil {
		return nil, err
	}
	if e := checkPath("path", p.Path); e != nil {
		return nil, e
	}
	if p.MaxBytes == 0 {
		return nil, jsonrpc.InvalidParams("maxBytes", "The member maxBytes must be at least 1.")
	}
	if ceiling := d.limits.Filesystem.MaxReadBytes; p.MaxBytes > ceiling {
		return nil, ceilingError("maxBytes", ceiling, p.MaxBytes)
	}
	fi, err := os.Stat(p.Path)
	if err != nil {
		return nil, fsError(p.Path, err)
	}
	if e := regularFile(p.Path, fi); e != nil {
		return nil, e
	}
	// O_NONBLOCK: if a FIFO was swapped in after the Stat, opening it must not hang.
	f, err := os.OpenFile(p.Path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, fsError(p.Path, err)
	}
	// Opened read-only: nothing is lost if its close fails.
	defer func() { _ = f.Close() }()
	if fi, err = f.Stat(); err != nil {
		return nil, fsError(p.Path, err)
	}
	if e := regularFile(p.Path, fi); e != nil {
		return nil, e
	}
	size := uint64(fi.Size())
	var want uint64
	if p.Offset < size {
		want = min(p.MaxBytes, size-p.Offset)
	}
	buf := make([]byte, want)
	n, err := f.ReadAt(buf, int64(p.Offset))
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, fsError(p.Path, err)
	}
	return ReadFileResult{Data: base64.StdEncoding.EncodeToString(buf[:n]), SizeBytes: size, Version: fileVersion(fi)}, nil
}

func regularFile(path string, fi fs.FileInfo) *jsonrpc.Error {
	switch {
	case fi.IsDir():
		return jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "isDirectory", "%s is a directory, not a regular file.", path)
	case !fi.Mode().IsRegular():
		return jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "notRegularFile", "%s is not a regular file (%s).", path, fi.Mode().Type())
	}
	return nil
}

// writeLocks serialise writes to one path inside this daemon, so a create
// condition or ifMatch check and the rename that follows it cannot interleave
// with another fs/writeFile. Writers outside the daemon are not fenced.
type writeLocks [64]chanMutex

type chanMutex chan struct{}

func (l *writeLocks) lock(path string) func() {
	h := fnv.New32a()
	_, _ = h.Write([]byte(path))
	m := &l[h.Sum32()%uint32(len(l))]
	if *m == nil {
		panic("devguest: write locks not initialised")
	}
	*m <- struct{}{}
	return func() { <-*m }
}

func newWriteLocks() *writeLocks {
	l := new(writeLocks)
	for i := range l {
		l[i] = make(chanMutex, 1)
	}
	return l
}

func (d *Daemon) writeFile(_ context.Context, raw json.RawMessage) (any, error) {
	var p WriteFileParams
	if err := jsonrpc.DecodeParams(raw, &p); err != nil {
		return nil, err
	}
	if e := checkPath("path", p.Path); e != nil {
		return nil, e
	}
	if p.IfMatch != "" && len(p.IfMatch) > 255 {
		return nil, jsonrpc.InvalidParams("ifMatch", "The member ifMatch must be a version a read returned (at most 255 bytes).")
	}
	data, err := base64.StdEncoding.Strict().DecodeString(p.Data)
	if err != nil {
		return nil, jsonrpc.InvalidParams("data", "The member data must be padded standard base64: %v.", err)
	}
	if ceiling := d.limits.Filesystem.MaxWriteBytes; uint64(len(data)) > ceiling {
		return nil, ceilingError("data", ceiling, uint64(len(data)))
	}
	if p.Path == "/" {
		return nil, jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "isDirectory", "/ is a directory.")
	}
	target, err := resolveWriteTarget(p.Path)
	if err != nil {
		return nil, err
	}
	unlock := d.writeLocks.lock(target)
	defer unlock()

	fi, err := os.Stat(target)
	exists := err == nil
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fsError(p.Path, err)
	}
	if exists {
		if e := regularFile(p.Path, fi); e != nil {
			return nil, e
		}
	}
	switch {
	case p.Create == CreateNew && exists:
		return nil, jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "createCondition", "%s already exists and create is %s.", p.Path, CreateNew)
	case p.Create == ReplaceExisting && !exists:
		return nil, jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "createCondition", "%s does not exist and create is %s.", p.Path, ReplaceExisting)
	}
	if p.IfMatch != "" && (!exists || fileVersion(fi) != p.IfMatch) {
		return nil, jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "ifMatchFailed", "%s is no longer at version %s; read it again.", p.Path, p.IfMatch)
	}

	mode := fs.FileMode(0o644)
	if exists {
		mode = fi.Mode() & (fs.ModePerm | fs.ModeSetuid | fs.ModeSetgid | fs.ModeSticky)
	}
	if p.Executable {
		if !exists {
			mode = 0o755
		}
		mode |= (mode & 0o444) >> 2 // x wherever r
	}
	if err := replaceFile(target, data, mode, fi); err != nil {
		return nil, fsError(p.Path, err)
	}
	fi, err = os.Stat(target)
	if err != nil {
		return nil, fsError(p.Path, err)
	}
	return WriteFileResult{Version: fileVersion(fi)}, nil
}

// resolveWriteTarget follows symlinks at path to the file a write replaces.
// The root is "/", so every link stays inside it; a dangling link is refused
// rather than guessed at.
func resolveWriteTarget(path string) (string, error) {
	resolved, err := filepath.EvalSymlinks(path)
	if err == nil {
		return resolved, nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return "", fsError(path, err)
	}
	if li, lerr := os.Lstat(path); lerr == nil && li.Mode()&fs.ModeSymlink != 0 {
		return "", jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "symlinkRejected", "%s is a symbolic link to something that does not exist; write its target instead.", path)
	}
	dir, err := filepath.EvalSymlinks(filepath.Dir(path))
	if err != nil {
		return "", fsError(path, err)
	}
	di, err := os.Stat(dir)
	if err != nil {
		return "", fsError(path, err)
	}
	if !di.IsDir() {
		return "", jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "notDirectory", "The parent of %s is not a directory.", path)
	}
	return filepath.Join(dir, filepath.Base(path)), nil
}

// replaceFile stages data next to target and renames it into place, so a
// reader sees the old file or the new one, never a partial one.
func replaceFile(target string, data []byte, mode fs.FileMode, old fs.FileInfo) (err error) {
	dir := filepath.Dir(target)
	tmp, err := os.CreateTemp(dir, ".lsenvd-dev-write-*")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			_ = tmp.Close()
			_ = os.Remove(tmp.Name())
		}
	}()
	if _, err = tmp.Write(data); err != nil {
		return err
	}
	if old != nil {
		if st, ok := old.Sys().(*syscall.Stat_t); ok {
			// Keep the owner when the daemon may (it runs as root in the guest).
			if cerr := tmp.Chown(int(st.Uid), int(st.Gid)); cerr != nil && !errors.Is(cerr, syscall.EPERM) {
				return cerr
			}
		}
	}
	if err = tmp.Chmod(mode); err != nil {
		return err
	}
	if err = tmp.Sync(); err != nil {
		return err
	}
	if err = tmp.Close(); err != nil {
		return err
	}
	if err = os.Rename(tmp.Name(), target); err != nil {
		return err
	}
	if d, derr := os.Open(dir); derr == nil {
		_ = d.Sync()
		_ = d.Close()
	}
	return nil
}
