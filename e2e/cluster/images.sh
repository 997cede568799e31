#!/usr/bin/env bash
# Builds Stoker's images on a machine that reaches no image registry, for the e2e tiers that
# run real pods: a runtime base made from this machine's own Debian files (what the upstream
# base, distroless cc-debian12, holds: glibc, libgcc, CA certificates, a nonroot user 65532),
# the operator and worker images from the repository's Dockerfile on that base with binaries
# built here, and the pod sandbox image from the `pause` install-tools.sh built.
#
# The binaries are release builds, unless STOKER_IMAGE_PROFILE=dev: then they are the debug
# build `make test`'s rust tier built and tested (`cargo build --workspace --bins --features
# stoker-worker/bench`, the worker's own crate optimised), which the real-pod tier uses so as
# not to compile everything a second time (13 min on 2 cores) on every run.
#
# A second base adds Python for `python` transforms: the interpreter the tests' venv runs on
# (with its standard library, at their own paths) and numpy from that venv, what the
# Dockerfile's `worker-python` target expects of its PYTHON_BASE.
#
# Usage: e2e/cluster/images.sh TAG   (run from anywhere; needs a running docker engine, which
# DOCKER_HOST may name, and the venv `make venv` makes). Prints nothing but progress; images:
#   stoker.local/base:bookworm, stoker.local/python:bookworm, stoker.local/stoker-operator:TAG,
#   stoker.local/stoker-worker:TAG, stoker.local/stoker-worker-python:TAG, stoker.local/pause:3.4
set -euo pipefail

TAG=${1:?usage: images.sh TAG}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN="${STOKER_CACHE:-$HOME/.cache/stoker}/bin"
DOCKER="$BIN/docker"
BASE=stoker.local/base:bookworm
PYTHON_BASE=stoker.local/python:bookworm
VENV="${STOKER_CACHE:-$HOME/.cache/stoker}/venv"
PAUSE=stoker.local/pause:3.4
log() { echo "images: $*" >&2; }

case "${STOKER_IMAGE_PROFILE:-release}" in
  release) PROFILE_DIR=release; BUILD=(--release -p stoker-operator -p stoker-worker) ;;
  dev) PROFILE_DIR=debug; BUILD=(--workspace --bins --features stoker-worker/bench) ;;
  *) echo "images: STOKER_IMAGE_PROFILE is release or dev, not ${STOKER_IMAGE_PROFILE}" >&2; exit 2 ;;
esac
OUT="$ROOT/target/$PROFILE_DIR"
# Run from a test, this script inherits what cargo sets for the test binary (CARGO_MANIFEST_DIR,
# CARGO_PKG_NAME, ...). ring's build script declares it reruns when those change, so a nested
# build with them recompiled ring and the 20 crates above it here, and again in the next tier
# (about 2 minutes each); they mean nothing to a build of the workspace, so they are dropped.
build_binaries() {
  (
    cd "$ROOT"
    # shellcheck disable=SC2046 # one name per word is what unset needs
    unset OUT_DIR $(compgen -e | grep -E '^CARGO_(MANIFEST_|PKG_|CRATE_|BIN_|PRIMARY_PACKAGE|TARGET_TMPDIR)')
    cargo build --locked -q "${BUILD[@]}"
  )
}

# A root filesystem tar of the files a dynamically linked Rust binary needs at run time.
base_rootfs() {
  local root=$1
  mkdir -p "$root"/{etc/ssl/certs,tmp,home/nonroot,lib64,usr/local/bin}
  chmod 1777 "$root/tmp"
  # The loader and the libraries the binaries link, symlinks resolved.
  copy_libraries "$root" "$OUT/stoker-operator" "$OUT/stoker-worker"
  cp -L /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$root/etc/passwd"
  printf 'root:x:0:\nnonroot:x:65532:\n' >"$root/etc/group"
  printf 'hosts: files dns\n' >"$root/etc/nsswitch.conf"
  chown 65532:65532 "$root/home/nonroot"
}

# Copies each library the given ELF files link (ldd resolves them) to its own path under $1.
copy_libraries() {
  local root=$1 lib
  shift
  for lib in $(ldd "$@" 2>/dev/null | awk '/=> \// {print $3} /^[ \t]*\/lib/ {print $1}' | sort -u); do
    [ -e "$root$lib" ] && continue
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
  done
}

