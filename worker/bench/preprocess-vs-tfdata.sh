#!/usr/bin/env bash
# Preprocessing throughput, Stoker's engine vs tf.data, alternating on the same corpus.
#   bash worker/bench/preprocess-vs-tfdata.sh [CORPUS_DIR] [IMAGES] [ROUNDS]
# Needs `pip install tensorflow-cpu`; builds the worker in release mode.
set -euo pipefail
cd "$(dirname "$0")/../.."
corpus=${1:-/tmp/stoker-bench-corpus}
images=${2:-2000}
rounds=${3:-3}
cargo build --release -q -p stoker-worker
worker=target/release/stoker-worker
[ -d "$corpus" ] || "$worker" corpus --out "$corpus" --images "$images"
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
for round in $(seq "$rounds"); do
  echo "--- round $round: stoker"
  "$worker" bench preprocess --corpus "$corpus" --repeat 3 | grep best
  echo "--- round $round: tf.data"
  python3 worker/bench/peers/tfdata_preprocess.py --corpus "$corpus" --repeat 3 | grep best
done
