# Shared by the guest image scripts (build-image.sh, build-debian-image.sh):
# Incus access within a project, and the import that moves an alias to a new
# image in one request and drops the image it supersedes only when it is
# safe to. Source it after setting:
#   project        the Incus project, or empty for the default one
#   hash_property  the image property that carries the content hash
#   fail           a function that prints a sentence and exits
#   repo, go_cmd   the repository's root and the Go command (for build_lsenvd_dev)
# Everything it prints goes to stderr; the result line is the caller's.

incus_p() {
	if [ -n "$project" ]; then
		incus --project "$project" "$@"
	else
		incus "$@"
	fi
}

# query_path appends the project to a REST path for `incus query`.
query_path() {
	local path=$1
	if [ -n "$project" ]; then
		case $path in
		*\?*) path="$path&project=$project" ;;
		*) path="$path?project=$project" ;;
		esac
	fi
	printf '%s' "$path"
}

# image_check_incus fails unless Incus answers and the project exists.
image_check_incus() {
	incus query /1.0 >/dev/null 2>&1 || fail "Incus does not answer (is incusd running, and may this user use its socket?)."
	if [ -n "$project" ]; then
		incus query "/1.0/projects/$project" >/dev/null 2>&1 || fail "the Incus project $project (INCUS_PROJECT) does not exist."
	fi
}

# image_current ALIAS HASH sets image_target to the image the alias points
# at (empty when there is no such alias) and returns 0 when that image
# carries HASH already: then nothing needs building.
image_current() {
	local alias_name=$1 content_hash=$2 current_json
	image_target=""
	current_json=$(incus query "$(query_path "/1.0/images/aliases/$alias_name")" 2>/dev/null) || return 1
	image_target=$(printf '%s\n' "$current_json" | sed -n 's/^[[:space:]]*"target": "\([0-9a-f]*\)".*/\1/p')
	[ -n "$image_target" ] || fail "cannot read the target of the alias $alias_name."
	[ "$(incus_p image get-property "$image_target" "$hash_property" 2>/dev/null || true)" = "$content_hash" ]
}

# image_import TARBALL ALIAS DESCRIPTION imports the image, points the alias
# at it (image_current must have run: image_target is what it pointed at)
# and sets image_fingerprint.
image_import() {
	local tarball=$1 alias_name=$2 description=$3 current=$image_target import_out body
	echo "importing into Incus${project:+ (project $project)}" >&2
	import_out=$(incus_p image import "$tarball" 2>&1) || fail "incus image import failed: $import_out"
	echo "$import_out" >&2
	image_fingerprint=$(printf '%s\n' "$import_out" | sed -n 's/.*fingerprint: \([0-9a-f]\{64\}\).*/\1/p' | tail -n1)
	[ -n "$image_fingerprint" ] || fail "cannot find the fingerprint in the output of incus image import."

	body="{\"target\": \"$image_fingerprint\", \"description\": \"$description\"}"
	if [ -n "$current" ]; then
		# One request moves the alias: there is no moment without it.
		incus query -X PUT "$(query_path "/1.0/images/aliases/$alias_name")" -d "$body" >/dev/null ||
			{ image_drop "$image_fingerprint"; fail "cannot point the alias $alias_name at $image_fingerprint."; }
	else
		incus query -X POST "$(query_path /1.0/images/aliases)" -d "{\"name\": \"$alias_name\", ${body#\{}" >/dev/null ||
			{ image_drop "$image_fingerprint"; fail "cannot create the alias $alias_name for $image_fingerprint."; }
	fi
	echo "the alias $alias_name now points at $image_fingerprint" >&2

	# Remove the superseded image only when it is ours and nothing else uses it.
	if [ -n "$current" ] && [ "$current" != "$image_fingerprint" ]; then
		local old_hash old_aliases users
		old_hash=$(incus_p image get-property "$current" "$hash_property" 2>/dev/null || true)
		old_aliases=$(incus query "$(query_path "/1.0/images/$current")" 2>/dev/null | grep -c '"name":' || true)
		users=$(incus query "/1.0/instances?recursion=1&all-projects=true" 2>/dev/null |
			grep -c "\"volatile.base_image\": \"$current\"" || true)
		if [ -z "$old_hash" ]; then
			echo "kept the superseded image $current: this script did not build it" >&2
		elif [ "${old_aliases:-0}" != 0 ]; then
			echo "kept the superseded image $current: another alias names it" >&2
		elif [ "${users:-0}" != 0 ]; then
			echo "kept the superseded image $current: instances were created from it" >&2
		else
			incus_p image delete "$current" >&2 || echo "could not delete the superseded image $current" >&2
			echo "deleted the superseded image $current" >&2
		fi
	fi
}

# An image left without an alias after a failure would be garbage nobody owns.
image_drop() {
	incus_p image delete "$1" >&2 || true
}

# image_arch sets goarch (Go's and Debian's name of this machine's
# architecture) and arch (Incus's).
image_arch() {
	case $(uname -m) in
	x86_64) goarch=amd64 arch=x86_64 ;;
	aarch64 | arm64) goarch=arm64 arch=aarch64 ;;
	*) fail "this script knows no architecture for $(uname -m)." ;;
	esac
}

# build_lsenvd_dev DEST builds the development daemon (cmd/lsenvd-dev),
# static, for goarch.
build_lsenvd_dev() {
	echo "building lsenvd-dev (static, linux/$goarch)" >&2
	(cd "$repo" && CGO_ENABLED=0 GOOS=linux GOARCH=$goarch "$go_cmd" build -trimpath -buildvcs=false \
		-ldflags '-s -w' -o "$1" ./cmd/lsenvd-dev) >&2 ||
		fail "go build of cmd/lsenvd-dev failed (output above)."
}
