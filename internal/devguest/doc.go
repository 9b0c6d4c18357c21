// Package devguest is a development stand-in for lightspeed-envd, the guest
// daemon of the environment protocol's data plane (version 5). It exists so
// that the provider, its images and its tests run on one machine with no
// internet; it is not the real daemon and does not pretend to be.
//
// What it implements, and advertises in its initialize response:
//
//   - initialize, env/getIdle and the $/cancelRequest notification;
//   - the whole fs/* family (capability filesystem, with write):
//     fs/readFile, fs/writeFile, fs/createDirectory, fs/getMetadata,
//     fs/readDirectory, fs/remove, fs/rename, and the walks fs/searchText,
//     fs/globFiles and fs/scan, which $/cancelRequest aborts and which stop
//     at the spec's 12 MiB result budget (fs/scan does not count as use);
//   - process/start, process/read, process/write and process/terminate
//     (capability process: POSIX process groups, graceful-then-kill
//     termination, interrupt of pipe processes).
//
// job/* and transfer/* exist on the plane but their families are not
// advertised, so they are refused with capabilityUnavailable (job,
// filesystemTransfer). There is no PTY (process.pty is not advertised; a
// start with pty is capabilityUnavailable).
//
// The walks share one filter (WalkFilter). Of the ignore rules the spec
// names, this stand-in reads `.gitignore` and `.ignore` files at and below
// a walk's root, not git's info/exclude or global excludes; WalkFilter says
// how it reads the rest of the pattern grammar.
//
// The filesystem root is "/" (the environment's own namespace), so
// permissionDenied (outsideRoot) never arises, and the daemon keeps no state
// directory: process handles live in memory and die with the daemon.
//
// Where the spec leaves a wire shape to the protocol crate, which this
// package could not consult, the shapes below are this package's own reading
// of the spec's conventions; the names that are guesses are listed in the
// doc comments of the types that carry them.
package devguest
