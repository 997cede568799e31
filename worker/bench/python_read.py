"""A Python client reading running workers (`stoker-worker bench serve`) as fast as it can:
GB/s of tensor payload, batches/s and the process's CPU per GB. It uses only the client's public
API, so it measures any version of the package (the binding of the Rust client, or an older
one); `stoker-worker bench read` measures the Rust client the same way.

    python worker/bench/python_read.py --worker 127.0.0.1:50052 --worker 127.0.0.1:50053 [--seconds 5]
"""

import argparse
import resource
import time

from stoker_client import Client

WARM_UP = 50


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="append", required=True, help="a worker's address; repeat for each")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--max-message-bytes", type=int, default=64 << 20)
    ap.add_argument("--shared-memory", action="store_true", help="batches through /dev/shm (workers on this host)")
    ap.add_argument("--label", default="python client")
    args = ap.parse_args()
    options = {"max_message_bytes": args.max_message_bytes, "shared_memory": args.shared_memory}
    with Client(args.worker, "bench", "synthetic", **options) as client:
        for _ in range(WARM_UP):
            next(client)
        nbytes = batches = 0
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        while time.perf_counter() - start < args.seconds:
            batch = next(client)
            nbytes += batch.nbytes
            batches += 1
        seconds = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    how = "shared memory" if args.shared_memory else f"{args.max_message_bytes >> 20} MiB messages"
    print(
        f"{args.label}, {len(args.worker)} workers, {how}: {nbytes / seconds / 1e9:.2f} GB/s "
        f"({batches / seconds:.0f} batches/s); this process: {cpu / (nbytes / 1e9):.3f} s of CPU per GB"
    )


if __name__ == "__main__":
    main()
