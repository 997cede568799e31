"""The Python side of a worker's `python` transforms: one process of the worker's pool.

The worker runs this file's source with `python -c` (the copy built into the worker binary, so
the two sides always speak the same protocol); only numpy and the standard library are needed
where it runs. It is importable too, for `element_rng`, which gives the same generator a
transform receives, so a training job or a test can reproduce a transform's output.

Protocol (the worker's side is worker/src/python/):
- argv: `--path DIR` (repeatable, put first on sys.path) and `--op INDEX=MODULE:FUNCTION`
  (repeatable). File descriptor 3 is a shared memory file (memfd) mapped by both sides.
- Messages both ways are a 4-byte little-endian length and a JSON object; requests come on
  stdin, replies go to the original stdout. The user's code prints to stderr (the worker's log)
  instead: its `print` must not corrupt the replies.
- Once the ops are imported: {"status": "ready"}, or {"status": "fatal", "error": ...} and exit.
- Request: {"op": INDEX, "rng": [seed, epoch, element, op], "size": BYTES (the file's),
  "out": OFFSET (where the output may start: past the input), "fields": [FIELD...]}
  with FIELD {"name", "kind": "array", "dtype", "shape", "offset", "length"} and, for an image
  of an op with `layout: planar`, "strides" (a view of the shared memory, no copy),
  {"name", "kind": "bytes", "offset", "length"}, or {"name", "kind": "list", "offset",
  "lengths"} (byte strings one after another).
- Reply: {"status": "ok", "size": BYTES, "fields": [...]} with the output (arrays in C order, no
  "strides") in the shared memory
  after the input (the file grown if it must be), {"status": "drop"}, or {"status": "error",
  "error": "Type: message", "traceback": ...}.
- A batched op's request has "rngs": [[seed, epoch, element, op], ...] and "elements":
  [[FIELD...], ...] instead of "rng" and "fields"; its reply {"status": "ok", "size": BYTES,
  "elements": [[FIELD...] or null, ...]}, one per element (null: dropped), or an error for all.
"""

import importlib
import json
import mmap
import os
import struct
import sys
import traceback
from typing import Optional

import numpy as np

SHARED_FD = 3
ALIGN = 64
DTYPES = {"uint8", "int32", "int64", "float16", "float32", "float64"}


def element_rng(seed: int, epoch: int, element: int, op: int) -> np.random.Generator:
    """The generator a `python` op gets for an element: `element` is the row id a batch
    reports (`Batch.rows`, split << 32 | position) and `op` the op's index in spec.transforms."""
    return np.random.default_rng([seed, epoch, element, op])


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class _Shared:
    """The shared memory file, mapped again whenever either side grows it. Old mappings are
    left to the garbage collector: the user's code may still hold views of them."""

    def __init__(self):
        self.size = 0
        self.map: Optional[mmap.mmap] = None

    def view(self) -> mmap.mmap:
        assert self.map is not None, "the request's size maps the file first"
        return self.map

    def ensure(self, size: int):
        if size > self.size:
            if os.fstat(SHARED_FD).st_size < size:
                os.ftruncate(SHARED_FD, size)
            self.map = mmap.mmap(SHARED_FD, size)
            self.size = size


def _inputs(shared: _Shared, fields):
    element = {}
    for f in fields:
        kind, offset = f["kind"], f["offset"]
        if kind == "array":
            element[f["name"]] = np.ndarray(
                tuple(f["shape"]),
                dtype=np.dtype(f["dtype"]).newbyteorder("<"),
                buffer=shared.view(),
                offset=offset,
                strides=f.get("strides"),
            )
        elif kind == "bytes":
            element[f["name"]] = bytes(shared.view()[offset : offset + f["length"]])
        else:
            values = []
            for length in f["lengths"]:
                values.append(bytes(shared.view()[offset : offset + length]))
                offset += length
            element[f["name"]] = values
    return element


def _as_output(name, value):
    """(kind, payload) for one returned field, or a TypeError saying what to return instead."""
    if isinstance(value, str):
        return "bytes", value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes", bytes(value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (bytes, str)) for v in value):
        return "list", [v.encode() if isinstance(v, str) else bytes(v) for v in value]
    array = np.asarray(value)
    if array.dtype.kind in "OSU" and array.ndim <= 1 and all(isinstance(v, (bytes, str)) for v in array.flat):
        return "list", [v.encode() if isinstance(v, str) else bytes(v) for v in array.flat]
    if array.dtype == np.bool_:
        array = array.astype(np.uint8)
    if array.dtype.name not in DTYPES:
        raise TypeError(
            f"field {name!r}: {type(value).__name__} of dtype {array.dtype} has no Stoker form; "
            f"return an array of {', '.join(sorted(DTYPES))}, bytes or str"
        )
    # Any memory order: _outputs writes it out in C order.
    return "array", np.asarray(array, dtype=array.dtype.newbyteorder("<"))


