package devguest

import (
	"encoding/json"

	"github.com/lightspeed-dev/incus-provider/internal/buildinfo"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// ProtocolVersion is the data-plane version this daemon speaks.
const ProtocolVersion = 5

// Plane is the plane this daemon serves.
const Plane = "data"

// BuildInfo is clientInfo or serverInfo: a peer's build, descriptive only.
type BuildInfo = buildinfo.Peer

// InitializeParams are the data-plane initialize params.
type InitializeParams struct {
	ProtocolVersion uint64    `json:"protocolVersion"`
	ClientInfo      BuildInfo `json:"clientInfo"`
}

// InitializeResult is the data-plane initialize response.
type InitializeResult struct {
	ProtocolVersion  uint64       `json:"protocolVersion"`
	Plane            string       `json:"plane"`
	ServerInfo       BuildInfo    `json:"serverInfo"`
	DaemonInstanceID string       `json:"daemonInstanceId"`
	Capabilities     Capabilities `json:"capabilities"`
	Limits           Limits       `json:"limits"`
	DefaultCwd       string       `json:"defaultCwd"`
	HomeDirectory    string       `json:"homeDirectory,omitempty"`
	Platform         Platform     `json:"platform"`
}

// Capabilities are the families this daemon serves. An absent family is
// unavailable; flags are omitted when false.
type Capabilities struct {
	Filesystem *FilesystemCapability `json:"filesystem,omitempty"`
	Process    *ProcessCapability    `json:"process,omitempty"`
}

// FilesystemCapability covers fs/*. Transfer is never set by this daemon.
type FilesystemCapability struct {
	Write    bool `json:"write,omitempty"`
	Transfer bool `json:"transfer,omitempty"`
}

// ProcessCapability covers process/*.
type ProcessCapability struct {
	Tree        string           `json:"tree"`
	Termination string           `json:"termination"`
	Interrupt   InterruptSupport `json:"interrupt"`
	Pty         bool             `json:"pty,omitempty"`
}

// InterruptSupport says which kinds of process can be interrupted.
type InterruptSupport struct {
	Pipe bool `json:"pipe,omitempty"`
	Pty  bool `json:"pty,omitempty"`
}

// Limits are the daemon's ceilings. A request above one is invalidParams
// naming the field and the ceiling; nothing is clamped. The per-family member
// names are this package's choice (the spec names only the families).
type Limits struct {
	MaxConcurrentRequests uint32           `json:"maxConcurrentRequests"`
	MaxWaitMs             uint64           `json:"maxWaitMs"`
	Filesystem            FilesystemLimits `json:"filesystem"`
	Process               ProcessLimits    `json:"process"`
}

// FilesystemLimits bound fs/readFile's maxBytes, fs/writeFile's data,
// fs/readDirectory's maxEntries and the number of fs/scan roots. The last
// two member names (maxDirectoryEntries, maxScanRoots) are this package's
// guesses.
type FilesystemLimits struct {
	MaxReadBytes  uint64 `json:"maxReadBytes"`
	MaxWriteBytes uint64 `json:"maxWriteBytes"`
	// MaxDirectoryEntries bounds fs/readDirectory's maxEntries.
	MaxDirectoryEntries uint32 `json:"maxDirectoryEntries"`
	// MaxScanRoots bounds how many roots one fs/scan observes.
	MaxScanRoots uint32 `json:"maxScanRoots"`
}

// ProcessLimits bound the process family.
type ProcessLimits struct {
	// MaxReadBytes bounds process/read's maxBytes.
	MaxReadBytes uint64 `json:"maxReadBytes"`
	// MaxProcessCount is how many process handles are kept; beyond it the
	// oldest exited one is evicted (later reads: notFound, reason expired),
	// and a start while every handle runs is busy (capacityExhausted).
	MaxProcessCount uint32 `json:"maxProcessCount"`
	// MaxRetainedOutputBytes is how much of one process's output is kept;
	// older output is reported as an overflow gap.
	MaxRetainedOutputBytes uint64 `json:"maxRetainedOutputBytes"`
	// MaxPendingInputBytes bounds one process's queued, unwritten input.
	MaxPendingInputBytes uint64 `json:"maxPendingInputBytes"`
}

// Platform describes the remote system.
type Platform struct {
	OS             string  `json:"os"`
	PathConvention string  `json:"pathConvention"`
	Shells         []Shell `json:"shells,omitempty"`
	DefaultShell   string  `json:"defaultShell,omitempty"`
}

// Shell is one verified entry of the shell catalog: a kind, an absolute
// executable path and the version a bounded probe observed.
type Shell struct {
	Kind    string `json:"kind"`
	Path    string `json:"path"`
	Version string `json:"version"`
}

// GetIdleParams are env/getIdle's params: none.
type GetIdleParams struct{}

// GetIdleResult is env/getIdle's answer: the idle clock and diagnostic counts.
type GetIdleResult struct {
	IdleForMs uint64 `json:"idleForMs"`
	// RunningProcessCount counts process roots that have not exited.
	RunningProcessCount uint32 `json:"runningProcessCount"`
	// LeftoverProcessGroupCount counts groups whose root exited while other
	// members live on; they keep idleForMs at zero like running work.
	LeftoverProcessGroupCount uint32 `json:"leftoverProcessGroupCount"`
	// RetainedProcessCount counts process handles kept, running or not.
	RetainedProcessCount uint32 `json:"retainedProcessCount"`
	// ConnectionCount counts open data connections.
	ConnectionCount uint32 `json:"connectionCount"`
}

// CancelRequestParams are $/cancelRequest's params.
type CancelRequestParams struct {
	ID json.RawMessage `json:"id"`
}

// ReadFileParams are fs/readFile's params.
type ReadFileParams struct {
	Path     string `json:"path"`
	Offset   uint64 `json:"offset,omitempty"`
	MaxBytes uint64 `json:"maxBytes"`
}

// ReadFileResult is fs/readFile's answer: at most maxBytes from offset, the
// file's size, and its version for a later conditional write.
type ReadFileResult struct {
	Data      string `json:"data"`
	SizeBytes uint64 `json:"sizeBytes"`
	Version   string `json:"version"`
}

// Create conditions of fs/writeFile (this package's reading of `create`).
const (
	CreateOrReplace = "createOrReplace" // the default: write whether or not the file exists
	CreateNew       = "createNew"       // only when nothing exists at the path
	ReplaceExisting = "replaceExisting" // only when a file exists at the path
)

// WriteFileParams are fs/writeFile's params.
type WriteFileParams struct {
	Path       string `json:"path"`
	Data       string `json:"data"`
	Create     string `json:"create,omitempty" wire:"enum=createOrReplace|createNew|replaceExisting"`
	IfMatch    string `json:"ifMatch,omitempty"`
	Executable bool   `json:"executable,omitempty"`
}

// WriteFileResult is fs/writeFile's answer: the new version.
type WriteFileResult struct {
	Version string `json:"version"`
}

// CreateDirectoryParams are fs/createDirectory's params. With parents, the
// missing parents are created too and an existing directory is success;
// without it, the parent must exist and nothing may exist at the path.
// Guessed name: parents.
type CreateDirectoryParams struct {
	Path    string `json:"path"`
	Parents bool   `json:"parents,omitempty"`
}

// Entry kinds of fs/getMetadata, fs/readDirectory and fs/scan (this
// package's reading of `kind`).
const (
	EntryFile      = "file"      // a regular file
	EntryDirectory = "directory" // a directory
	EntrySymlink   = "symlink"   // a symbolic link, not followed
	EntryOther     = "other"     // a FIFO, socket or device
)

// GetMetadataParams are fs/getMetadata's params. Without followSymlink a
// symbolic link at the path is described itself; with it, its target is.
// Guessed name: followSymlink.
type GetMetadataParams struct {
	Path          string `json:"path"`
	FollowSymlink bool   `json:"followSymlink,omitempty"`
}

// Metadata describes one entry: fs/getMetadata's answer, and the body of an
// fs/scan entry. Guessed names: kind (file, directory, symlink, other),
// modifiedAtMs, executable, symlinkTarget. sizeBytes is the operating
// system's size (a directory's is its own, not its contents'). executable is
// set for a regular file with any execute bit. symlinkTarget is the link's
// text for a symlink described itself, omitted when it is not UTF-8. version
// is set for regular files only and is the one fs/readFile answers.
type Metadata struct {
	Kind          string `json:"kind"`
	SizeBytes     uint64 `json:"sizeBytes"`
	ModifiedAtMs  int64  `json:"modifiedAtMs"`
	Executable    bool   `json:"executable,omitempty"`
	SymlinkTarget string `json:"symlinkTarget,omitempty"`
	Version       string `json:"version,omitempty"`
}

// ReadDirectoryParams are fs/readDirectory's params: a directory (a symlink
// to one is followed), at most maxEntries entries (1 to the advertised
// maxDirectoryEntries), and the cursor of the previous page to continue.
// Guessed names: maxEntries, cursor.
type ReadDirectoryParams struct {
	Path       string `json:"path"`
	MaxEntries uint32 `json:"maxEntries"`
	Cursor     string `json:"cursor,omitempty"`
}

// ReadDirectoryResult is one page of a directory, sorted by name (bytewise).
// nextCursor continues after the page's last entry and is omitted after the
// last page; it names a position, not a snapshot, so entries added or
// removed between pages are seen or missed as their names fall.
// skippedCount counts entries the page passed over because their names are
// not UTF-8 or they vanished while being read. Guessed names: entries,
// nextCursor, skippedCount.
type ReadDirectoryResult struct {
	Entries      []DirectoryEntry `json:"entries,omitempty"`
	NextCursor   string           `json:"nextCursor,omitempty"`
	SkippedCount uint32           `json:"skippedCount,omitempty"`
}

// DirectoryEntry is one entry of a directory page; a symlink is not
// followed. Guessed names: name, kind, sizeBytes.
type DirectoryEntry struct {
	Name      string `json:"name"`
	Kind      string `json:"kind"`
	SizeBytes uint64 `json:"sizeBytes"`
}

// RemoveParams are fs/remove's params. A symlink is removed itself, never
// its target; a directory that is not empty needs recursive. Guessed name:
// recursive.
type RemoveParams struct {
	Path      string `json:"path"`
	Recursive bool   `json:"recursive,omitempty"`
}

// RenameParams are fs/rename's params. Without overwrite an existing
// destination is refused (alreadyExists) atomically; with it, a file or an
// empty directory there is replaced atomically. Guessed names: source,
// destination (overwrite is the spec's).
type RenameParams struct {
	Source      string `json:"source"`
	Destination string `json:"destination"`
	Overwrite   bool   `json:"overwrite,omitempty"`
}

// WalkFilter is the filter fs/searchText, fs/globFiles and each fs/scan
// root share ("Pattern grammar and walks"). The member names are the spec's;
// maxDepth is optional (absent: no bound) and at least 1, the root's direct
// children being depth 1. Each pattern is 1 to 4096 bytes.
//
// This stand-in's reading: an entry is selected when include is empty or the
// entry or a directory above it matches an include pattern, and no exclude
// pattern matches it; an excluded directory is pruned. ignoreCase folds case
// in the patterns (and, for fs/searchText, in the regular expression).
// Unless includeIgnored, the walk reads `.gitignore` and `.ignore` in each
// directory it enters, at or below the root (gitignore lines: `#`
// comments, `!` negation, a trailing `/` for directories only); git's
// info/exclude and global excludes are not read. Unless includeHidden, names
// that start with "." are skipped. `.git`, `.hg`, `.svn` and `.jj` are always
// pruned. Symlinks are never followed below the root.
type WalkFilter struct {
	Include        []string `json:"include,omitempty"`
	Exclude        []string `json:"exclude,omitempty"`
	IgnoreCase     bool     `json:"ignoreCase,omitempty"`
	IncludeHidden  bool     `json:"includeHidden,omitempty"`
	IncludeIgnored bool     `json:"includeIgnored,omitempty"`
	MaxDepth       *uint32  `json:"maxDepth,omitempty"`
}

// SearchTextParams are fs/searchText's params: a regular expression in Go's
// RE2 syntax, matched against each line of the regular files below root (a
// directory), and the walk filter. Files with a NUL byte are taken as binary
// and passed over. Guessed names: root, pattern.
type SearchTextParams struct {
	Root    string `json:"root"`
	Pattern string `json:"pattern"`
	WalkFilter
}

// SearchTextResult lists the matching lines in walk order (depth first,
// names sorted bytewise). skippedCount counts entries the walk could not
// read or represent and files larger than the remaining result budget;
// truncated says the 12 MiB result budget ran out and the walk stopped.
// Guessed names: matches, skippedCount, truncated.
type SearchTextResult struct {
	Matches      []TextMatch `json:"matches,omitempty"`
	SkippedCount uint32      `json:"skippedCount,omitempty"`
	Truncated    bool        `json:"truncated,omitempty"`
}

// TextMatch is one matching line: its file as a TreePath relative to the
// root, its 1-based number, and its text without the line break, cut to
// 1024 bytes, with bytes that are not UTF-8 replaced by U+FFFD. Guessed
// names: path, lineNumber, text.
type TextMatch struct {
	Path       string `json:"path"`
	LineNumber uint32 `json:"lineNumber"`
	Text       string `json:"text"`
}

// GlobFilesParams are fs/globFiles's params: a root directory and the walk
// filter, whose include patterns are the globs. Guessed name: root.
type GlobFilesParams struct {
	Root string `json:"root"`
	WalkFilter
}

// GlobFilesResult lists the selected entries that are not directories
// (files, symlinks, others) as TreePaths relative to the root, in walk
// order. skippedCount and truncated are as in SearchTextResult. Guessed
// names: paths, skippedCount, truncated.
type GlobFilesResult struct {
	Paths        []string `json:"paths,omitempty"`
	SkippedCount uint32   `json:"skippedCount,omitempty"`
	Truncated    bool     `json:"truncated,omitempty"`
}

// ScanParams are fs/scan's params: 1 to the advertised maxScanRoots roots.
// Guessed name: roots.
type ScanParams struct {
	Roots []ScanRoot `json:"roots"`
}

// ScanRoot is one root of a scan: a path (a symlink there is followed; a
// file is a tree of one entry), the walk filter, and whether regular files'
// content comes back. Guessed names: path, includeContent.
type ScanRoot struct {
	Path           string `json:"path"`
	IncludeContent bool   `json:"includeContent,omitempty"`
	WalkFilter
}

// ScanResult reports each root on its own, in the order of the params.
// Guessed name: roots.
type ScanResult struct {
	Roots []ScanRootResult `json:"roots"`
}

// Reasons an entry of a scan root is skipped (this package's names).
const (
	SkipUnreadable      = "unreadable"      // the operating system refused to read it
	SkipUnrepresentable = "unrepresentable" // its name is not UTF-8, or its path is too long
	SkipTooLarge        = "tooLarge"        // its content exceeds the remaining result budget
)

// ScanRootResult is one root's observation, or its error (the protocol's
// error object; then no other member is set). entries starts with the root
// itself as "." and lists the selected entries in walk order. skipped lists
// the first 100 entries the walk skipped; skippedCount counts them all.
// version is an opaque fingerprint ("scan:v1:…") of what was listed, so an
// unchanged tree scans to the same version. truncated says the scan's
// result budget ran out during or before this root. Guessed names: entries,
// skipped, skippedCount, version, truncated, error.
type ScanRootResult struct {
	Entries      []ScanEntry          `json:"entries,omitempty"`
	Skipped      []SkippedEntry       `json:"skipped,omitempty"`
	SkippedCount uint32               `json:"skippedCount,omitempty"`
	Version      string               `json:"version,omitempty"`
	Truncated    bool                 `json:"truncated,omitempty"`
	Error        *jsonrpc.ErrorObject `json:"error,omitempty"`
}

// ScanEntry is one entry of a scan root: a TreePath relative to the root,
// its metadata, and, with includeContent, a regular file's content as
// padded standard base64 (present, even empty, exactly for regular files of
// a root with includeContent). Guessed name: path.
type ScanEntry struct {
	Path string `json:"path"`
	Metadata
	Data *string `json:"data,omitempty"`
}

// SkippedEntry is an entry a walk passed over and why (SkipUnreadable,
// SkipUnrepresentable, SkipTooLarge). A path that is not UTF-8 has its bad
// bytes replaced by U+FFFD. Guessed names: path, reason.
type SkippedEntry struct {
	Path   string `json:"path"`
	Reason string `json:"reason"`
}

// Stdin modes of process/start (this package's reading of `stdin`).
const (
	StdinNone = "none" // the default: stdin reads end-of-file at once
	StdinPipe = "pipe" // stdin is a pipe fed by process/write
)

// ProcessStartParams are process/start's params.
type ProcessStartParams struct {
	ProcessID string            `json:"processId" wire:"lsid"`
	Argv      []string          `json:"argv"`
	Cwd       string            `json:"cwd,omitempty"`
	Env       map[string]string `json:"env,omitempty"`
	Stdin     string            `json:"stdin,omitempty" wire:"enum=none|pipe"`
	TimeoutMs *uint64           `json:"timeoutMs,omitempty"`
	// Pty is accepted only to be refused with capabilityUnavailable
	// (processPty): this daemon has no terminals.
	Pty json.RawMessage `json:"pty,omitempty"`
}

// ProcessStartResult is process/start's answer.
type ProcessStartResult struct {
	Pid uint32 `json:"pid"`
}

// Return modes of process/read.
const (
	ReturnOnAnyOutput = "anyOutput"
	ReturnOnWindow    = "window"
	ReturnOnExit      = "exit"
)

// ProcessReadParams are process/read's params.
type ProcessReadParams struct {
	ProcessID string  `json:"processId" wire:"lsid"`
	After     *uint64 `json:"after,omitempty"`
	TailBytes *uint64 `json:"tailBytes,omitempty"`
	Ack       *uint64 `json:"ack,omitempty"`
	MaxBytes  uint64  `json:"maxBytes"`
	WaitMs    uint64  `json:"waitMs"`
	ReturnOn  string  `json:"returnOn,omitempty" wire:"enum=anyOutput|window|exit"`
}

// ProcessReadResult is one page of a process's combined output and its state.
type ProcessReadResult struct {
	Chunks    []OutputChunk `json:"chunks,omitempty"`
	Gaps      []OutputGap   `json:"gaps,omitempty"`
	Next      uint64        `json:"next"`
	End       uint64        `json:"end"`
	State     string        `json:"state"`
	Exit      *ProcessExit  `json:"exit,omitempty"`
	StoppedBy string        `json:"stoppedBy,omitempty"`
	Leftovers *Leftovers    `json:"leftovers,omitempty"`
}

// OutputChunk is output bytes starting at offset.
type OutputChunk struct {
	Offset uint64 `json:"offset"`
	Data   string `json:"data"`
}

// OutputGap is a range of the stream a read cannot return (member names are
// this package's choice).
type OutputGap struct {
	Offset    uint64 `json:"offset"`
	SizeBytes uint64 `json:"sizeBytes"`
	Reason    string `json:"reason"` // overflow
}

// ProcessExit is how a root process ended: {kind: code, code} or
// {kind: signal, signal, coreDumped}.
type ProcessExit struct {
	Kind       string `json:"kind"`
	Code       *int32 `json:"code,omitempty"`
	Signal     string `json:"signal,omitempty"`
	CoreDumped bool   `json:"coreDumped,omitempty"`
}

// Leftovers reports descendants still running in the group after the root
// exited (shape is this package's choice).
type Leftovers struct {
	Disposition  string            `json:"disposition"` // kept
	Processes    []LeftoverProcess `json:"processes,omitempty"`
	OmittedCount uint32            `json:"omittedCount,omitempty"`
}

// LeftoverProcess is one live member of a leftover group.
type LeftoverProcess struct {
	Pid     uint32 `json:"pid"`
	Command string `json:"command,omitempty"`
}

// ProcessWriteParams are process/write's params: bytes to queue, and/or close.
type ProcessWriteParams struct {
	ProcessID string `json:"processId" wire:"lsid"`
	Data      string `json:"data,omitempty"`
	Close     bool   `json:"close,omitempty"`
}

// Termination modes of process/terminate.
const (
	TerminateInterrupt = "interrupt"
	TerminateGraceful  = "terminate"
	TerminateKill      = "kill"
)

// ProcessTerminateParams are process/terminate's params.
type ProcessTerminateParams struct {
	ProcessID string `json:"processId" wire:"lsid"`
	Mode      string `json:"mode" wire:"enum=interrupt|terminate|kill"`
}

// Empty is an answer without members.
type Empty struct{}
