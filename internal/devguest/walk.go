package devguest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"sort"
	"strings"
	"syscall"
	"unicode/utf8"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// ResultBudgetBytes is the spec's result budget: the matches of one
// fs/searchText or fs/globFiles, or everything one fs/scan lists, stop there.
const ResultBudgetBytes = 12 << 20

// MaxListedSkips is how many skipped entries one scan root lists; the rest
// are only counted.
const MaxListedSkips = 100

// alwaysPruned are the names every walk prunes: version-control state.
var alwaysPruned = map[string]bool{".git": true, ".hg": true, ".svn": true, ".jj": true}

// resultBudget is what is left of one answer's byte budget. Items are
// charged at their encoded size, so the answer stays under the message limit.
type resultBudget struct {
	left  int64
	spent bool // a charge did not fit: the walk stopped there
}

// cost is v's encoded size and a separator.
func cost(v any) int64 {
	raw, err := json.Marshal(v)
	if err != nil {
		return math.MaxInt64
	}
	return int64(len(raw)) + 1
}

// fits says whether v would fit, without taking anything.
func (b *resultBudget) fits(v any) bool { return !b.spent && cost(v) <= b.left }

// charge takes v's size from the budget, or marks the budget spent and
// reports false when v does not fit; once spent, nothing more fits.
func (b *resultBudget) charge(v any) bool {
	n := cost(v)
	if b.spent || n > b.left {
		b.spent = true
		return false
	}
	b.left -= n
	return true
}

// walkFilter is a compiled WalkFilter.
type walkFilter struct {
	include, exclude []*globPattern
	hidden           bool   // includeHidden
	ignoredToo       bool   // includeIgnored
	maxDepth         uint32 // 0: no bound
}

// compileFilter compiles f; prefix is the wire path of the member holding
// it ("" when the filter's members sit in the params themselves).
func compileFilter(prefix string, f WalkFilter) (*walkFilter, *jsonrpc.Error) {
	field := func(name string) string {
		if prefix == "" {
			return name
		}
		return prefix + "." + name
	}
	wf := &walkFilter{hidden: f.IncludeHidden, ignoredToo: f.IncludeIgnored}
	if f.MaxDepth != nil {
		if *f.MaxDepth == 0 {
			return nil, jsonrpc.InvalidParams(field("maxDepth"), "The member %s must be at least 1 (the root's direct children are depth 1); omit it for no bound.", field("maxDepth"))
		}
		wf.maxDepth = *f.MaxDepth
	}
	for _, list := range []struct {
		name     string
		patterns []string
		into     *[]*globPattern
	}{{"include", f.Include, &wf.include}, {"exclude", f.Exclude, &wf.exclude}} {
		for i, pattern := range list.patterns {
			g, err := compileGlob(pattern, f.IgnoreCase)
			if err != nil {
				name := field(fmt.Sprintf("%s[%d]", list.name, i))
				return nil, jsonrpc.InvalidParams(name, "The pattern %s %s.", name, err.Error())
			}
			*list.into = append(*list.into, g)
		}
	}
	return wf, nil
}

func anyMatches(patterns []*globPattern, rel, name string, isDir bool) bool {
	for _, g := range patterns {
		if g.matches(rel, name, isDir) {
			return true
		}
	}
	return false
}

// walkEntry is one entry a walk selected.
type walkEntry struct {
	rel  string      // its TreePath below the root
	abs  string      // its environment path
	info fs.FileInfo // from Lstat: links are not followed
}

// walker walks one root depth first, names sorted bytewise in each
// directory. visit sees each selected entry and returns true to stop the
// walk; skip hears of each entry passed over as unreadable or
// unrepresentable.
type walker struct {
	ctx     context.Context
	filter  *walkFilter
	visit   func(walkEntry) (stop bool)
	skip    func(rel, reason string)
	ignores []*ignoreRules
	stopped bool
	// paused, when set, runs before each entry (tests hold a walk open).
	paused func(context.Context)
}

func walkAborted() *jsonrpc.Error {
	return jsonrpc.WithReason(jsonrpc.KindAborted, "cancelled", "The walk was cancelled.")
}

// walk walks the directory root (a symlink there is followed). It answers
// the error of a root it cannot list, aborted (cancelled) when ctx ends,
// and nil otherwise, however many entries below the root it skipped.
func (w *walker) walk(root string) error {
	names, err := readNames(root, true)
	if err != nil {
		return fsError(root, err)
	}
	return w.directory(root, "", names, 0, false)
}