def _outputs(shared: _Shared, start: int, element):
    """Writes `element` into the shared memory from `start`: its fields and where they end."""
    if not isinstance(element, dict):
        raise TypeError(f"the function returned {type(element).__name__}; return a dict of fields or None")
    converted = [(str(name), *_as_output(name, value)) for name, value in element.items()]
    sizes = []
    for _, kind, payload in converted:
        if kind == "array":
            sizes.append(payload.nbytes)
        elif kind == "bytes":
            sizes.append(len(payload))
        else:
            sizes.append(sum(len(v) for v in payload))
    end = start
    for size in sizes:
        end = _aligned(end) + size
    shared.ensure(end)
    fields, offset = [], start
    for (name, kind, payload), size in zip(converted, sizes):
        offset = _aligned(offset)
        if kind == "array":
            # One copy, whatever the array's memory order (a planar input's result is planar).
            np.copyto(np.ndarray(payload.shape, dtype=payload.dtype, buffer=shared.view(), offset=offset), payload)
            fields.append(
                {
                    "name": name,
                    "kind": kind,
                    "dtype": payload.dtype.name,
                    "shape": list(payload.shape),
                    "offset": offset,
                    "length": size,
                }
            )
        elif kind == "bytes":
            view = np.frombuffer(shared.view(), dtype=np.uint8, count=size, offset=offset)
            view[:] = np.frombuffer(payload, dtype=np.uint8)
            fields.append({"name": name, "kind": kind, "offset": offset, "length": size})
        else:
            view = np.frombuffer(shared.view(), dtype=np.uint8, count=size, offset=offset)
            at = 0
            for v in payload:
                view[at : at + len(v)] = np.frombuffer(v, dtype=np.uint8)
                at += len(v)
            fields.append({"name": name, "kind": kind, "offset": offset, "lengths": [len(v) for v in payload]})
        offset += size
    return fields, offset


def _call_batched(function, shared: _Shared, request) -> dict:
    elements = [_inputs(shared, fields) for fields in request["elements"]]
    out = function(elements, [element_rng(*rng) for rng in request["rngs"]])
    if not isinstance(out, (list, tuple)) or len(out) != len(elements):
        got = f"{len(out)} items" if isinstance(out, (list, tuple)) else type(out).__name__
        raise TypeError(
            f"the batched function returned {got} for {len(elements)} elements; "
            "return a list as long, an element or None for each"
        )
    replies: list = []
    offset = request["out"]
    for element in out:
        if element is None:
            replies.append(None)
            continue
        fields, offset = _outputs(shared, offset, element)
        replies.append(fields)
    return {"status": "ok", "size": shared.size, "elements": replies}


def _read(stream):
    header = stream.read(4)
    if len(header) < 4:
        return None
    (length,) = struct.unpack("<I", header)
    return json.loads(stream.read(length))


def _write(stream, message):
    body = json.dumps(message).encode()
    stream.write(struct.pack("<I", len(body)) + body)
    stream.flush()


def _parse_args(argv):
    paths, ops = [], {}
    it = iter(argv)
    for arg in it:
        if arg == "--path":
            paths.append(next(it))
        elif arg == "--op":
            index, target = next(it).split("=", 1)
            module, function = target.split(":", 1)
            ops[int(index)] = (module, function)
    return paths, ops


def main(argv):
    # Replies go to the original stdout; the user's prints go to stderr.
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    paths, ops = _parse_args(argv)
    sys.path[:0] = paths
    functions = {}
    for index, (module, function) in ops.items():
        try:
            functions[index] = getattr(importlib.import_module(module), function)
        except Exception:  # noqa: BLE001 - told to the worker, which stops with it
            _write(
                replies,
                {
                    "status": "fatal",
                    "error": f"transforms[{index}].python: loading {module}.{function}: "
                    + traceback.format_exc(limit=-3).strip(),
                },
            )
            return 1
    _write(replies, {"status": "ready"})
    shared = _Shared()
    while True:
        request = _read(requests)
        if request is None:
            return 0
        shared.ensure(request["size"])
        try:
            function = functions[request["op"]]
            if "elements" in request:
                _write(replies, _call_batched(function, shared, request))
                continue
            element = _inputs(shared, request["fields"])
            out = function(element, element_rng(*request["rng"]))
            if out is None:
                _write(replies, {"status": "drop"})
                continue
            fields, _ = _outputs(shared, request["out"], out)
            _write(replies, {"status": "ok", "size": shared.size, "fields": fields})
        except Exception as e:  # noqa: BLE001 - the element's failure, reported per onError
            _write(
                replies,
                {
                    "status": "error",
                    "error": f"{type(e).__name__}: {e}"[:1000],
                    "traceback": traceback.format_exc()[-8000:],
                },
            )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
