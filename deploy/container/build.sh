#!/usr/bin/env bash
# Builds the kvpeer container image from this repository alone: no base image, no registry.
#
#   deploy/container/build.sh [--kvpeer BIN] [--tag NAME:TAG] [--engine podman|buildah|docker]
#
# Without --kvpeer it builds `cargo build --release -p kvpeer` (the tcp and shm planes; the nixl
# plane needs NIXL's libraries, which the image does not carry). It stages a root file system in
# a temporary folder: the binary, the C libraries `ldd` says it loads (the build host's, so they
# match what it was linked against), an /etc/passwd naming user 65532, the example configuration
# (deploy/kvpeer.toml) and a /tmp; then builds deploy/container/Containerfile (FROM scratch) on
# it. Prints the image's name on its last line. The default tag is localhost/kvpeer:VERSION.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"

bin=""
tag=""
engine="${CONTAINER_ENGINE:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --kvpeer) bin="$2"; shift 2 ;;
    --tag) tag="$2"; shift 2 ;;
    --engine) engine="$2"; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

if [ -z "$engine" ]; then
  for candidate in podman buildah docker; do
    if command -v "$candidate" >/dev/null 2>&1; then engine="$candidate"; break; fi
  done
fi
if [ -z "$engine" ] || ! command -v "$engine" >/dev/null 2>&1; then
  echo "build.sh: no container engine found: install podman (Debian: apt-get install podman)" >&2
  exit 1
fi

if [ -z "$bin" ]; then
  (cd "$repo" && cargo build --release -q -p kvpeer --bin kvpeer)
  bin="${CARGO_TARGET_DIR:-$repo/target}/release/kvpeer"
fi
[ -x "$bin" ] || { echo "build.sh: $bin is not an executable" >&2; exit 1; }
version="$("$bin" --version | awk '{print $2}')"
tag="${tag:-localhost/kvpeer:$version}"

stage="$(mktemp -d "${TMPDIR:-/tmp}/kvpeer-image.XXXXXX")"
trap 'rm -rf "$stage"' EXIT
root="$stage/root"
mkdir -p "$root/usr/local/bin" "$root/etc/kvpeer" "$root/tmp"
chmod 1777 "$root/tmp"
install -m 0755 "$bin" "$root/usr/local/bin/kvpeer"
# The libraries at the paths the binary's loader looks for them (ldd prints the loader itself
# as an absolute path with no "=>", the others as "name => path"); copied, not linked.
ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' | while read -r lib; do
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done
printf 'root:x:0:0:root:/nonexistent:/sbin/nologin\nkvpeer:x:65532:65532:kvpeer:/nonexistent:/sbin/nologin\n' \
  > "$root/etc/passwd"
printf 'root:x:0:\nkvpeer:x:65532:\n' > "$root/etc/group"
# Names in `follow` and `advertise` resolve through /etc/hosts, then DNS (glibc's own modules).
printf 'hosts: files dns\n' > "$root/etc/nsswitch.conf"
install -m 0644 "$repo/deploy/kvpeer.toml" "$root/etc/kvpeer/kvpeer.toml"
cp "$repo/deploy/container/Containerfile" "$stage/Containerfile"

case "$engine" in
  buildah) buildah bud -q -f "$stage/Containerfile" -t "$tag" "$stage" >&2 ;;
  *) "$engine" build -q -f "$stage/Containerfile" -t "$tag" "$stage" >&2 ;;
esac
echo "$tag"
