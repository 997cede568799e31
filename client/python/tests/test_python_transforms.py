"""`python` transforms in a real worker give exactly what the same function gives in plain
Python on the same elements with the same generators (`element_rng` of the worker's Python
runtime, worker/src/python/runtime.py):
after the worker's own decode and crop (images through shared memory), and on JSONL records.
"""

import os
import sys
import textwrap

import numpy as np
import pytest

from stoker_client import Client

from conftest import ROOT, Worker, within

# The worker's side of `python` transforms, importable for the generators it hands them.
sys.path.insert(0, str(ROOT / "worker" / "src" / "python"))
from runtime import element_rng  # noqa: E402

# The workers run the op with this interpreter (it has numpy).
os.environ.setdefault("STOKER_PYTHON", sys.executable)

AUGMENT = textwrap.dedent("""
    import numpy as np

    def augment(element, rng):
        image = element["image"]
        if rng.random() < 0.5:
            image = image[:, ::-1]
        noise = rng.integers(-8, 9, size=image.shape)
        element["image"] = np.clip(image.astype(np.int16) + noise, 0, 255).astype(np.uint8)
        element["brightness"] = np.float32(image.mean())
        return element

    def augment_planar(element, rng):
        # `layout: planar`: each channel contiguous, still indexed [h, w, c] (by its strides),
        # as torchvision's [c, h, w] decode permuted is.
        h, w, c = element["image"].shape
        assert element["image"].strides == (w, 1, h * w), element["image"].strides
        return augment(element, rng)

    def scale(element, rng):
        n = int(element["n"])
        if n % 7 == 3:
            return None
        return {"n": element["n"], "y": element["x"] * rng.normal(size=element["x"].shape), "name": f"row {n}"}

    def scale_batch(elements, rngs):
        # The batched form: lists in, a list as long back; each element with its own generator.
        assert len(elements) <= 8 and len(elements) == len(rngs)
        return [scale(e, r) for e, r in zip(elements, rngs)]

    def short_batch(elements, rngs):
        return [scale(e, r) for e, r in zip(elements, rngs)][1:]
""")

SEED = 11


def write_module(directory):
    code = directory / "code"
    code.mkdir()
    (code / "user_augment.py").write_text(AUGMENT)
    return code


def image_pipeline(directory, corpus, python_op, code):
    """The image pipeline with `python_op` (a function of user_augment and its layout) after
    the crop, or none."""
    python = ""
    if python_op:
        function, layout = python_op
        python = f"  - python: {{module: user_augment, function: {function}, layout: {layout}, path: '{code}'}}\n"
    path = directory / (f"{python_op[0]}.yaml" if python_op else "without.yaml")
    path.write_text(
        "apiVersion: stoker.dev/v1alpha1\nkind: DataPipeline\nmetadata: {name: py, namespace: test}\nspec:\n"
        f"  source: {{uri: 'file://{corpus}/', format: imageFolder}}\n"
        "  transforms:\n"
        "  - decodeImage: {channels: 3}\n"
        "  - centerCrop: {size: [48, 40]}\n"
        f"{python}"
        "  batchSize: 5\n"
        f"  seed: {SEED}\n"
    )
    return path


def rows_of(address, epochs):
    """{(epoch, row): {field: array}} of everything a standalone worker serves."""
    out = {}
    with Client([address], "test", "py") as client:
        for batch in client:
            for i, row in enumerate(batch.rows.tolist()):
                out[(batch.epoch, row)] = {name: t[i] for name, t in batch.tensors.items()}
    assert {epoch for epoch, _ in out} == set(range(epochs))
    return out


