package devguest

import (
	"encoding/json"

	"github.com/lightspeed-dev/incus-provider/internal/buildinfo"
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

// FilesystemLimits bound fs/readFile's maxBytes and fs/writeFile's data.
type FilesystemLimits struct {
	MaxReadBytes  uint64 `json:"maxReadBytes"`
	MaxWriteBytes uint64 `json:"maxWriteBytes"`
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
