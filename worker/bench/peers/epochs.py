"""What every preprocessing peer prints, as `stoker-worker bench preprocess` does: each epoch's
images/s and the best of them."""

import time


def best_of(repeat, batches, cores):
    """Iterates `batches()` (a fresh iterable of image batches each epoch) `repeat` times."""
    best = None
    for run in range(1, repeat + 1):
        start = time.perf_counter()
        n = sum(int(images.shape[0]) for images, _ in batches())
        secs = time.perf_counter() - start
        print(
            f"run {run}: {n} images in {secs:.2f} s: {n / secs:.0f} images/s, "
            f"{n / secs / cores:.0f} images/s per core ({cores} cores)",
            flush=True,
        )
        best = secs if best is None else min(best, secs)
    print(f"best: {n / best:.0f} images/s, {n / best / cores:.0f} images/s per core")
