#!/usr/bin/env bash
# DLRM's preprocessing of a Criteo-style Parquet table, Stoker beside its peers' strongest
# recipes, in alternating rounds on one table (docs/performance.md):
#   bash worker/bench/dlrm-vs-peers.sh [DATA_DIR] [ROUNDS] [ROWS]
# The table (made once by worker/bench/peers/criteo_generate.py): ROWS rows (2,000,000) of a
# label, 13 counts and 26 hex categoricals with Criteo's null rates, plus 40 columns the model
# does not read. Every side fills the nulls, takes log1p(max(x, 0)) of the counts into a float32
# [n, 13] vector and maps each categorical to one of 10,000,000 buckets, in batches of 2048 on
# the machine's cores, best of three epochs per round:
#   stoker      `stoker-worker bench dlrm` (the engine in process, with its floor: the projected
#               columns decoded alone by arrow-rs)
#   dataloader  worker/bench/peers/dlrm_dataloader.py: a PyTorch DataLoader, one process per
#               core, pyarrow row groups + numpy
#   ray         worker/bench/peers/dlrm_ray.py: Ray Data read_parquet + map_batches (pyarrow)
# Pythons: TORCH_PYTHON (default ~/.cache/stoker/venv/bin/python, `make venv`) and RAY_PYTHON
# (default ~/.cache/stoker/ray-venv/bin/python, `pip install "ray[data]"`). A peer whose
# Python cannot import it is left out with the reason printed.
set -euo pipefail
cd "$(dirname "$0")/../.."
data=${1:-/tmp/stoker-bench-criteo}
rounds=${2:-3}
rows=${3:-2000000}
cache=${STOKER_CACHE:-$HOME/.cache/stoker}
torch_python=${TORCH_PYTHON:-$cache/venv/bin/python}
ray_python=${RAY_PYTHON:-$cache/ray-venv/bin/python}
cores=$(nproc)
cargo build --release -q -p stoker-worker --features bench
worker=target/release/stoker-worker
[ -d "$data" ] || "$torch_python" worker/bench/peers/criteo_generate.py --out "$data" --rows "$rows"
echo "machine: $cores cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); table $data"

peers=()
if "$torch_python" -c 'import torch, pyarrow' 2>/dev/null; then peers+=(dataloader); else echo "dataloader left out: $torch_python cannot import torch and pyarrow"; fi
if "$ray_python" -c 'import ray.data' 2>/dev/null; then peers+=(ray); else echo "ray left out: $ray_python cannot import ray.data"; fi

run() {
  case $1 in
    stoker) "$worker" bench dlrm --data "$data" --threads "$cores" --repeat 3 ;;
    dataloader) "$torch_python" worker/bench/peers/dlrm_dataloader.py --data "$data" --workers "$cores" --repeat 3 ;;
    ray) "$ray_python" worker/bench/peers/dlrm_ray.py --data "$data" --cpus "$cores" --repeat 3 ;;
  esac
}

for round in $(seq "$rounds"); do
  for side in stoker "${peers[@]}"; do
    out=$(run "$side" 2>>/tmp/dlrm-vs-peers.err || true)
    case $side in
      stoker) best=$(echo "$out" | grep -E "^(stoker|floor|dictionary floor) run|projection" | tr '\n' ';') ;;
      *) best=$(echo "$out" | grep "^best" || true) ;;
    esac
    echo "round $round $side: ${best:-FAILED}"
  done
done
