#!/usr/bin/env bash
# ResNet-50 training preprocessing, Stoker beside each peer's strongest recipe, in alternating
# rounds on one corpus (docs/performance.md):
#   bash worker/bench/preprocess-vs-peers.sh [CORPUS_DIR] [ROUNDS] [IMAGES] [MIN_SIDE] [MAX_SIDE]
# Every side runs decode -> random-resized-crop 224 -> horizontal flip -> normalize to float32
# in batches of 64 on all cores, best of three epochs per round:
#   stoker       `stoker-worker bench preprocess` (the engine in process)
#   tf.data      worker/bench/peers/tfdata_preprocess.py --decode-and-crop: TensorFlow's
#                official ResNet recipe (sample_distorted_bounding_box + decode_and_crop_jpeg)
#   torchvision  worker/bench/peers/torch_preprocess.py: DataLoader, torchvision.io.decode_jpeg
#                + transforms v2
#   pil          the same DataLoader with the classic PIL ImageFolder recipe
#   dali         worker/bench/peers/dali_preprocess.py: NVIDIA DALI's CPU pipeline
#                (decoders.image_random_crop, resize, crop_mirror_normalize), no GPU
# Every side reads the corpus as it is and, in the same round, a copy of it with restart
# markers (`stoker-worker add-restart-markers`, made once as CORPUS_DIR-restart-markers: the same
# pixels, and every peer reads it too); RESTART_MARKERS=0 leaves the copy out.
# Pythons: TF_PYTHON (default ~/.cache/stoker/tf-venv/bin/python, `pip install tensorflow-cpu`),
# TORCH_PYTHON (default ~/.cache/stoker/venv/bin/python, `make venv`) and DALI_PYTHON (default
# ~/.cache/stoker/dali-venv/bin/python, `pip install nvidia-dali-cuda120`). A peer whose Python
# cannot import it is left out with the reason printed.
set -euo pipefail
cd "$(dirname "$0")/../.."
corpus=${1:-/tmp/stoker-bench-corpus}
rounds=${2:-3}
images=${3:-1000}
min_side=${4:-250}
max_side=${5:-500}
cache=${STOKER_CACHE:-$HOME/.cache/stoker}
tf_python=${TF_PYTHON:-$cache/tf-venv/bin/python}
torch_python=${TORCH_PYTHON:-$cache/venv/bin/python}
dali_python=${DALI_PYTHON:-$cache/dali-venv/bin/python}
cargo build --release -q -p stoker-worker --features bench
worker=target/release/stoker-worker
[ -d "$corpus" ] || "$worker" corpus --out "$corpus" --images "$images" --min-side "$min_side" --max-side "$max_side"
corpora=("$corpus")
if [ "${RESTART_MARKERS:-1}" != 0 ]; then
  marked=$corpus-restart-markers
  [ -d "$marked" ] || "$worker" add-restart-markers --input "$corpus" --output "$marked"
  corpora+=("$marked")
fi
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); corpora ${corpora[*]}"

peers=()
if "$tf_python" -c 'import tensorflow' 2>/dev/null; then peers+=(tf.data); else echo "tf.data left out: $tf_python cannot import tensorflow"; fi
if "$torch_python" -c 'import torchvision, PIL' 2>/dev/null; then peers+=(torchvision pil); else echo "torchvision and pil left out: $torch_python cannot import torchvision and PIL"; fi
if "$dali_python" -c 'import nvidia.dali' 2>/dev/null; then peers+=(dali); else echo "dali left out: $dali_python cannot import nvidia.dali"; fi

run() {
  case $1 in
    stoker) "$worker" bench preprocess --corpus "$2" --repeat 3 ;;
    tf.data) "$tf_python" worker/bench/peers/tfdata_preprocess.py --corpus "$2" --repeat 3 --decode-and-crop ;;
    torchvision | pil) "$torch_python" worker/bench/peers/torch_preprocess.py --corpus "$2" --repeat 3 --recipe "$1" ;;
    dali) "$dali_python" worker/bench/peers/dali_preprocess.py --corpus "$2" --repeat 3 ;;
  esac
}

for round in $(seq "$rounds"); do
  for dir in "${corpora[@]}"; do
    for side in stoker "${peers[@]}"; do
      best=$(run "$side" "$dir" 2>>/tmp/preprocess-vs-peers.err | grep "^best" || true)
      echo "round $round $(basename "$dir") $side: ${best:-FAILED}"
    done
  done
done
