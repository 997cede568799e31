"""A Python augmentation through Stoker beside the same function in a PyTorch DataLoader.

    cargo build --release -p stoker-worker
    pip install torch torchvision     # the peer's strongest recipe: torchvision.io + transforms v2
    python worker/bench/python-augment.py --corpus /tmp/stoker-bench-corpus [--rounds 3]

Both sides run ResNet-50 training preprocessing with `color_jitter` from
manifests/samples/python/augment.py between the crop/flip and normalize, into float32
[64, 224, 224, 3] batches read by this process:

- Stoker: a standalone `stoker-worker --threads 2` (decode, randomResizedCrop and flip in
  Rust; color_jitter in its pool of 2 Python processes, given the image with `layout: planar`
  unless `--layout interleaved`; normalize in Rust), read with `stoker_client.Client`.
- PyTorch: `DataLoader(num_workers=2)` over the files, each sample read with
  `torchvision.io.read_file` + `decode_jpeg`, `transforms.v2.RandomResizedCrop(224)` and
  `RandomHorizontalFlip`, then the same color_jitter on the HWC view of the [3, h, w] tensor
  (planar memory, as Stoker's `layout: planar`), then normalize.

`--against-worker BIN` runs Stoker with another worker binary in the DataLoader's place (an
A/B of two builds; `--cpu` finds workers by the name `stoker-worker`, so keep that name).
Rounds alternate the two, the one going first alternating too; each reports the best of
`--epochs` epochs after a warm-up epoch, in images per second. `--batch N` runs Stoker's op in
the batched form (`color_jitter_batch`, N elements per call).
"""

import argparse
import os
import pathlib
import sys
import time

import numpy as np
from standalone import serve

ROOT = pathlib.Path(__file__).resolve().parents[2]
CODE = ROOT / "manifests" / "samples" / "python"
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
BATCH = 64


def cpu_seconds(pid="self"):
    """(user + system CPU seconds, minor page faults) of a process so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])


def process_table():
    """{pid: (name, parent pid)} of every process now."""
    table = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        table[pid] = (stat.split("(", 1)[1].split(")", 1)[0], stat.rsplit(")", 1)[1].split()[1])
    return table


def processes():
    """CPU seconds so far of this process, of the worker, and of the worker's children (the
    `python` op's processes), and this process's minor page faults."""
    table = process_table()
    workers = {pid for pid, (name, parent) in table.items() if name == "stoker-worker" and parent == str(os.getpid())}
    children = [pid for pid, (_, parent) in table.items() if parent in workers]
    consumer, faults = cpu_seconds()
    return {
        "consumer": consumer,
        "worker": sum(cpu_seconds(p)[0] for p in workers),
        "python op": sum(cpu_seconds(p)[0] for p in children),
        "consumer page faults": faults,
        "python op page faults": sum(cpu_seconds(p)[1] for p in children),
    }


def loader_seconds():
    """CPU seconds so far of this process and of its children (the DataLoader's workers)."""
    children = [pid for pid, (_, parent) in process_table().items() if parent == str(os.getpid())]
    return cpu_seconds()[0], sum(cpu_seconds(p)[0] for p in children)


def stoker_epochs(
    worker_bin,
    corpus,
    epochs,
    threads,
    jitter,
    batch=None,
    cpu=False,
    message_mib=None,
    layout="planar",
    shared_memory=True,
):
    from stoker_client import Client

    function, extra = ("color_jitter_batch", f", batch: {batch}") if batch else ("color_jitter", "")
    extra += f", layout: {layout}"
    spec = (
        f"  source: {{uri: 'file://{corpus}/', format: imageFolder}}\n"
        "  transforms:\n"
        "  - decodeImage: {channels: 3}\n"
        "  - randomResizedCrop: {size: [224, 224]}\n"
        "  - randomFlip: {horizontal: true}\n"
        + (f"  - python: {{module: augment, function: {function}, path: '{CODE}'{extra}}}\n" if jitter else "")
        + "  - normalize: {mean: [0.485, 0.456, 0.406], std: [0.229, 0.224, 0.225]}\n"
        f"  batchSize: {BATCH}\n"
        "  seed: 1\n"
    )
    with serve(worker_bin, spec, epochs + 1, threads, env={"STOKER_PYTHON": sys.executable}) as address:
        end, images, usage = {}, {}, {}
        options = {"max_message_bytes": message_mib << 20} if message_mib else {}
        options["shared_memory"] = shared_memory
        with Client([address], "bench", "bench", **options) as client:
            for batch in client:
                if cpu and batch.epoch not in images and batch.epoch in (1, epochs):
                    # From the first batch of epoch 1 to that of the last: the worker may have
                    # finished the last epoch, and stopped its Python processes, before it ends.
                    usage[batch.epoch] = processes()
                end[batch.epoch] = time.perf_counter()
                images[batch.epoch] = images.get(batch.epoch, 0) + batch["image"].shape[0]
        if cpu and len(usage) == 2:
            n = sum(images[e] for e in range(1, epochs))
            d = {k: (usage[epochs][k] - usage[1][k]) / n for k in usage[1]}
            print(
                f"  per image: worker {d['worker'] * 1e3:.3f} ms CPU, its Python processes {d['python op'] * 1e3:.3f}, "
                f"consumer {d['consumer'] * 1e3:.3f}; "
                f"page faults per image: Python processes {d['python op page faults']:.1f}, "
                f"consumer {d['consumer page faults']:.1f}"
            )
        return periods(end, images, epochs), images[1]


class Files:
    """The corpus as a map-style dataset: (file, class) pairs, transformed per item."""

    def __init__(self, corpus, jitter):
        import torch
        from torchvision.transforms import v2

        sys.path.insert(0, str(CODE))
        import augment

        self.jitter = augment.color_jitter if jitter else (lambda element, rng: element)
        classes = sorted(p.name for p in pathlib.Path(corpus).iterdir() if p.is_dir())
        self.items = [
            (str(f), i) for i, c in enumerate(classes) for f in sorted((pathlib.Path(corpus) / c).glob("*.jpg"))
        ]
        self.crop = v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip()])
        self.torch = torch

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        from torchvision.io import decode_jpeg, read_file

        path, label = self.items[index]
        image = self.crop(decode_jpeg(read_file(path)))  # uint8 [3, 224, 224]
        element = {"image": image.permute(1, 2, 0).numpy(), "label": np.int64(label)}
        element = self.jitter(element, np.random.default_rng([1, index]))
        normalized = (element["image"].astype(np.float32) / 255.0 - MEAN) / STD
        return self.torch.from_numpy(normalized), label


