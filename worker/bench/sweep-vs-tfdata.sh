#!/usr/bin/env bash
# Stoker's sweep (local/tests/shared_jobs.rs, images) beside its tf.data service peer
# (peers/tfdata_service_sweep.py: the cross-trainer cache), in alternating rounds.
#   bash worker/bench/sweep-vs-tfdata.sh [ROUNDS] [CORPUS_DIR]
# Each side runs alone, shared and unshared on fresh workers and prints worker CPU-seconds and
# trial-a's wait; the tf.data side also prints what each trainer got, repeated and missed per
# epoch. Needs a Python with tensorflow-cpu: ~/.cache/stoker/tf-venv, made if missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
corpus=${2:-/tmp/stoker-sweep-corpus}
python=${TF_PYTHON:-$HOME/.cache/stoker/tf-venv/bin/python}
if [ ! -x "$python" ]; then
  python3 -m venv "$HOME/.cache/stoker/tf-venv"
  "$HOME/.cache/stoker/tf-venv/bin/pip" install -q tensorflow-cpu numpy
  python=$HOME/.cache/stoker/tf-venv/bin/python
fi
cargo build --release -q -p stoker-worker --features bench
cargo test --release -q -p stoker-local --test shared_jobs --no-run
worker=target/release/stoker-worker
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# The sweep's corpus: 480 JPEGs of 200-260 px in 4 classes (Stoker's test makes its own alike).
[ -d "$corpus" ] || "$worker" corpus --out "$corpus" --images 480 --classes 4 --min-side 200 --max-side 260
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); /tmp on $(df -T /tmp | tail -1 | awk '{print $2}'); $("$python" -c 'import os; os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"; import tensorflow as tf; print("tensorflow", tf.__version__)' 2>/dev/null); load $(cut -d" " -f1-3 /proc/loadavg)"
for round in $(seq "$rounds"); do
  echo "--- round $round: stoker"
  STOKER_SWEEP_DATA=images cargo test --release -q -p stoker-local --test shared_jobs -- --nocapture a_sweeps 2>&1 |
    grep -E "^(trial-a alone|four trials)|^3 epochs of 480 images|panicked|test result"
  echo "--- round $round: tf.data service"
  # TensorFlow's start-up chatter goes to a log, shown if the peer fails.
  "$python" worker/bench/peers/tfdata_service_sweep.py --corpus "$corpus" 2>"$log" || { tail -20 "$log" >&2; exit 1; }
done
