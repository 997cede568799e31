#!/usr/bin/env bash
# Builds Stoker's images on a machine that reaches no image registry, for the e2e tiers that
# run real pods: a runtime base made from this machine's own Debian files (what the upstream
# base, distroless cc-debian12, holds: glibc, libgcc, CA certificates, a nonroot user 65532),
# the operator and worker images from the repository's Dockerfile on that base with release
# binaries built here, and the pod sandbox image from the `pause` install-tools.sh built.
#
# Usage: e2e/cluster/images.sh TAG   (run from anywhere; needs a running docker engine, which
# DOCKER_HOST may name). Prints nothing but progress; images:
#   stoker.local/base:bookworm, stoker.local/stoker-operator:TAG, stoker.local/stoker-worker:TAG,
#   stoker.local/pause:3.4
set -euo pipefail

TAG=${1:?usage: images.sh TAG}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN="${STOKER_CACHE:-$HOME/.cache/stoker}/bin"
DOCKER="$BIN/docker"
BASE=stoker.local/base:bookworm
PAUSE=stoker.local/pause:3.4
log() { echo "images: $*" >&2; }

# A root filesystem tar of the files a dynamically linked Rust binary needs at run time.
base_rootfs() {
  local root=$1
  mkdir -p "$root"/{etc/ssl/certs,tmp,home/nonroot,lib64,usr/local/bin}
  chmod 1777 "$root/tmp"
  # The loader and the libraries the binaries link (ldd names them), symlinks resolved.
  local lib
  for lib in $(ldd "$ROOT/target/release/stoker-operator" "$ROOT/target/release/stoker-worker" |
    awk '/=> \// {print $3} /^[ \t]*\/lib/ {print $1}' | sort -u); do
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
  done
  cp -L /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$root/etc/passwd"
  printf 'root:x:0:\nnonroot:x:65532:\n' >"$root/etc/group"
  printf 'hosts: files dns\n' >"$root/etc/nsswitch.conf"
  chown 65532:65532 "$root/home/nonroot"
}

if ! "$DOCKER" image inspect "$BASE" >/dev/null 2>&1; then
  log "making $BASE from this machine's files"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  (cd "$ROOT" && cargo build --release --locked -q -p stoker-operator -p stoker-worker)
  base_rootfs "$tmp/root"
  tar -C "$tmp/root" -c . | "$DOCKER" import -c 'USER 65532:65532' -c 'WORKDIR /home/nonroot' - "$BASE" >/dev/null
fi

if ! "$DOCKER" image inspect "$PAUSE" >/dev/null 2>&1; then
  log "importing $PAUSE"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  cp "$BIN/pause" "$tmp/pause"
  tar -C "$tmp" -c pause | "$DOCKER" import -c 'ENTRYPOINT ["/pause"]' - "$PAUSE" >/dev/null
fi

log "building the release binaries"
(cd "$ROOT" && cargo build --release --locked -q -p stoker-operator -p stoker-worker)
for target in operator worker; do
  log "building stoker.local/stoker-$target:$TAG"
  DOCKER_BUILDKIT=1 "$DOCKER" build -q --target "$target" --build-arg BINARIES=prebuilt \
    --build-arg BASE="$BASE" -t "stoker.local/stoker-$target:$TAG" "$ROOT" >/dev/null
done
