#!/usr/bin/env bash
# Stream throughput into one Python consumer, Stoker beside tf.data service, in alternating
# rounds (docs/performance.md): two workers on loopback serving ready 4 MiB batches (14 float16
# 224x224x3 images + labels), the consumer counting the tensors' bytes as numpy arrays for
# SECONDS after a warm-up.
#   bash worker/bench/stream-vs-tfdata-service.sh [ROUNDS] [SECONDS]
#   stoker                  `python -m stoker_client.bench` (two `stoker-worker bench serve`), gRPC
#   stoker shared memory    the same, the batches handed over through /dev/shm (same host only)
#   tf.data service none    worker/bench/peers/tfdata_service_stream.py --compression none
#   tf.data service auto    the same with tf.data service's default compression
# Pythons: TORCH_PYTHON (default ~/.cache/stoker/venv/bin/python, with stoker_client: `make
# venv`) and TF_PYTHON (default ~/.cache/stoker/tf-venv/bin/python, `pip install tensorflow-cpu`).
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
seconds=${2:-5}
cache=${STOKER_CACHE:-$HOME/.cache/stoker}
tf_python=${TF_PYTHON:-$cache/tf-venv/bin/python}
stoker_python=${TORCH_PYTHON:-$cache/venv/bin/python}
cargo build --release -q -p stoker-worker --features bench
"$stoker_python" -m pip install -q ./client/python
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
for round in $(seq "$rounds"); do
  echo "round $round stoker: $("$stoker_python" -m stoker_client.bench --worker-bin target/release/stoker-worker --seconds "$seconds" | tail -1)"
  echo "round $round stoker: $("$stoker_python" -m stoker_client.bench --worker-bin target/release/stoker-worker --seconds "$seconds" --shared-memory | tail -1)"
  for compression in none auto; do
    echo "round $round $("$tf_python" worker/bench/peers/tfdata_service_stream.py --seconds "$seconds" --compression "$compression" 2>/dev/null | tail -1)"
  done
done
