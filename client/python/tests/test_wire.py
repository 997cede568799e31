"""Decoding and reassembly over hand-built messages: what a worker may send, and what it must not."""

import numpy as np
import pytest

from stoker_client import _wire
from stoker_client.batch import ProtocolError, Reassembler


def varint(n):
    return _wire._varint(n)


def field(number, payload: bytes) -> bytes:
    return _wire._len_field(number, payload)


def tensor_meta(name, dtype, shape, byte_length, packed=True):
    out = field(1, name.encode()) + _wire._key(2, 0) + varint(dtype)
    if packed:
        out += field(3, b"".join(varint(d) for d in shape))
    else:
        out += b"".join(_wire._key(3, 0) + varint(d) for d in shape)
    return out + _wire._key(4, 0) + varint(byte_length)


def header(epoch, split, sequence, tensors):
    out = _wire._key(1, 0) + varint(epoch) + _wire._key(2, 0) + varint(split) + _wire._key(3, 0) + varint(sequence)
    return out + b"".join(field(4, t) for t in tensors)


def chunk(head=None, pieces=(), last=False):
    out = field(1, head) if head is not None else b""
    out += b"".join(field(2, p) for p in pieces)
    if last:
        out += _wire._key(3, 0) + varint(1)
    return out


IMAGE = np.arange(2 * 3 * 4, dtype="<f4").reshape(2, 3, 4)
LABEL = np.array([7, -1], dtype="<i8")
HEAD = header(3, 5, 9, [tensor_meta("image", 5, [2, 3, 4], IMAGE.nbytes), tensor_meta("label", 3, [2], LABEL.nbytes)])
PAYLOAD = IMAGE.tobytes() + LABEL.tobytes()


def feed(chunks):
    r = Reassembler()
    out = [b for b in (r.push(_wire.decode_chunk(c)) for c in chunks) if b is not None]
    r.finish()
    return out


def test_one_chunk_one_piece_is_a_view_without_copies():
    message = chunk(HEAD, [PAYLOAD], last=True)
    decoded = _wire.decode_chunk(message)
    batch = Reassembler().push(decoded)
    assert (batch.epoch, batch.split, batch.sequence) == (3, 5, 9)
    np.testing.assert_array_equal(batch["image"], IMAGE)
    np.testing.assert_array_equal(batch["label"], LABEL)
    # The array's memory is the received message's, not a copy.
    assert np.shares_memory(batch["image"], np.frombuffer(message, dtype=np.uint8))
    assert not batch["image"].flags.writeable


def test_pieces_and_chunks_in_any_cut_come_back_identical():
    for cut in [1, 7, 40, 95, len(PAYLOAD) - 1]:
        chunks = [chunk(HEAD, [PAYLOAD[:cut]]), chunk(None, [PAYLOAD[cut:cut + 3], PAYLOAD[cut + 3:]], last=True)]
        (batch,) = feed(chunks)
        np.testing.assert_array_equal(batch["image"], IMAGE)
        np.testing.assert_array_equal(batch["label"], LABEL)


def test_the_splits_a_batch_completes_are_read():
    head = HEAD + _wire._len_field(5, varint(4) + varint(300))
    (batch,) = feed([chunk(head, [PAYLOAD], last=True)])
    assert batch.completes == [4, 300]
    assert feed([chunk(HEAD, [PAYLOAD], last=True)])[0].completes == []


def test_unpacked_shapes_and_float16_are_understood():
    half = np.array([1.5, -2.0], dtype="<f2")
    head = header(0, 0, 0, [tensor_meta("h", 4, [2], half.nbytes, packed=False)])
    (batch,) = feed([chunk(head, [half.tobytes()], last=True)])
    assert batch["h"].dtype == np.float16
    np.testing.assert_array_equal(batch["h"], half)


@pytest.mark.parametrize("chunks, message", [
    ([chunk(None, [b"x"], last=True)], "without a header"),
    ([chunk(HEAD, [PAYLOAD[:10]]), chunk(HEAD, [PAYLOAD[10:]], last=True)], "middle of a batch"),
    ([chunk(HEAD, [PAYLOAD[:10]], last=True)], "batch ended after 10"),
    ([chunk(HEAD, [PAYLOAD + b"extra"], last=True)], "more payload"),
    ([chunk(header(0, 0, 0, [tensor_meta("x", 42, [1], 1)]), [b"x"], last=True)], "unknown dtype 42"),
    ([chunk(header(0, 0, 0, [tensor_meta("x", 5, [3], 8)]), [b"x" * 8], last=True)], "does not match"),
    ([chunk(header(0, 0, 0, [tensor_meta("x", 1, [1], 1), tensor_meta("x", 1, [1], 1)]), [b"ab"], last=True)], "twice"),
    ([chunk(HEAD, [PAYLOAD[:10]])], "ended in the middle"),
])
def test_broken_streams_are_protocol_errors(chunks, message):
    with pytest.raises(ProtocolError, match=message):
        feed(chunks)


def test_a_batch_over_the_limit_is_refused_before_allocating():
    r = Reassembler(max_batch_bytes=16)
    with pytest.raises(ProtocolError, match="over the client's limit"):
        r.push(_wire.decode_chunk(chunk(HEAD, [])))


def test_garbage_bytes_are_wire_errors():
    with pytest.raises(_wire.WireError):
        _wire.decode_chunk(b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01")


def test_the_request_encodes_every_field():
    request = _wire.encode_stream_request("ns", "p", "job", 3, 7, 1 << 20)
    fields = {f: v for f, _, v in _wire._fields(memoryview(request))}
    assert request[fields[2][0]:fields[2][1]] == b"job"
    assert (fields[3], fields[4], fields[5]) == (3, 7, 1 << 20)
