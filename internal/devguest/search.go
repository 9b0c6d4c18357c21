package devguest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"regexp"
	"strings"
	"unicode/utf8"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// MaxLineBytes bounds the text of one fs/searchText match.
const MaxLineBytes = 1024

// addSkip counts one more skipped entry, saturating.
func addSkip(n *uint32) {
	if *n < math.MaxUint32 {
		*n++
	}
}

func (d *Daemon) newBudget() *resultBudget {
	return &resultBudget{left: d.resultBudget}
}

// rootWalker is what fs/searchText and fs/globFiles set up alike: the
// root checked, its filter compiled, a result budget, and a walker that
// counts what it skips in skipped.
func (d *Daemon) rootWalker(ctx context.Context, root string, f WalkFilter, skipped *uint32) (*walker, *resultBudget, error) {
	if e := checkPath("root", root); e != nil {
		return nil, nil, e
	}
	filter, e := compileFilter("", f)
	if e != nil {
		return nil, nil, e
	}
	if err := walkRoot(root); err != nil {
		return nil, nil, err
	}
	w := &walker{ctx: ctx, filter: filter, skip: func(string, string) { addSkip(skipped) }, paused: d.walkPaused}
	return w, d.newBudget(), nil
}

func (d *Daemon) searchText(ctx context.Context, raw json.RawMessage) (any, error) {
	var p SearchTextParams
	if err := jsonrpc.DecodeParams(raw, &p); err != nil {
		return nil, err
	}
	if p.Pattern == "" || len(p.Pattern) > MaxPatternBytes {
		return nil, jsonrpc.InvalidParams("pattern", "The member pattern must be a regular expression of 1 to %d bytes.", MaxPatternBytes)
	}
	expr := p.Pattern
	if p.IgnoreCase {
		expr = "(?i)" + expr
	}
	re, err := regexp.Compile(expr)
	if err != nil {
		return nil, jsonrpc.InvalidParams("pattern", "The member pattern is not a regular expression in Go's RE2 syntax: %v.", err)
	}
	var res SearchTextResult
	w, budget, err := d.rootWalker(ctx, p.Root, p.WalkFilter, &res.SkippedCount)
	if err != nil {
		return nil, err
	}
	w.visit = func(e walkEntry) bool {
		if !e.info.Mode().IsRegular() {
			return false // symlinks are not followed; FIFOs and devices are not text
		}
		data, err := readContent(e.abs, budget.left, false)
		if err != nil {
			addSkip(&res.SkippedCount)
			return false
		}
		if bytes.IndexByte(data, 0) >= 0 {
			return false // binary
		}
		for n := 1; len(data) > 0; n++ {
			line := data
			if i := bytes.IndexByte(data, '\n'); i >= 0 {
				line, data = data[:i], data[i+1:]
			} else {
				data = nil
			}
			line = bytes.TrimSuffix(line, []byte("\r"))
			if !re.Match(line) {
				continue
			}
			m := TextMatch{Path: e.rel, LineNumber: uint32(min(n, math.MaxUint32)), Text: lineText(line)}
			if !budget.charge(m) {
				res.Truncated = true
				return true
			}
			res.Matches = append(res.Matches, m)
		}
		return false
	}
	if err := w.walk(p.Root); err != nil {
		return nil, err
	}
	return res, nil
}

// lineText is a line as match text: bytes that are not UTF-8 replaced by
// U+FFFD, cut at a rune boundary to at most MaxLineBytes.
func lineText(line []byte) string {
	if len(line) > MaxLineBytes {
		line = line[:MaxLineBytes]
	}
	s := strings.ToValidUTF8(string(line), "\uFFFD")
	for len(s) > MaxLineBytes {
		_, size := utf8.DecodeLastRuneInString(s)
		s = s[:len(s)-size]
	}
	return s
}

func (d *Daemon) globFiles(ctx context.Context, raw json.RawMessage) (any, error) {
	var p GlobFilesParams
	if err := jsonrpc.DecodeParams(raw, &p); err != nil {
		return nil, err
	}
	var res GlobFilesResult
	w, budget, err := d.rootWalker(ctx, p.Root, p.WalkFilter, &res.SkippedCount)
	if err != nil {
		return nil, err
	}
	w.visit = func(e walkEntry) bool {
		if e.info.IsDir() {
			return false
		}
		if !budget.charge(e.rel) {
			res.Truncated = true
			return true
		}
		res.Paths = append(res.Paths, e.rel)
		return false
	}
	if err := w.walk(p.Root); err != nil {
		return nil, err
	}
	return res, nil
}

