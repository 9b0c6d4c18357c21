package devguest

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// writeTree creates files (and, for names ending in "/", directories)
// below root.
func writeTree(t *testing.T, root string, files map[string]string) {
	t.Helper()
	for rel, content := range files {
		p := filepath.Join(root, rel)
		if strings.HasSuffix(rel, "/") {
			if err := os.MkdirAll(p, 0o755); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func call(t *testing.T, c *jsonrpc.Client, method string, params map[string]any, result any) {
	t.Helper()
	if err := c.Call(ctx(t), method, params, result); err != nil {
		t.Fatalf("%s %v: %v", method, params, err)
	}
}

// errorCase is a request and the error it must answer.
type errorCase struct {
	method string
	params map[string]any
	kind   jsonrpc.Kind
	field  string
	reason string
}

func checkErrors(t *testing.T, c *jsonrpc.Client, cases []errorCase) {
	t.Helper()
	for _, tc := range cases {
		err := c.Call(ctx(t), tc.method, tc.params, nil)
		var e *jsonrpc.Error
		if !errors.As(err, &e) {
			t.Errorf("%s %v: want %s, got %v", tc.method, tc.params, tc.kind, err)
			continue
		}
		if e.Kind != tc.kind || e.Field != tc.field || e.Reason != tc.reason {
			t.Errorf("%s %v: %s field %q reason %q, want %s %q %q (%s)", tc.method, tc.params, e.Kind, e.Field, e.Reason, tc.kind, tc.field, tc.reason, e.Message)
		}
	}
}

func TestFSEntries(t *testing.T) {
	_, url := serve(t, Config{})
	c := initialized(t, url)
	dir := t.TempDir()
	writeTree(t, dir, map[string]string{"f.txt": "hello", "full/inner.txt": "x", "empty/": ""})
	file := filepath.Join(dir, "f.txt")
	if err := os.Chmod(file, 0o750); err != nil {
		t.Fatal(err)
	}
	for name, target := range map[string]string{"link": "f.txt", "dangling": "nope", "loop1": "loop2", "loop2": "loop1"} {
		if err := os.Symlink(target, filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}

	// fs/getMetadata, with and without following a link.
	var read ReadFileResult
	call(t, c, "fs/readFile", map[string]any{"path": file, "maxBytes": 10}, &read)
	fi, err := os.Stat(file)
	if err != nil {
		t.Fatal(err)
	}
	var m Metadata
	call(t, c, "fs/getMetadata", map[string]any{"path": file}, &m)
	if want := (Metadata{Kind: "file", SizeBytes: 5, ModifiedAtMs: fi.ModTime().UnixMilli(), Executable: true, Version: read.Version}); m != want {
		t.Fatalf("file metadata %+v, want %+v", m, want)
	}
	m = Metadata{}
	call(t, c, "fs/getMetadata", map[string]any{"path": filepath.Join(dir, "link")}, &m)
	if m.Kind != "symlink" || m.SymlinkTarget != "f.txt" || m.Version != "" || m.Executable {
		t.Fatalf("link metadata %+v", m)
	}
	m = Metadata{}
	call(t, c, "fs/getMetadata", map[string]any{"path": filepath.Join(dir, "link"), "followSymlink": true}, &m)
	if m.Kind != "file" || m.Version != read.Version || m.SymlinkTarget != "" {
		t.Fatalf("followed link metadata %+v", m)
	}
	for path, kind := range map[string]string{dir: "directory", "/dev/null": "other", "/": "directory"} {
		m = Metadata{}
		call(t, c, "fs/getMetadata", map[string]any{"path": path}, &m)
		if m.Kind != kind || m.Version != "" || m.Executable {
			t.Errorf("%s: metadata %+v, want kind %s", path, m, kind)
		}
	}

	// fs/createDirectory.
	var empty Empty
	call(t, c, "fs/createDirectory", map[string]any{"path": filepath.Join(dir, "new")}, &empty)
	deep := filepath.Join(dir, "a", "b", "c")
	call(t, c, "fs/createDirectory", map[string]any{"path": deep, "parents": true}, &empty)
	call(t, c, "fs/createDirectory", map[string]any{"path": deep, "parents": true}, &empty) // again: fine
	for _, p := range []string{filepath.Join(dir, "new"), deep} {
		if fi, err := os.Stat(p); err != nil || !fi.IsDir() {
			t.Fatalf("%s: %v %v", p, fi, err)
		}
	}

	// fs/rename, then fs/remove.
	moved := filepath.Join(dir, "moved.txt")
	call(t, c, "fs/rename", map[string]any{"source": filepath.Join(dir, "full", "inner.txt"), "destination": moved}, &empty)
	if got, _ := os.ReadFile(moved); string(got) != "x" {
		t.Fatalf("renamed file holds %q", got)
	}
	call(t, c, "fs/rename", map[string]any{"source": moved, "destination": file, "overwrite": true}, &empty)
	if got, _ := os.ReadFile(file); string(got) != "x" {
		t.Fatalf("overwritten file holds %q", got)
	}
	if _, err := os.Lstat(moved); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("the source is still there: %v", err)
	}
	call(t, c, "fs/rename", map[string]any{"source": filepath.Join(dir, "a"), "destination": filepath.Join(dir, "a2")}, &empty)
	if _, err := os.Stat(filepath.Join(dir, "a2", "b", "c")); err != nil {
		t.Fatal(err)
	}

	call(t, c, "fs/remove", map[string]any{"path": filepath.Join(dir, "link")}, &empty)
	if _, err := os.Stat(file); err != nil {
		t.Fatalf("removing the link removed its target: %v", err)
	}
	call(t, c, "fs/remove", map[string]any{"path": filepath.Join(dir, "empty")}, &empty)
	call(t, c, "fs/remove", map[string]any{"path": filepath.Join(dir, "a2"), "recursive": true}, &empty)
	call(t, c, "fs/remove", map[string]any{"path": filepath.Join(dir, "dangling")}, &empty)
	call(t, c, "fs/remove", map[string]any{"path": file}, &empty)
	for _, gone := range []string{"link", "empty", "a2", "dangling", "f.txt"} {
		if _, err := os.Lstat(filepath.Join(dir, gone)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s survived its removal: %v", gone, err)
		}
	}
}

func TestFSEntryErrors(t *testing.T) {
	_, url := serve(t, Config{})
	c := initialized(t, url)
	dir := t.TempDir()
	writeTree(t, dir, map[string]string{"f.txt": "hello", "g.txt": "g", "full/inner.txt": "x", "other/x": "", "empty/": ""})
	for name, target := range map[string]string{"dangling": "nope", "loop1": "loop2", "loop2": "loop1"} {
		if err := os.Symlink(target, filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	at := func(rel string) string { return filepath.Join(dir, rel) }
	const failed, notFound, invalid = jsonrpc.KindFailedPrecondition, jsonrpc.KindNotFound, jsonrpc.KindInvalidParams
	checkErrors(t, c, []errorCase{
		{"fs/createDirectory", map[string]any{"path": at("full")}, jsonrpc.KindAlreadyExists, "", ""},
		{"fs/createDirectory", map[string]any{"path": at("f.txt")}, jsonrpc.KindAlreadyExists, "", ""},
		{"fs/createDirectory", map[string]any{"path": at("missing/x")}, notFound, "", ""},
		{"fs/createDirectory", map[string]any{"path": at("f.txt"), "parents": true}, failed, "", "notDirectory"},
		{"fs/createDirectory", map[string]any{"path": at("f.txt/x"), "parents": true}, failed, "", "notDirectory"},
		{"fs/createDirectory", map[string]any{"path": at("dangling"), "parents": true}, failed, "", "notDirectory"},
		{"fs/createDirectory", map[string]any{"path": "rel/x"}, invalid, "path", ""},
		{"fs/createDirectory", map[string]any{"path": at("x"), "parents": 1}, invalid, "parents", ""},

		{"fs/getMetadata", map[string]any{"path": at("missing")}, notFound, "", ""},
		{"fs/getMetadata", map[string]any{"path": at("dangling"), "followSymlink": true}, notFound, "", ""},
		{"fs/getMetadata", map[string]any{"path": at("loop1"), "followSymlink": true}, failed, "", "symlinkLoop"},
		{"fs/getMetadata", map[string]any{"path": at("f.txt/x")}, failed, "", "notDirectory"},
		{"fs/getMetadata", map[string]any{"path": at("f.txt"), "follow": true}, invalid, "follow", ""},
		{"fs/getMetadata", map[string]any{"path": dir + "/../x"}, invalid, "path", ""},

		{"fs/readDirectory", map[string]any{"path": at("f.txt"), "maxEntries": 1}, failed, "", "notDirectory"},
		{"fs/readDirectory", map[string]any{"path": at("missing"), "maxEntries": 1}, notFound, "", ""},
		{"fs/readDirectory", map[string]any{"path": dir, "maxEntries": 0}, invalid, "maxEntries", ""},
		{"fs/readDirectory", map[string]any{"path": dir}, invalid, "maxEntries", ""},
		{"fs/readDirectory", map[string]any{"path": dir, "maxEntries": 1, "cursor": "bogus"}, invalid, "cursor", ""},
		{"fs/readDirectory", map[string]any{"path": dir, "maxEntries": 1, "cursor": cursorPrefix + "a_-/"}, invalid, "cursor", ""},

		{"fs/remove", map[string]any{"path": at("full")}, failed, "", "notEmpty"},
		{"fs/remove", map[string]any{"path": at("missing")}, notFound, "", ""},
		{"fs/remove", map[string]any{"path": "/"}, failed, "", "filesystemRoot"},
		{"fs/remove", map[string]any{"path": "/", "recursive": true}, failed, "", "filesystemRoot"},
		{"fs/remove", map[string]any{"path": at("f.txt/x")}, failed, "", "notDirectory"},

		{"fs/rename", map[string]any{"source": at("missing"), "destination": at("m2")}, notFound, "", ""},
		{"fs/rename", map[string]any{"source": at("f.txt"), "destination": at("g.txt")}, jsonrpc.KindAlreadyExists, "", ""},
		{"fs/rename", map[string]any{"source": at("empty"), "destination": at("full")}, jsonrpc.KindAlreadyExists, "", ""},
		{"fs/rename", map[string]any{"source": at("empty"), "destination": at("full"), "overwrite": true}, failed, "", "notEmpty"},
		{"fs/rename", map[string]any{"source": at("f.txt"), "destination": at("empty"), "overwrite": true}, failed, "", "isDirectory"},
		{"fs/rename", map[string]any{"source": at("empty"), "destination": at("f.txt"), "overwrite": true}, failed, "", "notDirectory"},
		{"fs/rename", map[string]any{"source": at("f.txt"), "destination": at("missing/f.txt")}, notFound, "", ""},
		// /proc is always another filesystem than a test's temporary directory.
		{"fs/rename", map[string]any{"source": at("f.txt"), "destination": "/proc/lsenvd-dev-test"}, failed, "", "crossDevice"},
		{"fs/rename", map[string]any{"source": at("f.txt"), "destination": "/proc/lsenvd-dev-test", "overwrite": true}, failed, "", "crossDevice"},
		{"fs/rename", map[string]any{"source": at("full"), "destination": at("full/inner")}, invalid, "destination", ""},
		{"fs/rename", map[string]any{"source": "/", "destination": at("root")}, failed, "", "filesystemRoot"},
		{"fs/rename", map[string]any{"source": at("f.txt"), "destination": "/", "overwrite": true}, failed, "", "filesystemRoot"},
		{"fs/rename", map[string]any{"source": at("f.txt")}, invalid, "destination", ""},
		{"fs/rename", map[string]any{"source": at("f.txt"), "destination": "x"}, invalid, "destination", ""},
	})
	// Nothing moved.
	for _, rel := range []string{"f.txt", "g.txt", "full/inner.txt", "empty"} {
		if _, err := os.Lstat(at(rel)); err != nil {
			t.Errorf("%s: %v", rel, err)
		}
	}
	if got, _ := os.ReadFile(at("g.txt")); string(got) != "g" {
		t.Errorf("g.txt was replaced: %q", got)
	}
}

func TestReadDirectoryPages(t *testing.T) {
	limits := DefaultLimits
	_, url := serve(t, Config{Limits: limits})
	c := initialized(t, url)
	dir := t.TempDir()
	writeTree(t, dir, map[string]string{"c": "ccc", "a": "a", "e": "", "b": "bb", "d": "", "z/": ""})
	// A name that is not UTF-8 sorts last, and is skipped and counted.
	if err := os.WriteFile(filepath.Join(dir, "\xff"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("a", filepath.Join(dir, "l")); err != nil {
		t.Fatal(err)
	}
	var pages [][]DirectoryEntry
	var skipped uint32
	cursor := ""
	for range 10 {
		params := map[string]any{"path": dir, "maxEntries": 3}
		if cursor != "" {
			params["cursor"] = cursor
		}
		var page ReadDirectoryResult
		call(t, c, "fs/readDirectory", params, &page)
		pages = append(pages, page.Entries)
		skipped += page.SkippedCount
		if cursor = page.NextCursor; cursor == "" {
			break
		}
		if !strings.HasPrefix(cursor, "dir:v1:") {
			t.Fatalf("cursor %q", cursor)
		}
	}
	want := [][]DirectoryEntry{
		{{"a", "file", 1}, {"b", "file", 2}, {"c", "file", 3}},
		{{"d", "file", 0}, {"e", "file", 0}, {"l", "symlink", 1}},
		nil, // z is a directory of the OS's own size, checked below
	}
	if len(pages) != 3 || !slices.Equal(pages[0], want[0]) || !slices.Equal(pages[1], want[1]) ||
		len(pages[2]) != 1 || pages[2][0].Name != "z" || pages[2][0].Kind != "directory" || skipped != 1 {
		t.Fatalf("pages %+v, skipped %d", pages, skipped)
	}

	// The whole directory in one page: no cursor.
	var all ReadDirectoryResult
	call(t, c, "fs/readDirectory", map[string]any{"path": dir, "maxEntries": 100}, &all)
	if len(all.Entries) != 7 || all.NextCursor != "" || all.SkippedCount != 1 {
		t.Fatalf("one page %+v", all)
	}
	// An empty directory.
	var none ReadDirectoryResult
	call(t, c, "fs/readDirectory", map[string]any{"path": filepath.Join(dir, "z"), "maxEntries": 1}, &none)
	if len(none.Entries) != 0 || none.NextCursor != "" || none.SkippedCount != 0 {
		t.Fatalf("empty directory %+v", none)
	}
	err := c.Call(ctx(t), "fs/readDirectory", map[string]any{"path": dir, "maxEntries": limits.Filesystem.MaxDirectoryEntries + 1}, nil)
	if e := rpcError(t, err, jsonrpc.KindInvalidParams); e.Field != "maxEntries" || e.Ceiling == nil || *e.Ceiling != uint64(limits.Filesystem.MaxDirectoryEntries) {
		t.Fatalf("ceiling refusal %+v", e)
	}
}

// walkTree is the tree the walk tests share.
func walkTree(t *testing.T) string {
	dir := t.TempDir()
	writeTree(t, dir, map[string]string{
		".gitignore":         "# build output\n*.log\nignored-dir/\n",
		"a.go":               "package a\n",
		"a.log":              "log\n",
		"b.txt":              "bee\n",
		".hidden":            "h\n",
		".git/config":        "[core]\n",
		"ignored-dir/x.go":   "package x\n",
		"src/main.go":        "package main\n",
		"src/.gitignore":     "helper.go\n",
		"src/util/helper.go": "package util\n",
		"src/util/.env":      "A=1\n",
		"docs/readme.MD":     "# Read me\n",
	})
	if err := os.Symlink("a.go", filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestGlobFilesFilter(t *testing.T) {
	_, url := serve(t, Config{})
	c := initialized(t, url)
	dir := walkTree(t)
	for _, tc := range []struct {
		filter map[string]any
		want   []string
	}{
		{nil, []string{"a.go", "b.txt", "docs/readme.MD", "link", "src/main.go"}},
		{map[string]any{"includeIgnored": true}, []string{"a.go", "a.log", "b.txt", "docs/readme.MD", "ignored-dir/x.go", "link", "src/main.go", "src/util/helper.go"}},
		{map[string]any{"includeHidden": true}, []string{".gitignore", ".hidden", "a.go", "b.txt", "docs/readme.MD", "link", "src/.gitignore", "src/main.go", "src/util/.env"}},
		{map[string]any{"include": []string{"*.go"}}, []string{"a.go", "src/main.go"}},
		{map[string]any{"include": []string{"*.go"}, "includeIgnored": true}, []string{"a.go", "ignored-dir/x.go", "src/main.go", "src/util/helper.go"}},
		{map[string]any{"include": []string{"/*.go"}}, []string{"a.go"}},
		{map[string]any{"include": []string{"src"}}, []string{"src/main.go"}},
		{map[string]any{"include": []string{"**/util/**"}, "includeIgnored": true, "includeHidden": true}, []string{"src/util/.env", "src/util/helper.go"}},
		{map[string]any{"include": []string{"{a,b}.*"}}, []string{"a.go", "b.txt"}},
		{map[string]any{"exclude": []string{"src"}}, []string{"a.go", "b.txt", "docs/readme.MD", "link"}},
		{map[string]any{"exclude": []string{"*.txt", "docs/"}}, []string{"a.go", "link", "src/main.go"}},
		{map[string]any{"maxDepth": 1}, []string{"a.go", "b.txt", "link"}},
		{map[string]any{"maxDepth": 2, "includeIgnored": true}, []string{"a.go", "a.log", "b.txt", "docs/readme.MD", "ignored-dir/x.go", "link", "src/main.go"}},
		{map[string]any{"include": []string{"*.md"}}, nil},
		{map[string]any{"include": []string{"*.md"}, "ignoreCase": true}, []string{"docs/readme.MD"}},
	} {
		params := map[string]any{"root": dir}
		for k, v := range tc.filter {
			params[k] = v
		}
		var res GlobFilesResult
		call(t, c, "fs/globFiles", params, &res)
		if !slices.Equal(res.Paths, tc.want) || res.SkippedCount != 0 || res.Truncated {
			t.Errorf("filter %v: %q (skipped %d, truncated %v), want %q", tc.filter, res.Paths, res.SkippedCount, res.Truncated, tc.want)
		}
	}

	const failed, invalid = jsonrpc.KindFailedPrecondition, jsonrpc.KindInvalidParams
	checkErrors(t, c, []errorCase{
		{"fs/globFiles", map[string]any{"root": dir, "maxDepth": 0}, invalid, "maxDepth", ""},
		{"fs/globFiles", map[string]any{"root": dir, "include": []string{"*.go", "[abc"}}, invalid, "include[1]", ""},
		{"fs/globFiles", map[string]any{"root": dir, "exclude": []string{""}}, invalid, "exclude[0]", ""},
		{"fs/globFiles", map[string]any{"root": dir, "colour": "red"}, invalid, "colour", ""},
		{"fs/globFiles", map[string]any{"root": filepath.Join(dir, "a.go")}, failed, "", "notDirectory"},
		{"fs/globFiles", map[string]any{"root": filepath.Join(dir, "missing")}, jsonrpc.KindNotFound, "", ""},
		{"fs/globFiles", map[string]any{"root": "relative"}, invalid, "root", ""},
	})
}

func TestSearchText(t *testing.T) {
	dir := t.TempDir()
	long := strings.Repeat("x", 3000) + "alpha"
	writeTree(t, dir, map[string]string{
		"a.txt":     "alpha\nbeta\nAlpha beta\n",
		"bin.dat":   "alpha\x00",
		"long.txt":  long,
		"sub/b.txt": "gamma\r\nalpha\r\n",
	})
	// Unrepresentable names are skipped and counted, never fatal.
	if err := os.WriteFile(filepath.Join(dir, "\xffbad.txt"), []byte("alpha\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	search := func(c *jsonrpc.Client, extra map[string]any) SearchTextResult {
		t.Helper()
		params := map[string]any{"root": dir, "pattern": "alpha"}
		for k, v := range extra {
			params[k] = v
		}
		var res SearchTextResult
		call(t, c, "fs/searchText", params, &res)
		return res
	}
	_, url := serve(t, Config{})
	c := initialized(t, url)
	cut := long[:MaxLineBytes]
	for _, tc := range []struct {
		extra   map[string]any
		want    []TextMatch
		skipped uint32
	}{
		{nil, []TextMatch{{"a.txt", 1, "alpha"}, {"long.txt", 1, cut}, {"sub/b.txt", 2, "alpha"}}, 1},
		{map[string]any{"ignoreCase": true}, []TextMatch{{"a.txt", 1, "alpha"}, {"a.txt", 3, "Alpha beta"}, {"long.txt", 1, cut}, {"sub/b.txt", 2, "alpha"}}, 1},
		{map[string]any{"pattern": `^(beta|gamma)$`}, []TextMatch{{"a.txt", 2, "beta"}, {"sub/b.txt", 1, "gamma"}}, 1},
		// A name that is not UTF-8 cannot be matched against patterns: it is skipped whatever the filter.
		{map[string]any{"include": []string{"sub/**"}}, []TextMatch{{"sub/b.txt", 2, "alpha"}}, 1},
		{map[string]any{"maxDepth": 1, "exclude": []string{"long.txt"}}, []TextMatch{{"a.txt", 1, "alpha"}}, 1},
		{map[string]any{"pattern": "nothing matches this"}, nil, 1},
	} {
		res := search(c, tc.extra)
		if !slices.Equal(res.Matches, tc.want) || res.SkippedCount != tc.skipped || res.Truncated {
			t.Errorf("%v: %+v", tc.extra, res)
		}
	}
	checkErrors(t, c, []errorCase{
		{"fs/searchText", map[string]any{"root": dir, "pattern": "("}, jsonrpc.KindInvalidParams, "pattern", ""},
		{"fs/searchText", map[string]any{"root": dir, "pattern": ""}, jsonrpc.KindInvalidParams, "pattern", ""},
		{"fs/searchText", map[string]any{"root": dir}, jsonrpc.KindInvalidParams, "pattern", ""},
		{"fs/searchText", map[string]any{"root": dir, "pattern": "a", "include": []string{"{x"}}, jsonrpc.KindInvalidParams, "include[0]", ""},
		{"fs/searchText", map[string]any{"root": filepath.Join(dir, "a.txt"), "pattern": "a"}, jsonrpc.KindFailedPrecondition, "", "notDirectory"},
	})

	// A small budget: a file larger than what is left is skipped and
	// counted; a match that no longer fits ends the walk as truncated.
	_, url = serve(t, Config{ResultBudgetBytes: 200})
	res := search(initialized(t, url), nil)
	if want := []TextMatch{{"a.txt", 1, "alpha"}, {"sub/b.txt", 2, "alpha"}}; !slices.Equal(res.Matches, want) || res.SkippedCount != 2 || res.Truncated {
		t.Fatalf("budget 200: %+v", res)
	}
	// Room for the first match and for sub/b.txt, but not for its match.
	first := TextMatch{"a.txt", 1, "alpha"}
	budget := cost(first) + int64(len("gamma\r\nalpha\r\n"))
	_, url = serve(t, Config{ResultBudgetBytes: budget})
	res = search(initialized(t, url), nil)
	if want := []TextMatch{first}; !slices.Equal(res.Matches, want) || !res.Truncated || res.SkippedCount != 1 {
		t.Fatalf("budget %d: %+v", budget, res)
	}
}

func TestScan(t *testing.T) {
	_, url := serve(t, Config{})
	c := initialized(t, url)
	tree := t.TempDir()
	writeTree(t, tree, map[string]string{"conf/a.json": `{"x":1}`, "conf/b.txt": "bee", "conf/.hidden": "h", "single.txt": "single", "many/": ""})
	conf, single, many := filepath.Join(tree, "conf"), filepath.Join(tree, "single.txt"), filepath.Join(tree, "many")
	for i := range MaxListedSkips + 5 {
		if err := os.WriteFile(filepath.Join(many, fmt.Sprintf("\xff%03d", i)), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	scan := func(roots ...map[string]any) ScanResult {
		t.Helper()
		var res ScanResult
		call(t, c, "fs/scan", map[string]any{"roots": roots}, &res)
		if len(res.Roots) != len(roots) {
			t.Fatalf("%d roots answered for %d", len(res.Roots), len(roots))
		}
		return res
	}
	paths := func(r ScanRootResult) []string {
		var out []string
		for _, e := range r.Entries {
			out = append(out, e.Path)
		}
		return out
	}
	b64 := func(s string) *string { e := base64.StdEncoding.EncodeToString([]byte(s)); return &e }

	res := scan(
		map[string]any{"path": conf, "includeContent": true},
		map[string]any{"path": single, "includeContent": true},
		map[string]any{"path": filepath.Join(tree, "missing")},
		map[string]any{"path": many},
		map[string]any{"path": conf, "include": []string{"*.json"}, "includeHidden": true},
	)
	r := res.Roots[0]
	if !slices.Equal(paths(r), []string{".", "a.json", "b.txt"}) || r.Error != nil || r.Truncated || r.SkippedCount != 0 || !strings.HasPrefix(r.Version, "scan:v1:") {
		t.Fatalf("root 0: %+v", r)
	}
	if e := r.Entries[0]; e.Kind != "directory" || e.Data != nil {
		t.Fatalf("root 0 itself: %+v", e)
	}
	if e := r.Entries[1]; e.Kind != "file" || e.SizeBytes != 7 || e.Data == nil || *e.Data != *b64(`{"x":1}`) || !strings.HasPrefix(e.Version, "file:v1:") {
		t.Fatalf("root 0 a.json: %+v", e)
	}
	if r := res.Roots[1]; len(r.Entries) != 1 || r.Entries[0].Path != "." || r.Entries[0].Kind != "file" || *r.Entries[0].Data != *b64("single") {
		t.Fatalf("root 1 (a file): %+v", r)
	}
	// A root that fails is reported with the error object, not as the call's error.
	if r := res.Roots[2]; r.Error == nil || r.Error.Data.Kind != "notFound" || r.Error.Code != jsonrpc.KindNotFound.Code() || r.Error.Message == "" ||
		len(r.Entries) != 0 || r.Version != "" {
		t.Fatalf("root 2 (missing): %+v", r)
	}
	// At most 100 skipped entries are listed; the rest are counted.
	if r := res.Roots[3]; !slices.Equal(paths(r), []string{"."}) || len(r.Skipped) != MaxListedSkips || r.SkippedCount != MaxListedSkips+5 ||
		r.Skipped[0] != (SkippedEntry{Path: "\uFFFD000", Reason: "unrepresentable"}) {
		t.Fatalf("root 3 (skips): %d listed, %d counted, first %+v", len(r.Skipped), r.SkippedCount, r.Skipped[0])
	}
	if r := res.Roots[4]; !slices.Equal(paths(r), []string{".", "a.json"}) || r.Entries[1].Data != nil {
		t.Fatalf("root 4 (filtered): %+v", r)
	}

	// The same tree scans to the same version; a change changes it.
	again := scan(map[string]any{"path": conf, "includeContent": true})
	if again.Roots[0].Version != r.Version {
		t.Fatalf("version moved without a change: %s, then %s", r.Version, again.Roots[0].Version)
	}
	if err := os.WriteFile(filepath.Join(conf, "b.txt"), []byte("changed"), 0o644); err != nil {
		t.Fatal(err)
	}
	if changed := scan(map[string]any{"path": conf, "includeContent": true}); changed.Roots[0].Version == r.Version {
		t.Fatal("version did not change with the content")
	}

	const invalid = jsonrpc.KindInvalidParams
	tooMany := make([]map[string]any, DefaultLimits.Filesystem.MaxScanRoots+1)
	for i := range tooMany {
		tooMany[i] = map[string]any{"path": conf}
	}
	checkErrors(t, c, []errorCase{
		{"fs/scan", map[string]any{}, invalid, "roots", ""},
		{"fs/scan", map[string]any{"roots": []any{}}, invalid, "roots", ""},
		{"fs/scan", map[string]any{"roots": []any{map[string]any{"path": conf}, map[string]any{"path": "x"}}}, invalid, "roots[1].path", ""},
		{"fs/scan", map[string]any{"roots": []any{map[string]any{"path": conf, "maxDepth": 0}}}, invalid, "roots[0].maxDepth", ""},
		{"fs/scan", map[string]any{"roots": []any{map[string]any{"path": conf, "exclude": []string{"a}"}}}}, invalid, "roots[0].exclude[0]", ""},
		{"fs/scan", map[string]any{"roots": []any{map[string]any{"path": conf, "content": true}}}, invalid, "roots[0].content", ""},
	})
	err := c.Call(ctx(t), "fs/scan", map[string]any{"roots": tooMany}, nil)
	if e := rpcError(t, err, invalid); e.Field != "roots" || e.Ceiling == nil || *e.Ceiling != uint64(DefaultLimits.Filesystem.MaxScanRoots) {
		t.Fatalf("too many roots: %+v", e)
	}
}

func TestScanBudget(t *testing.T) {
	tree := t.TempDir()
	files := map[string]string{"a/big.txt": strings.Repeat("b", 1000), "a/small.txt": "s"}
	for i := range 20 {
		files[fmt.Sprintf("b/file%02d", i)] = ""
	}
	writeTree(t, tree, files)
	_, url := serve(t, Config{ResultBudgetBytes: 500})
	c := initialized(t, url)
	var res ScanResult
	call(t, c, "fs/scan", map[string]any{"roots": []any{
		map[string]any{"path": filepath.Join(tree, "a"), "includeContent": true},
		map[string]any{"path": filepath.Join(tree, "b")},
		map[string]any{"path": filepath.Join(tree, "a")},
	}}, &res)
	a, b, last := res.Roots[0], res.Roots[1], res.Roots[2]
	if a.Truncated || len(a.Entries) != 2 || a.Entries[1].Path != "small.txt" || a.Entries[1].Data == nil ||
		!slices.Equal(a.Skipped, []SkippedEntry{{"big.txt", "tooLarge"}}) || a.SkippedCount != 1 {
		t.Fatalf("root a: %+v", a)
	}
	if !b.Truncated || len(b.Entries) == 0 || len(b.Entries) >= 21 {
		t.Fatalf("root b: truncated %v with %d entries", b.Truncated, len(b.Entries))
	}
	if !last.Truncated || len(last.Entries) != 0 || last.Error != nil {
		t.Fatalf("the root after the budget ran out: %+v", last)
	}
}

func TestScanIsNotUse(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1000, 0)}
	_, url := serve(t, Config{Now: clock.now})
	c := initialized(t, url)
	dir := walkTree(t)
	clock.advance(5 * time.Second)
	call(t, c, "fs/scan", map[string]any{"roots": []any{map[string]any{"path": dir}}}, nil)
	if r := getIdle(t, c); r.IdleForMs != 5000 {
		t.Fatalf("idleForMs %d after fs/scan, want 5000", r.IdleForMs)
	}
	for _, m := range []struct {
		method string
		params map[string]any
	}{
		{"fs/globFiles", map[string]any{"root": dir}},
		{"fs/searchText", map[string]any{"root": dir, "pattern": "x"}},
		{"fs/getMetadata", map[string]any{"path": dir}},
		{"fs/readDirectory", map[string]any{"path": dir, "maxEntries": 1}},
	} {
		clock.advance(time.Second)
		call(t, c, m.method, m.params, nil)
		if r := getIdle(t, c); r.IdleForMs != 0 {
			t.Fatalf("idleForMs %d after %s, want 0", r.IdleForMs, m.method)
		}
	}
}

// rawSession is a data connection driven frame by frame, to interleave a
// request with its $/cancelRequest.
type rawSession struct {
	t  *testing.T
	ws *websocket.Conn
}

type rawAnswer struct {
	ID     json.RawMessage `json:"id"`
	Result json.RawMessage `json:"result"`
	Error  *jsonrpc.Error  `json:"error"`
}

func (s rawSession) send(msg string) {
	s.t.Helper()
	if err := s.ws.WriteMessage(websocket.TextMessage, []byte(msg)); err != nil {
		s.t.Fatal(err)
	}
}

func (s rawSession) recv() rawAnswer {
	s.t.Helper()
	_ = s.ws.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, data, err := s.ws.ReadMessage()
	if err != nil {
		s.t.Fatal(err)
	}
	var a rawAnswer
	if err := json.Unmarshal(data, &a); err != nil {
		s.t.Fatalf("%s: %v", data, err)
	}
	return a
}

func TestWalksAreAbortable(t *testing.T) {
	entered := make(chan struct{}, 1)
	_, url := serveWith(t, Config{}, func(d *Daemon) {
		// Each walk stops at its first entry until it is cancelled.
		d.walkPaused = func(ctx context.Context) {
			select {
			case entered <- struct{}{}:
			default:
			}
			<-ctx.Done()
		}
	})
	ws, _, err := websocket.DefaultDialer.Dial(url, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	s := rawSession{t: t, ws: ws}
	s.send(`{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":5,"clientInfo":{"name":"raw"}}}`)
	if a := s.recv(); a.Error != nil {
		t.Fatal(a.Error)
	}
	dir := walkTree(t)
	for i, req := range []string{
		fmt.Sprintf(`"method":"fs/searchText","params":{"root":%q,"pattern":"package"}`, dir),
		fmt.Sprintf(`"method":"fs/globFiles","params":{"root":%q}`, dir),
		fmt.Sprintf(`"method":"fs/scan","params":{"roots":[{"path":%q}]}`, dir),
	} {
		id := fmt.Sprintf(`"walk-%d"`, i)
		s.send(`{"jsonrpc":"2.0","id":` + id + `,` + req + `}`)
		select {
		case <-entered:
		case <-time.After(10 * time.Second):
			t.Fatalf("%s never started walking", req)
		}
		s.send(`{"jsonrpc":"2.0","method":"$/cancelRequest","params":{"id":` + id + `}}`)
		a := s.recv()
		if string(a.ID) != id || a.Error == nil || a.Error.Kind != jsonrpc.KindAborted || a.Error.Reason != "cancelled" {
			t.Fatalf("%s: answer %s %+v %s", req, a.ID, a.Error, a.Result)
		}
	}
}
