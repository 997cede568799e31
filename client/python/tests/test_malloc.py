"""The consumer's malloc tuning (stoker_client/_malloc.py), each case in a fresh process."""

import json
import os
import platform
import subprocess
import sys

import pytest

# Allocates and frees 32 MiB in 4 MiB blocks, as a consumer does with message buffers, and
# reports tune()'s answer and the page faults per round after a warm-up.
PROBE = """
import json, resource
from stoker_client import _malloc
tuned = _malloc.tune()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    blocks = [bytearray(4 << 20) for _ in range(8)]; del blocks
before = faults()
for _ in range(20):
    blocks = [bytearray(4 << 20) for _ in range(8)]; del blocks
print(json.dumps({"tuned": tuned, "faults": (faults() - before) / 20}))
"""


def probe(**env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "STOKER_TUNE_MALLOC"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tuning is glibc's; elsewhere it does nothing")
def test_a_tuned_consumer_reuses_freed_message_buffers_instead_of_faulting_them_in_again():
    tuned, untouched = probe(), probe(STOKER_TUNE_MALLOC="0")
    assert tuned["tuned"] and not untouched["tuned"]
    # 32 MiB is 8192 pages: glibc's defaults give them back and fault them in every round.
    assert untouched["faults"] > 4000, untouched
    assert tuned["faults"] < untouched["faults"] / 10, (tuned, untouched)


def test_a_users_own_malloc_settings_win():
    assert not probe(MALLOC_TRIM_THRESHOLD_="1000000")["tuned"]
    assert not probe(MALLOC_MMAP_THRESHOLD_="1000000")["tuned"]