# The base plus Python: the venv's interpreter and standard library at their own paths (so it
# finds its prefix as it does here), the libraries its extension modules link, numpy in its
# site-packages, and `python3` on PATH (the worker's default STOKER_PYTHON).
python_rootfs() {
  local root=$1 exe stdlib site numpy
  base_rootfs "$root"
  read -r exe stdlib site numpy < <("$VENV/bin/python" -c '
import os, sys, sysconfig, numpy
print(os.path.realpath(sys.executable), sysconfig.get_paths(vars={"base": sys.base_prefix, "installed_base": sys.base_prefix})["stdlib"],
      sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_prefix})["purelib"],
      os.path.dirname(os.path.dirname(numpy.__file__)))')
  mkdir -p "$root$(dirname "$exe")" "$root$site" "$root/usr/local/bin"
  cp -L "$exe" "$root$exe"
  ln -s "$exe" "$root/usr/local/bin/python3"
  # The standard library without its tests, GUI, static library and the base's own packages.
  tar -C / -c --exclude="${stdlib#/}/site-packages" --exclude="${stdlib#/}/dist-packages" \
    --exclude="${stdlib#/}/test" --exclude="${stdlib#/}/idlelib" --exclude="${stdlib#/}/tkinter" \
    --exclude="${stdlib#/}/turtledemo" --exclude="${stdlib#/}/ensurepip" --exclude="${stdlib#/}/config-*" \
    "${stdlib#/}" | tar -C "$root" -x
  tar -C "$numpy" -c numpy numpy.libs | tar -C "$root$site" -x
  copy_libraries "$root" "$exe" $(find "$root$stdlib" "$root$site" -name '*.so*' -type f)
}

if ! "$DOCKER" image inspect "$BASE" >/dev/null 2>&1; then
  log "making $BASE from this machine's files"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  build_binaries
  base_rootfs "$tmp/root"
  tar -C "$tmp/root" -c . | "$DOCKER" import -c 'USER 65532:65532' -c 'WORKDIR /home/nonroot' - "$BASE" >/dev/null
fi

if ! "$DOCKER" image inspect "$PYTHON_BASE" >/dev/null 2>&1; then
  log "making $PYTHON_BASE from this machine's files and $VENV"
  if ! "$VENV/bin/python" -c 'import numpy' 2>/dev/null; then
    echo "images: $PYTHON_BASE needs a Python with numpy at $VENV: run \`make venv\` first" >&2
    exit 1
  fi
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  build_binaries
  python_rootfs "$tmp/root"
  tar -C "$tmp/root" -c . | "$DOCKER" import -c 'USER 65532:65532' -c 'WORKDIR /home/nonroot' \
    -c 'ENV PATH=/usr/local/bin:/usr/bin:/bin' - "$PYTHON_BASE" >/dev/null
fi

if ! "$DOCKER" image inspect "$PAUSE" >/dev/null 2>&1; then
  log "importing $PAUSE"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  cp "$BIN/pause" "$tmp/pause"
  tar -C "$tmp" -c pause | "$DOCKER" import -c 'ENTRYPOINT ["/pause"]' - "$PAUSE" >/dev/null
fi

log "building the binaries (${STOKER_IMAGE_PROFILE:-release})"
build_binaries
# The Dockerfile's prebuilt stage copies target/release/stoker-{operator,worker}: a context of
# the Dockerfile and the two binaries at that path, whichever build they come from.
context=$(mktemp -d)
trap 'rm -rf "${tmp:-}" "$context"' EXIT
mkdir -p "$context/target/release"
cp "$ROOT/Dockerfile" "$context/"
cp "$OUT/stoker-operator" "$OUT/stoker-worker" "$context/target/release/"
for target in operator worker worker-python; do
  log "building stoker.local/stoker-$target:$TAG"
  DOCKER_BUILDKIT=1 "$DOCKER" build -q --target "$target" --build-arg BINARIES=prebuilt \
    --build-arg BASE="$BASE" --build-arg PYTHON_BASE="$PYTHON_BASE" -t "stoker.local/stoker-$target:$TAG" \
    "$context" >/dev/null
done
# Each build under the same tag leaves the previous images dangling, and each build's context
# (the two binaries) stays in the build cache: 4 GB and 7 GB here after a few dozen runs, on a
# disk CI shares. Both go; the bases and the tagged images stay.
"$DOCKER" image prune -f >/dev/null
"$DOCKER" builder prune -af >/dev/null