@pytest.mark.parametrize("python_op", [("augment", "interleaved"), ("augment_planar", "planar")])
def test_an_image_augmentation_equals_plain_python_after_the_rust_decode(tmp_path, corpus, python_op):
    code = write_module(tmp_path)
    sys.path.insert(0, str(code))
    import user_augment

    workers = [
        Worker(image_pipeline(tmp_path, corpus, op, code), tmp_path / f"worker-{i}.log", epochs=2)
        for i, op in enumerate((None, python_op))
    ]
    try:
        plain = within(120, rows_of, workers[0].address, 2)
        augmented = within(120, rows_of, workers[1].address, 2)
    finally:
        for w in workers:
            w.stop()
    assert plain.keys() == augmented.keys() and len(plain) == 2 * 24
    op = 2  # the python op's index in spec.transforms
    flipped = 0
    for (epoch, row), element in plain.items():
        inputs = {"image": element["image"].copy(), "label": element["label"]}
        want = user_augment.augment(inputs, element_rng(SEED, epoch, row, op))
        got = augmented[(epoch, row)]
        assert got["image"].dtype == np.uint8 and got["image"].shape == (48, 40, 3)
        np.testing.assert_array_equal(got["image"], want["image"])
        assert got["brightness"] == want["brightness"]
        assert got["label"] == element["label"]
        flipped += int(not np.array_equal(got["image"][:, ::-1], got["image"]))
    # Each epoch draws anew: the same image gets different noise in epochs 0 and 1.
    rows = [row for (epoch, row) in plain if epoch == 0]
    assert any(not np.array_equal(augmented[(0, r)]["image"], augmented[(1, r)]["image"]) for r in rows)


def records_pipeline(tmp_path, python):
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    for f in range(3):
        (data / f"{f}.jsonl").write_text(
            "".join(f'{{"n": {n}, "x": [{n}.25, {n}.5, {n}.75]}}\n' for n in range(f * 20, (f + 1) * 20))
        )
    pipeline = tmp_path / "records.yaml"
    pipeline.write_text(
        "apiVersion: stoker.dev/v1alpha1\nkind: DataPipeline\nmetadata: {name: py, namespace: test}\nspec:\n"
        f"  source: {{uri: 'file://{data}/', format: jsonl}}\n"
        "  transforms:\n"
        "  - selectFields: {fields: [n, x]}\n"
        f"  - python: {python}\n"
        "  batchSize: 4\n"
        "  padValue: 0\n"
        f"  seed: {SEED}\n"
    )
    return pipeline


def test_a_batched_function_returning_the_wrong_length_fails_its_elements(tmp_path):
    code = write_module(tmp_path)
    pipeline = records_pipeline(tmp_path, f"{{module: user_augment, function: short_batch, path: '{code}', batch: 8}}")
    worker = Worker(pipeline, tmp_path / "worker.log", epochs=1)
    rows = []
    try:
        with Client([worker.address], "test", "py") as client:
            for batch in client:
                rows.extend(batch.rows.tolist())
    finally:
        worker.stop()
    assert rows == [], "every call failed, so every element (onError: skip): none arrives"
    log = (tmp_path / "worker.log").read_text()
    assert "the batched function returned 7 items for 8 elements" in log, log[-2000:]


@pytest.mark.parametrize("function, batch", [("scale", ""), ("scale_batch", ", batch: 8")])
def test_records_and_dropping_equal_plain_python(tmp_path, function, batch):
    """One element per call, and the batched form: the same elements, each as the plain function
    makes it with its own generator, over two epochs."""
    code = write_module(tmp_path)
    sys.path.insert(0, str(code))
    import user_augment

    pipeline = records_pipeline(
        tmp_path, f"{{module: user_augment, function: {function}, path: '{code}', deterministic: false{batch}}}"
    )
    worker = Worker(pipeline, tmp_path / "worker.log", epochs=2)
    try:
        got = within(120, rows_of, worker.address, 2)
    finally:
        worker.stop()
    for epoch in (0, 1):
        ns = sorted(int(e["n"]) for (ep, _), e in got.items() if ep == epoch)
        assert ns == [n for n in range(60) if n % 7 != 3], f"epoch {epoch}: every element once, the dropped ones not"
    for (epoch, row), element in got.items():
        n = int(element["n"])
        inputs = {"n": np.int64(n), "x": np.array([n + 0.25, n + 0.5, n + 0.75])}
        want = user_augment.scale(inputs, element_rng(SEED, epoch, row, 1))
        np.testing.assert_array_equal(element["y"], want["y"])
        text = bytes(element["name"]).rstrip(b"\0").decode()
        assert text == want["name"]
