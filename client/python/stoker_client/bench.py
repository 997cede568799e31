"""Stream throughput into numpy: one Python client, two local workers serving ready batches.

    cargo build --release -p stoker-worker --features bench   # `bench serve` is behind the feature
    python -m stoker_client.bench --worker-bin target/release/stoker-worker [--seconds 5]

Starts two `stoker-worker bench serve` processes (synthetic float16 image batches, so
preprocessing is not the bottleneck), reads for `--seconds` after a warm-up, and prints GB/s
of tensor payload. Batches come in gRPC messages, what a consumer elsewhere gets; with
`--shared-memory` the workers hand them over through /dev/shm, as to a consumer on their host.
"""

import argparse
import re
import resource
import subprocess
import tempfile
import time

from .client import Client


def start_worker(binary: str, images: int, log, shared_memory: bool = False) -> subprocess.Popen:
    shared = ["--shared-memory-dir", "/dev/shm"] if shared_memory else []
    return subprocess.Popen(
        [binary, "bench", "serve", "--listen", "127.0.0.1:0", "--images", str(images), *shared],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={"RUST_LOG": "info", "NO_COLOR": "1"},
    )


def address(log_path: str, process: subprocess.Popen, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(log_path) as f:
            match = re.search(r"listen\S*?=(127\.0\.0\.1:\d+)", re.sub(r"\x1b\[[0-9;]*m", "", f.read()))
        if match:
            return match.group(1)
        if process.poll() is not None:
            raise RuntimeError(f"the worker exited; see {log_path}")
        time.sleep(0.05)
    raise TimeoutError(f"the worker did not listen within {timeout} s; see {log_path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker-bin", default="target/release/stoker-worker")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--images", type=int, default=14, help="images per batch (14: 4 MiB batches)")
    ap.add_argument("--max-message-bytes", type=int, default=64 << 20)
    ap.add_argument("--shared-memory", action="store_true", help="batches through /dev/shm instead of messages")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        logs = [f"{tmp}/worker-{i}.log" for i in range(2)]
        files = [open(p, "w") for p in logs]
        workers = [start_worker(args.worker_bin, args.images, f, args.shared_memory) for f in files]
        try:
            addresses = [address(p, w) for p, w in zip(logs, workers)]
            with Client(addresses, "bench", "synthetic", max_message_bytes=args.max_message_bytes) as client:
                for _ in range(50):
                    next(client)
                nbytes = batches = 0
                usage = resource.getrusage(resource.RUSAGE_SELF)
                start = time.perf_counter()
                while time.perf_counter() - start < args.seconds:
                    batch = next(client)
                    nbytes += batch.nbytes
                    batches += 1
                seconds = time.perf_counter() - start
                after = resource.getrusage(resource.RUSAGE_SELF)
                w = client.window()
            cpu = (after.ru_utime + after.ru_stime) - (usage.ru_utime + usage.ru_stime)
            faults = after.ru_minflt - usage.ru_minflt
            how = "shared memory" if args.shared_memory else f"{args.max_message_bytes >> 20} MiB messages"
            print(
                f"python client, 2 workers, {args.images} images/batch, {how}: "
                f"{nbytes / seconds / 1e9:.2f} GB/s ({batches / seconds:.0f} batches/s), "
                f"median batch time {w.median * 1e3:.2f} ms, wait fraction {w.wait_fraction:.2f}; "
                f"this process: {cpu / (nbytes / 1e9):.3f} s of CPU and "
                f"{faults / (nbytes / 1e9):.0f} page faults per GB"
            )
        finally:
            for w in workers:
                w.terminate()
                w.wait(timeout=10)
            for f in files:
                f.close()


if __name__ == "__main__":
    main()