func (d *Daemon) scan(ctx context.Context, raw json.RawMessage) (any, error) {
	var p ScanParams
	if err := jsonrpc.DecodeParams(raw, &p); err != nil {
		return nil, err
	}
	if len(p.Roots) == 0 {
		return nil, jsonrpc.InvalidParams("roots", "The member roots must list at least one root.")
	}
	if ceiling := d.limits.Filesystem.MaxScanRoots; uint64(len(p.Roots)) > uint64(ceiling) {
		return nil, ceilingError("roots", uint64(ceiling), uint64(len(p.Roots)))
	}
	filters := make([]*walkFilter, len(p.Roots))
	for i, r := range p.Roots {
		prefix := fmt.Sprintf("roots[%d]", i)
		if e := checkPath(prefix+".path", r.Path); e != nil {
			return nil, e
		}
		f, e := compileFilter(prefix, r.WalkFilter)
		if e != nil {
			return nil, e
		}
		filters[i] = f
	}
	budget := d.newBudget()
	res := ScanResult{Roots: make([]ScanRootResult, len(p.Roots))}
	for i, r := range p.Roots {
		if ctx.Err() != nil {
			return nil, walkAborted()
		}
		if budget.spent {
			res.Roots[i] = ScanRootResult{Truncated: true}
			continue
		}
		rr, err := scanRoot(ctx, r, filters[i], budget, d.walkPaused)
		if err != nil {
			return nil, err
		}
		res.Roots[i] = rr
	}
	return res, nil
}

// scanRoot observes one root. Its own failures go into the result; only a
// cancellation fails the call.
func scanRoot(ctx context.Context, r ScanRoot, filter *walkFilter, budget *resultBudget, paused func(context.Context)) (ScanRootResult, error) {
	var res ScanRootResult
	fi, err := os.Stat(r.Path)
	if err != nil {
		return ScanRootResult{Error: errorObject(fsError(r.Path, err))}, nil
	}
	skip := func(rel, reason string) {
		addSkip(&res.SkippedCount)
		if len(res.Skipped) < MaxListedSkips {
			s := SkippedEntry{Path: strings.ToValidUTF8(rel, "\uFFFD"), Reason: reason}
			if budget.charge(s) {
				res.Skipped = append(res.Skipped, s)
			}
		}
	}
	// add lists one entry; it reports true when the budget is spent.
	add := func(rel, abs string, info os.FileInfo) bool {
		entry := ScanEntry{Path: rel, Metadata: metadataOf(abs, info)}
		if r.IncludeContent && entry.Kind == EntryFile {
			data, err := readContent(abs, budget.left, rel == ".")
			if err != nil {
				skip(rel, skipReason(err))
				return budget.spent
			}
			encoded := base64.StdEncoding.EncodeToString(data)
			entry.Data = &encoded
			if !budget.fits(entry) {
				skip(rel, SkipTooLarge) // its content, encoded, does not fit
				return budget.spent
			}
		}
		if !budget.charge(entry) {
			return true
		}
		res.Entries = append(res.Entries, entry)
		return false
	}
	if add(".", r.Path, fi) {
		res.Truncated = true
		return res, nil
	}
	if fi.IsDir() {
		w := &walker{ctx: ctx, filter: filter, skip: skip, paused: paused}
		w.visit = func(e walkEntry) bool { return add(e.rel, e.abs, e.info) }
		if err := w.walk(r.Path); err != nil {
			if e := (*jsonrpc.Error)(nil); errors.As(err, &e) && e.Kind == jsonrpc.KindAborted {
				return res, err
			}
			return ScanRootResult{Error: errorObject(err)}, nil
		}
	}
	res.Truncated = budget.spent
	res.Version = scanVersion(res)
	return res, nil
}

// scanVersion fingerprints what a root listed: every entry's path and
// metadata (a file's version covers its content) and the skips.
func scanVersion(res ScanRootResult) string {
	h := sha256.New()
	enc := json.NewEncoder(h)
	for _, e := range res.Entries {
		e.Data = nil
		_ = enc.Encode(e)
	}
	for _, s := range res.Skipped {
		_ = enc.Encode(s)
	}
	_ = enc.Encode([]any{res.SkippedCount, res.Truncated})
	return "scan:v1:" + hex.EncodeToString(h.Sum(nil)[:16])
}