def dataloader_epochs(corpus, epochs, workers, jitter, cpu=False):
    from torch.utils.data import DataLoader

    loader = DataLoader(
        Files(corpus, jitter),
        batch_size=BATCH,
        shuffle=True,
        num_workers=workers,
        persistent_workers=True,
        prefetch_factor=4,
    )
    end, images, usage = {}, {}, {}
    for epoch in range(epochs + 1):
        for batch, _ in loader:
            images[epoch] = images.get(epoch, 0) + batch.shape[0]
        end[epoch] = time.perf_counter()
        if cpu and epoch in (0, epochs):
            usage[epoch] = loader_seconds()
    if cpu:
        n = sum(images[e] for e in range(1, epochs + 1))
        consumer, loaders = ((usage[epochs][i] - usage[0][i]) / n for i in range(2))
        print(f"  per image: DataLoader workers {loaders * 1e3:.3f} ms CPU, consumer {consumer * 1e3:.3f}")
    del loader
    return periods(end, images, epochs), images[1]


def periods(end, images, epochs):
    """Images per second of each epoch after the warm-up, measured from the end of the epoch
    before to its own end: what a training loop reading back to back sees (a side that works
    ahead across epochs gets no credit for the head start)."""
    return [images[e] / (end[e] - end[e - 1]) for e in range(1, epochs + 1)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--worker-bin", default=str(ROOT / "target" / "release" / "stoker-worker"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--processes", type=int, default=2, help="Stoker worker threads = DataLoader workers")
    ap.add_argument("--without-python", action="store_true", help="both sides without color_jitter (a baseline)")
    ap.add_argument("--batch", type=int, help="Stoker calls color_jitter_batch on this many elements at once")
    ap.add_argument("--message-mib", type=int, help="the client's max_message_bytes, in MiB (default: the client's)")
    ap.add_argument(
        "--layout",
        choices=["planar", "interleaved"],
        default="planar",
        help="the python op's image layout (planar: what the DataLoader's function gets from torchvision)",
    )
    ap.add_argument(
        "--messages",
        action="store_true",
        help="batches to the consumer in gRPC messages (default: through shared memory, this host's)",
    )
    ap.add_argument(
        "--against-worker",
        metavar="BIN",
        help="instead of the DataLoader, Stoker with this other worker binary (an A/B of two builds)",
    )
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="also print each side's CPU time per image by process (needs --epochs 2 or more)",
    )
    args = ap.parse_args()
    jitter = not args.without_python
    print(
        f"machine: {os.cpu_count()} cores; {args.processes} processes per side; best of {args.epochs} epochs; "
        f"{'with' if jitter else 'without'} color_jitter"
        + (f"; Stoker's in the batched form, {args.batch} per call" if args.batch and jitter else "")
    )
    for round in range(1, args.rounds + 1):
        # The side that goes first alternates: a slow spell of the machine then falls on each.
        other = "against" if args.against_worker else "dataloader"
        for side in ("stoker", other) if round % 2 else (other, "stoker"):
            if side == "dataloader":
                rates, n = dataloader_epochs(args.corpus, args.epochs, args.processes, jitter, args.cpu)
            else:
                worker_bin = args.worker_bin if side == "stoker" else args.against_worker
                rates, n = stoker_epochs(
                    worker_bin,
                    args.corpus,
                    args.epochs,
                    args.processes,
                    jitter,
                    args.batch,
                    args.cpu,
                    args.message_mib,
                    args.layout,
                    not args.messages,
                )
            print(
                f"round {round} {side + ':':12} best {max(rates):7.1f} images/s  "
                f"(epochs {', '.join(f'{r:.0f}' for r in rates)}; {n} images)"
            )
            sys.stdout.flush()


if __name__ == "__main__":
    main()
