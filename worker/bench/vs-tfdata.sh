#!/usr/bin/env bash
# A Stoker benchmark beside its tf.data peer, in alternating rounds on the same corpus.
#   bash worker/bench/vs-tfdata.sh preprocess|cache [CORPUS_DIR] [IMAGES] [ROUNDS]
# preprocess: ResNet-50 training transforms, best of three epochs per round.
# cache: epochs computing, writing the cache, and reading it (docs/performance.md).
# Needs `pip install tensorflow-cpu`; builds the worker in release mode.
set -euo pipefail
cd "$(dirname "$0")/../.."
bench=${1:?usage: vs-tfdata.sh preprocess|cache [CORPUS_DIR] [IMAGES] [ROUNDS]}
corpus=${2:-/tmp/stoker-bench-corpus}
images=${3:-1000}
rounds=${4:-3}
case $bench in
  preprocess) repeat=(--repeat 3); show=best ;;
  cache) repeat=(); show=. ;;
  *) echo "unknown benchmark '$bench': preprocess or cache" >&2; exit 2 ;;
esac
cargo build --release -q -p stoker-worker --features bench
worker=target/release/stoker-worker
[ -d "$corpus" ] || "$worker" corpus --out "$corpus" --images "$images"
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); /tmp on $(df -T /tmp | tail -1 | awk '{print $2}')"
for round in $(seq "$rounds"); do
  echo "--- round $round: stoker"
  "$worker" bench "$bench" --corpus "$corpus" "${repeat[@]}" | grep -E "$show|best"
  echo "--- round $round: tf.data"
  python3 "worker/bench/peers/tfdata_$bench.py" --corpus "$corpus" "${repeat[@]}" | grep -E "$show|best"
done
