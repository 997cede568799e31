#!/usr/bin/env bash
# The clients on the same stream, in alternating rounds (docs/performance.md): two
# `stoker-worker bench serve` processes on loopback serving ready batches, read for SECONDS
# after a warm-up by
#   rust            `stoker-worker bench read` (the Rust client)
#   python          worker/bench/python_read.py with the package as built here (the binding)
#   python grpcio   the same script with the Python client of before the binding (grpcio),
#                   installed from commit $GRPCIO_COMMIT into its own venv
#   tf.data service worker/bench/peers/tfdata_service_stream.py (its own dispatcher and two
#                   workers serving the same 4 MiB batch) with compression off, its fastest
#                   setting, into one Python consumer (4 MiB batches over gRPC only)
# on 4 MiB batches (14 float16 224x224x3 images) over gRPC, the same through shared memory, and
# small batches (1,000 rows of 16 bytes) over gRPC; the clients in turn, in the reverse order
# every second round.
#   bash worker/bench/stream-clients.sh [ROUNDS] [SECONDS]
# SETTINGS (default "messages shared-memory small") and CLIENTS (default every client that
# reads the setting) narrow a run, e.g. the binding against the Rust client read twice per
# round, the second Rust reading the machine's own round-to-round spread:
#   SETTINGS=messages CLIENTS="rust binding rust" bash worker/bench/stream-clients.sh 20 5
# Each setting ends with the binding's rate over the Rust client's, round by round (median,
# lowest, highest; against the mean of the Rust client's two readings where it read twice),
# and the Rust client's second reading over its first.
# Pythons: TORCH_PYTHON (default ~/.cache/stoker/venv/bin/python; the package is reinstalled
# there, optimised), ~/.cache/stoker/grpcio-venv and ~/.cache/stoker/tf-venv (tensorflow-cpu),
# both made here when missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
seconds=${2:-5}
cache=${STOKER_CACHE:-$HOME/.cache/stoker}
python=${TORCH_PYTHON:-$cache/venv/bin/python}
grpcio_commit=${GRPCIO_COMMIT:-e73c754}
grpcio_venv=$cache/grpcio-venv
worker=target/release/stoker-worker
cargo build --release -q -p stoker-worker --features bench
"$python" -m pip install -q --disable-pip-version-check ./client/python
if [ ! -x "$grpcio_venv/bin/python" ]; then
  tmp=$(mktemp -d)
  git archive "$grpcio_commit" client/python | tar -x -C "$tmp"
  python3 -m venv "$grpcio_venv"
  "$grpcio_venv/bin/pip" install -q --disable-pip-version-check "$tmp/client/python"
  rm -rf "$tmp"
fi
tf_python=${TF_PYTHON:-$cache/tf-venv/bin/python}
if [ ! -x "$tf_python" ]; then
  python3 -m venv "$cache/tf-venv"
  "$cache/tf-venv/bin/pip" install -q --disable-pip-version-check tensorflow-cpu
  tf_python=$cache/tf-venv/bin/python
fi
logs=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; rm -rf "$logs"' EXIT
# Starts two workers with these `bench serve` arguments; sets $workers to their --worker flags.
serve() {
  kill "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
  pids=()
  workers=()
  for i in 0 1; do
    RUST_LOG=info NO_COLOR=1 "$worker" bench serve --listen 127.0.0.1:0 "$@" >"$logs/$i.log" 2>&1 &
    pids+=($!)
  done
  for i in 0 1; do
    for _ in $(seq 300); do
      address=$(grep -o 'listen=127.0.0.1:[0-9]*' "$logs/$i.log" | head -1 | cut -d= -f2 || true)
      [ -n "$address" ] && break
      sleep 0.1
    done
    workers+=(--worker "$address")
  done
}
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
# stdin: "<client> <rate>" lines and "end" after each round; prints $1's rate over $2's per
# round: median, lowest, highest. With a second reading of $2 in the round ("rust#2"), $1 is
# set against the mean of both, which cancels a drift that is steady through the round.
ratios() {
  awk -v a="$1" -v b="$2" '$1 == a { x = $2 } $1 == b { y = $2 } $1 == b "#2" && a != $1 { y2 = $2 }
    $1 == "end" { if (y2) y = (y + y2) / 2; if (x && y) print x / y; x = y = y2 = 0 }' |
    sort -n | awk -v what="$1 / $2" '{ v[NR] = $1; if ($1 >= 0.9) n++ }
      END { if (NR) printf "%s: median %.3f over %d rounds, lowest %.3f, highest %.3f, %d rounds at least 0.9\n",
        what, (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2), NR, v[1], v[NR], n }'
}
for setting in ${SETTINGS:-messages shared-memory small}; do
  case $setting in
    messages) serve; flags=() ;;
    shared-memory) serve --shared-memory-dir /dev/shm; flags=(--shared-memory) ;;
    small) serve --small-rows 1000; flags=() ;;
  esac
  clients=(rust binding grpcio)
  [ "$setting" = messages ] && clients+=(tf)
  [ -n "${CLIENTS:-}" ] && read -r -a clients <<<"$CLIENTS"
  rates=$logs/rates
  : >"$rates"
  : >"$rates.round"
  for round in $(seq "$rounds"); do
    # Odd rounds in this order, even rounds in the reverse: a machine whose speed drifts
    # during a round favours neither the first nor the last.
    order=("${clients[@]}")
    if [ $((round % 2)) -eq 0 ]; then
      order=()
      for ((i = ${#clients[@]} - 1; i >= 0; i--)); do order+=("${clients[$i]}"); done
    fi
    for client in "${order[@]}"; do
      case $client in
        rust) out=$("$worker" bench read "${workers[@]}" --seconds "$seconds" "${flags[@]}") ;;
        binding) out=$("$python" worker/bench/python_read.py "${workers[@]}" --seconds "$seconds" "${flags[@]}" --label "python (binding)") ;;
        grpcio) out=$("$grpcio_venv/bin/python" worker/bench/python_read.py "${workers[@]}" --seconds "$seconds" "${flags[@]}" --label "python (grpcio, $grpcio_commit)") ;;
        tf) out=$("$tf_python" worker/bench/peers/tfdata_service_stream.py --seconds "$seconds" --compression none 2>/dev/null | tail -1) ;;
      esac
      echo "$setting round $round: $out"
      rate=$(grep -o '[0-9.]* \(GB\|batches\)/s' <<<"$out" | head -1 | cut -d' ' -f1)
      grep -q "^$client " "$rates.round" 2>/dev/null && client="$client#2"
      echo "$client $rate" | tee -a "$rates.round" >>"$rates"
    done
    echo "end" >>"$rates"
    : >"$rates.round"
  done
  echo "$setting: $(ratios binding rust <"$rates")"
  if grep -q '^rust#2 ' "$rates"; then echo "$setting: $(ratios 'rust#2' rust <"$rates")"; fi
done