// readNames lists a directory without following a symlink at abs (unless
// follow): a directory swapped for something else under the walk is
// skipped rather than entered.
func readNames(abs string, follow bool) ([]string, error) {
	flags := os.O_RDONLY | syscall.O_DIRECTORY | syscall.O_NONBLOCK
	if !follow {
		flags |= syscall.O_NOFOLLOW
	}
	f, err := os.OpenFile(abs, flags, 0)
	if err != nil {
		return nil, err
	}
	// Opened read-only: nothing is lost if its close fails.
	defer func() { _ = f.Close() }()
	names, err := f.Readdirnames(-1)
	if err != nil {
		return nil, err
	}
	sort.Strings(names)
	return names, nil
}

// directory visits the entries of the directory at abs (TreePath rel, ""
// for the root, at depth), whose names are given. selected says an include
// pattern matched the directory or one above it.
func (w *walker) directory(abs, rel string, names []string, depth uint32, selected bool) error {
	if !w.filter.ignoredToo {
		if rs := readIgnoreRules(abs, rel); rs != nil {
			w.ignores = append(w.ignores, rs)
			defer func() { w.ignores = w.ignores[:len(w.ignores)-1] }()
		}
	}
	for _, name := range names {
		if w.stopped {
			return nil
		}
		if w.paused != nil {
			w.paused(w.ctx)
		}
		if w.ctx.Err() != nil {
			return walkAborted()
		}
		if alwaysPruned[name] || (!w.filter.hidden && strings.HasPrefix(name, ".")) {
			continue
		}
		childRel := name
		if rel != "" {
			childRel = rel + "/" + name
		}
		childAbs := strings.TrimSuffix(abs, "/") + "/" + name
		if !utf8.ValidString(name) || len(childAbs) > MaxPathBytes {
			w.skip(childRel, SkipUnrepresentable)
			continue
		}
		info, err := os.Lstat(childAbs)
		if errors.Is(err, fs.ErrNotExist) {
			continue // it vanished while the walk went by
		}
		if err != nil {
			w.skip(childRel, SkipUnreadable)
			continue
		}
		isDir := info.IsDir()
		if !w.filter.ignoredToo && ignored(w.ignores, childRel, name, isDir) {
			continue
		}
		if anyMatches(w.filter.exclude, childRel, name, isDir) {
			continue // and an excluded directory is pruned
		}
		childSelected := selected || len(w.filter.include) == 0 || anyMatches(w.filter.include, childRel, name, isDir)
		if childSelected && w.visit(walkEntry{rel: childRel, abs: childAbs, info: info}) {
			w.stopped = true
			return nil
		}
		if !isDir || (w.filter.maxDepth != 0 && depth+1 >= w.filter.maxDepth) {
			continue
		}
		children, err := readNames(childAbs, false)
		if err != nil {
			if !errors.Is(err, fs.ErrNotExist) {
				w.skip(childRel, SkipUnreadable)
			}
			continue
		}
		if err := w.directory(childAbs, childRel, children, depth+1, childSelected); err != nil {
			return err
		}
	}
	return nil
}

// errTooLarge says a file holds more than the bytes a read may take.
var errTooLarge = errors.New("larger than the remaining result budget")

// readContent reads the regular file at abs, at most limit bytes, without
// following a symlink there (unless follow) or hanging on a FIFO swapped in.
func readContent(abs string, limit int64, follow bool) ([]byte, error) {
	flags := os.O_RDONLY | syscall.O_NONBLOCK
	if !follow {
		flags |= syscall.O_NOFOLLOW
	}
	f, err := os.OpenFile(abs, flags, 0)
	if err != nil {
		return nil, err
	}
	// Opened read-only: nothing is lost if its close fails.
	defer func() { _ = f.Close() }()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, syscall.EINVAL
	}
	if fi.Size() > limit {
		return nil, errTooLarge
	}
	data, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(data)) > limit {
		return nil, errTooLarge // it grew
	}
	return data, nil
}

// skipReason is how a failed content read is reported.
func skipReason(err error) string {
	if errors.Is(err, errTooLarge) {
		return SkipTooLarge
	}
	return SkipUnreadable
}

// errorObject renders err as the protocol's error object inside a result.
func errorObject(err error) *jsonrpc.ErrorObject {
	var e *jsonrpc.Error
	if !errors.As(err, &e) {
		e = jsonrpc.Errorf(jsonrpc.KindInternal, "The daemon failed: %v.", err)
	}
	obj := e.Object()
	return &obj
}

// walkRoot checks that root is a directory a walk can start from (a
// symlink there is followed).
func walkRoot(root string) error {
	fi, err := os.Stat(root)
	if err != nil {
		return fsError(root, err)
	}
	if !fi.IsDir() {
		return jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "notDirectory", "The root %s is not a directory.", root)
	}
	return nil
}
