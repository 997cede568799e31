"""Decoding and reassembly over hand-built messages (what a worker may send, and what it must not),
and the dispatcher messages the client encodes and decodes."""

import struct

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
    assert 6 not in fields


def test_a_stream_request_under_the_dispatcher_names_its_epoch():
    request = _wire.encode_stream_request("ns", "p", "job", 0, None, 1 << 20, epoch=5)
    fields = {f: v for f, _, v in _wire._fields(memoryview(request))}
    assert fields[6] == 5 and 4 not in fields
    # Epoch 0 is sent too: the field is optional, unset means a standalone stream.
    request = _wire.encode_stream_request("ns", "p", "job", 0, None, 1 << 20, epoch=0)
    assert request.endswith(_wire._key(6, 0) + varint(0))


def test_a_rank_names_the_ranks_of_its_job_when_streaming_and_registering():
    request = _wire.encode_stream_request("ns", "p", "job", 1, None, 1 << 20, epoch=2, consumers=4)
    fields = {f: v for f, _, v in _wire._fields(memoryview(request))}
    assert (fields[3], fields[6], fields[7]) == (1, 2, 4)
    assert 7 not in {f for f, _, _ in _wire._fields(memoryview(_wire.encode_stream_request("ns", "p", "j", 0, None, 0)))}
    register = _wire.encode_register_client("ns", "p", "job", 3, "c-1", consumers=4)
    fields = {f: v for f, _, v in _wire._fields(memoryview(register))}
    assert (fields[3], fields[6]) == (3, 4)
    assert register[fields[4][0]:fields[4][1]] == b"c-1"
    # Not read by ranks: the field is left out.
    assert 6 not in {f for f, _, _ in _wire._fields(memoryview(_wire.encode_register_client("ns", "p", "j", 0, "")))}


def rows_field(rows, packed=True):
    if packed:
        return field(6, b"".join(varint(r) for r in rows))
    return b"".join(_wire._key(6, 0) + varint(r) for r in rows)


@pytest.mark.parametrize("packed", [True, False])
def test_the_rows_a_batch_came_from_are_read_packed_or_not(packed):
    rows = [5 << 32 | 0, 5 << 32 | 17, 300 << 32 | 0xFFFFFFFF]
    (batch,) = feed([chunk(HEAD + rows_field(rows, packed), [PAYLOAD], last=True)])
    assert batch.rows.dtype == np.uint64
    assert batch.rows.tolist() == rows
    assert (batch.rows >> np.uint64(32)).tolist() == [5, 5, 300]
    # Tensors are still views of the message.
    np.testing.assert_array_equal(batch["image"], IMAGE)


def test_a_batch_without_rows_has_an_empty_array():
    (batch,) = feed([chunk(HEAD, [PAYLOAD], last=True)])
    assert batch.rows.dtype == np.uint64 and batch.rows.shape == (0,)
    # Completions only: no tensors, no rows.
    (batch,) = feed([chunk(header(1, 2, 0, []) + field(5, varint(2)), [], last=True)])
    assert batch.tensors == {} and batch.rows.shape == (0,) and batch.completes == [2]


def test_the_worker_list_carries_version_and_epoch():
    message = field(1, b"10.0.0.1:50052") + field(1, b"10.0.0.2:50052") + _wire._key(2, 0) + varint(7) + _wire._key(3, 0) + varint(2)
    assert _wire.decode_worker_list(message) == (["10.0.0.1:50052", "10.0.0.2:50052"], 7, 2, [], 0, 0, [], "", False)
    assert _wire.decode_worker_list(b"") == ([], 0, 0, [], 0, 0, [], "", False)


def test_a_list_with_the_workers_of_the_last_one_keeps_them():
    first = _wire.decode_worker_list(field(1, b"w:1") + field(7, b"w-1") + _wire._key(2, 0) + varint(3))
    same = _wire.decode_worker_list(_wire._key(2, 0) + varint(3) + _wire._key(3, 0) + varint(5)
                                    + _wire._key(9, 0) + varint(1))
    assert same.same_workers and same.addresses == [] and same.keys() == []
    followed = same.following(first)
    assert (followed.keys(), followed.epoch, followed.same_workers) == (["w:1#w-1"], 5, False)
    # A whole list stands as it is, and so does the first of a stream.
    assert first.following(followed) is first and same.following(None) is same


def test_the_worker_list_names_the_workers_certificates_when_they_serve_tls():
    message = field(1, b"10.0.0.5:50052") + field(8, b"p-workers.team-a.svc")
    assert _wire.decode_worker_list(message).tls_server_name == "p-workers.team-a.svc"


def test_the_worker_list_names_each_worker_so_a_new_process_at_an_address_is_another():
    message = field(1, b"10.0.0.5:50052") + field(1, b"10.0.0.6:50052") + field(7, b"w-2") + field(7, b"w-3")
    workers = _wire.decode_worker_list(message)
    assert workers.workers == ["w-2", "w-3"]
    assert workers.keys() == ["10.0.0.5:50052#w-2", "10.0.0.6:50052#w-3"]
    # A dispatcher that names no workers: the addresses alone, as before.
    assert _wire.decode_worker_list(field(1, b"w:1")).keys() == ["w:1"]
    from stoker_client.client import _target
    assert _target("10.0.0.5:50052#w-2") == "10.0.0.5:50052"


def test_the_worker_list_names_its_dispatcher_and_the_jobs_clients():
    message = field(1, b"w:1") + _wire._key(2, 0) + varint(3) + _wire._key(5, 0) + varint(1 << 40) \
        + _wire._key(6, 0) + varint(4) + epoch_quota(2, 5, False)
    workers = _wire.decode_worker_list(message)
    assert (workers.incarnation, workers.clients) == (1 << 40, 4)
    assert (workers.addresses, workers.version, workers.quotas) == (["w:1"], 3, [_wire.EpochQuota(2, 5, False)])


def epoch_quota(epoch, batches, complete):
    out = _wire._key(1, 0) + varint(epoch) + _wire._key(2, 0) + varint(batches)
    return field(4, out + (_wire._key(3, 0) + varint(1) if complete else b""))


def test_the_worker_list_carries_the_quotas_of_a_job_read_by_ranks():
    message = field(1, b"w:1") + _wire._key(2, 0) + varint(3) + epoch_quota(4, 17, True) + epoch_quota(5, 2, False)
    workers = _wire.decode_worker_list(message)
    assert (workers.addresses, workers.version, workers.epoch) == (["w:1"], 3, 0)
    assert workers.quotas == [_wire.EpochQuota(4, 17, True), _wire.EpochQuota(5, 2, False)]
    # Zeros are left out on the wire: a quota of nothing for epoch 0.
    assert _wire.decode_worker_list(field(4, b"")).quotas == [(0, 0, False, None)]


def round_ref(worker, index):
    """A RoundRef's bytes."""
    return field(1, worker.encode()) + (_wire._key(2, 0) + varint(index) if index else b"")


def test_a_coordinated_epochs_quota_carries_the_order_of_its_rounds():
    order = _wire._key(1, 0) + varint(5) + field(2, round_ref("w-1", 3)) + field(2, round_ref("w-2", 0))
    quota = _wire._key(1, 0) + varint(2) + _wire._key(2, 0) + varint(9) + field(4, order)
    (decoded,) = _wire.decode_worker_list(field(4, quota)).quotas
    assert decoded == _wire.EpochQuota(2, 9, False, (5, [("w-1", 3), ("w-2", 0)]))
    # An order present but empty: the epoch is coordinated, nothing of it is ordered yet.
    quota = _wire._key(1, 0) + varint(2) + field(4, b"")
    assert _wire.decode_worker_list(field(4, quota)).quotas[0].order == (0, [])
    # No order: the epoch is not coordinated.
    assert _wire.decode_worker_list(epoch_quota(2, 9, False)).quotas[0].order is None


def test_a_coordinated_batch_names_its_round():
    head = HEAD + field(8, round_ref("w-1", 300))
    (batch,) = feed([chunk(head, [PAYLOAD], last=True)])
    assert batch.round == ("w-1", 300)
    np.testing.assert_array_equal(batch["label"], LABEL)
    # Round 0 leaves its index out; a batch not dealt in rounds has none.
    assert feed([chunk(HEAD + field(8, round_ref("w-2", 0)), [PAYLOAD], last=True)])[0].round == ("w-2", 0)
    assert feed([chunk(HEAD, [PAYLOAD], last=True)])[0].round is None


def test_a_coordinated_rank_says_so_when_streaming_and_registering():
    request = _wire.encode_stream_request("ns", "p", "job", 1, None, 1 << 20, epoch=2, consumers=2, coordinated=True)
    assert request == _wire.encode_stream_request("ns", "p", "job", 1, None, 1 << 20, epoch=2, consumers=2) \
        + _wire._key(8, 0) + varint(1)
    register = _wire.encode_register_client("ns", "p", "job", 1, "c-1", consumers=2, coordinated=True)
    assert register == _wire.encode_register_client("ns", "p", "job", 1, "c-1", consumers=2) \
        + _wire._key(9, 0) + varint(1)
    # Not coordinated: the fields are left out.
    assert 8 not in {f for f, _, _ in _wire._fields(memoryview(_wire.encode_stream_request("ns", "p", "j", 0, None, 0)))}
    assert 9 not in {f for f, _, _ in _wire._fields(memoryview(_wire.encode_register_client("ns", "p", "j", 0, "")))}


def test_watching_names_the_job():
    request = _wire.encode_watch_workers("ns", "p", "job")
    fields = {f: v for f, _, v in _wire._fields(memoryview(request))}
    assert request[fields[2][0]:fields[2][1]] == b"job"
    ref = request[fields[1][0]:fields[1][1]]
    assert [ref[s:e] for _, _, (s, e) in _wire._fields(memoryview(ref))] == [b"ns", b"p"]


def decode_acknowledge_request(message: bytes) -> dict:
    """An AcknowledgeRequest as a dict (the dispatcher's side, for the tests); "leaving",
    "discarded" and "received" only when set."""
    view = memoryview(message)
    out = {"client_id": "", "completed": [], "list_version": 0, "held": []}

    def numbers(span):
        sub = view[span[0]:span[1]]
        return sub, {f: v for f, t, v in _wire._fields(sub) if t == 0}

    for f, t, v in _wire._fields(view):
        if f == 1:
            out["client_id"] = bytes(view[v[0]:v[1]]).decode()
        elif f == 2:
            _, n = numbers(v)
            out["completed"].append((n.get(1, 0), n.get(2, 0)))
        elif f == 3:
            out["list_version"] = v
        elif f == 4:
            sub, n = numbers(v)
            positions = []
            for f2, t2, v2 in _wire._fields(sub):
                if f2 == 3 and t2 == 2:
                    positions.extend(_wire._packed(sub, v2))
                elif f2 == 3:
                    positions.append(v2)
            out["held"].append((n.get(1, 0), n.get(2, 0), positions))
        elif f == 5 and v:
            out["leaving"] = True
        elif f == 6 and v:
            out["discarded"] = True
        elif f == 7:
            sub, n = numbers(v)
            out.setdefault("received", []).append(
                _wire.RankProgress(n.get(1, 0), n.get(2, 0), bool(n.get(3, 0)), n.get(4, 0), rounds(sub), n.get(6, 0)))
    return out


def rounds(progress) -> dict:
    """A RankProgress's map of rounds (field 5: entries of key 1, value 2)."""
    out = {}
    for f, _, v in _wire._fields(progress):
        if f == 5:
            entry = progress[v[0]:v[1]]
            key, value = "", 0
            for f2, _, v2 in _wire._fields(entry):
                if f2 == 1:
                    key = bytes(entry[v2[0]:v2[1]]).decode()
                elif f2 == 2:
                    value = v2
            out[key] = value
    return out


def test_an_acknowledgement_encodes_completions_version_and_held_rows():
    held = [_wire.Held(3, 9, [0, 1, 200, 0xFFFFFFFF]), _wire.Held(4, 0, [])]
    message = _wire.encode_acknowledge("c-1", [(3, 2), (4, 0)], 12, held)
    assert decode_acknowledge_request(message) == {
        "client_id": "c-1", "completed": [(3, 2), (4, 0)], "list_version": 12,
        "held": [(3, 9, [0, 1, 200, 0xFFFFFFFF]), (4, 0, [])]}
    # Positions are packed: one length-delimited field, not one key per position.
    (rows,) = [v for f, _, v in _wire._fields(memoryview(message)) if f == 4][:1]
    sub = memoryview(message)[rows[0]:rows[1]]
    assert [f for f, _, _ in _wire._fields(sub)] == [1, 2, 3]
    assert decode_acknowledge_request(_wire.encode_acknowledge("c", [], 0, [])) == {
        "client_id": "c", "completed": [], "list_version": 0, "held": []}


def test_a_leaving_acknowledgement_says_so_and_whether_batches_were_discarded():
    message = _wire.encode_acknowledge("c-1", [(1, 2)], 3, [], leaving=True)
    assert decode_acknowledge_request(message) == {
        "client_id": "c-1", "completed": [(1, 2)], "list_version": 3, "held": [], "leaving": True}
    assert message.endswith(_wire._key(5, 0) + varint(1))
    message = _wire.encode_acknowledge("c-1", [], 3, [], leaving=True, discarded=True)
    assert decode_acknowledge_request(message)["discarded"] is True
    assert message.endswith(_wire._key(5, 0) + varint(1) + _wire._key(6, 0) + varint(1))
    # Not leaving: neither field is sent.
    assert [f for f, _, _ in _wire._fields(memoryview(_wire.encode_acknowledge("c", [], 3, [])))] == [1, 3]


def test_a_rank_acknowledges_what_it_received_of_each_epoch():
    received = [_wire.RankProgress(3, 12, True, 40), _wire.RankProgress(4, 0, False, 0)]
    message = _wire.encode_acknowledge("c-1", [(3, 2)], 5, [], received=received)
    assert decode_acknowledge_request(message) == {
        "client_id": "c-1", "completed": [(3, 2)], "list_version": 5, "held": [], "received": received}
    # Each RankProgress a length-delimited field 7, after the others; false and 0 left out.
    spans = [v for f, _, v in _wire._fields(memoryview(message)) if f == 7]
    assert [bytes(message[s:e]) for s, e in spans] == [
        _wire._key(1, 0) + varint(3) + _wire._key(2, 0) + varint(12) + _wire._key(3, 0) + varint(1) + _wire._key(4, 0) + varint(40),
        _wire._key(1, 0) + varint(4) + _wire._key(2, 0) + varint(0)]
    assert "received" not in decode_acknowledge_request(_wire.encode_acknowledge("c", [], 0, []))


def test_a_coordinated_rank_acknowledges_its_rounds_by_worker_and_its_position():
    received = [_wire.RankProgress(3, 7, False, 0, {"w-2": 3, "w-1": 4}, 6), _wire.RankProgress(4, 1, False, 0, {"w-1": 0})]
    message = _wire.encode_acknowledge("c-1", [], 5, [], received=received)
    assert decode_acknowledge_request(message)["received"] == received
    # The map: one entry message (key 1, value 2) per worker, as field 5, sorted by worker;
    # the position, field 6, after it, left out when 0.
    spans = [v for f, _, v in _wire._fields(memoryview(message)) if f == 7]
    entry = lambda worker, count: field(5, field(1, worker.encode()) + _wire._key(2, 0) + varint(count))
    assert [bytes(message[s:e]) for s, e in spans] == [
        _wire._key(1, 0) + varint(3) + _wire._key(2, 0) + varint(7) + entry("w-1", 4) + entry("w-2", 3)
        + _wire._key(6, 0) + varint(6),
        _wire._key(1, 0) + varint(4) + _wire._key(2, 0) + varint(1) + entry("w-1", 0)]
    # Not coordinated: neither field.
    plain = _wire.encode_acknowledge("c-1", [], 5, [], received=[_wire.RankProgress(3, 7, False, 0)])
    assert plain == _wire.encode_acknowledge("c-1", [], 5, [], received=[_wire.RankProgress(3, 7, False, 0, {}, 0)])
    (span,) = [v for f, _, v in _wire._fields(memoryview(plain)) if f == 7]
    assert [f for f, _, _ in _wire._fields(memoryview(plain)[span[0]:span[1]])] == [1, 2]


def test_the_acknowledge_response_carries_the_open_epoch():
    assert _wire.decode_acknowledge(_wire._key(1, 0) + varint(5)) == 5
    assert _wire.decode_acknowledge(b"") == 0


def test_a_window_report_no_longer_carries_completions():
    report = _wire.encode_report_window("c", 10, 0.1, 0.2, 0.3, 2, 0.15)
    # _fields skips doubles: the mean, field 7, ends the message.
    assert [f for f, _, _ in _wire._fields(memoryview(report))] == [1, 2, 6]
    assert report.endswith(_wire._key(7, 1) + struct.pack("<d", 0.15))


def decode_register_request(message: bytes) -> dict:
    """A RegisterClientRequest as a dict (the dispatcher's side, for the tests): its job,
    client_id and, when set, "resume" as `Client.state()` gives it and "rejoin" a
    `_wire.Rejoin`. Checks that the reserved field 5 is never sent."""
    view = memoryview(message)
    out = {"job": "", "client_id": ""}
    text = lambda span: bytes(view[span[0]:span[1]]).decode()
    for f, t, v in _wire._fields(view):
        assert f != 5, "RegisterClientRequest field 5 is reserved"
        if f == 2:
            out["job"] = text(v)
        elif f == 4:
            out["client_id"] = text(v)
        elif f == 7:
            out["resume"] = decode_resume_state(view[v[0]:v[1]])
        elif f == 8:
            out["rejoin"] = decode_rejoin(view[v[0]:v[1]])
    return out


def held_rows(sub) -> _wire.Held:
    """A HeldRows, its positions packed or not."""
    numbers, positions = {}, []
    for f, t, v in _wire._fields(sub):
        if f == 3 and t == 2:
            positions.extend(_wire._packed(sub, v))
        elif t == 0:
            numbers.setdefault(f, []).append(v)
    return _wire.Held(numbers.get(1, [0])[0], numbers.get(2, [0])[0], positions + numbers.get(3, []))


def decode_rejoin(view) -> _wire.Rejoin:
    numbers, completed, received = {}, [], []
    for f, t, v in _wire._fields(view):
        if f == 4:
            ref = {f2: v2 for f2, _, v2 in _wire._fields(view[v[0]:v[1]])}
            completed.append((ref.get(1, 0), ref.get(2, 0)))
        elif f == 5:
            received.append(held_rows(view[v[0]:v[1]]))
        elif t == 0:
            numbers[f] = v
    return _wire.Rejoin(numbers.get(1, 0), numbers.get(2, 0), numbers.get(3, 0), completed, received)


def test_a_rejoining_client_says_what_it_has_of_the_job():
    rejoin = _wire.Rejoin(incarnation=7, open_epoch=3, clients=2, completed=[(3, 1), (4, 0)],
                          received=[_wire.Held(3, 2, [0, 5, 0xFFFFFFFF]), _wire.Held(4, 9, [1])])
    message = _wire.encode_register_client("ns", "p", "job~run-1", 1, "c-1", consumers=2, rejoin=rejoin)
    assert decode_register_request(message) == {"job": "job~run-1", "client_id": "c-1", "rejoin": rejoin}
    # Field 8, after the others; in it the numbers, SplitRefs (4), then HeldRows (5) with
    # packed positions.
    fields = list(_wire._fields(memoryview(message)))
    assert [f for f, _, _ in fields] == [1, 2, 3, 4, 6, 8]
    start, end = fields[-1][2]
    body = memoryview(message)[start:end]
    assert [f for f, _, _ in _wire._fields(body)] == [1, 2, 3, 4, 4, 5, 5]
    start, end = [v for f, _, v in _wire._fields(body) if f == 5][0]
    assert bytes(body[start:end]) == _wire._key(1, 0) + varint(3) + _wire._key(2, 0) + varint(2) \
        + field(3, varint(0) + varint(5) + varint(0xFFFFFFFF))
    # A rejoin with nothing to say is still sent, empty: its presence says "rejoining".
    empty = _wire.Rejoin(0, 0, 0, [], [])
    message = _wire.encode_register_client("ns", "p", "j", 0, "c-1", rejoin=empty)
    assert message.endswith(field(8, b"")) and decode_register_request(message)["rejoin"] == empty
    # Not rejoining: no field 8.
    assert 8 not in {f for f, _, _ in _wire._fields(memoryview(_wire.encode_register_client("ns", "p", "j", 0, "c")))}


def test_a_batch_names_the_dispatcher_that_handed_out_its_splits():
    head = HEAD + _wire._key(7, 0) + varint(1 << 40)
    (batch,) = feed([chunk(head, [PAYLOAD], last=True)])
    assert batch.incarnation == 1 << 40
    np.testing.assert_array_equal(batch["label"], LABEL)
    # A standalone worker's: 0.
    assert feed([chunk(HEAD, [PAYLOAD], last=True)])[0].incarnation == 0


def decode_resume_state(view) -> dict:
    """A ResumeState; checks that its rows are of its epoch."""
    state = {"job": "", "epoch": 0, "batches": 0, "consumers": 0, "consumer_index": 0, "yielded": []}
    names = {2: "epoch", 3: "batches", 4: "consumers", 5: "consumer_index"}
    for f, t, v in _wire._fields(view):
        if f == 1:
            state["job"] = bytes(view[v[0]:v[1]]).decode()
        elif f in names and t == 0:
            state[names[f]] = v
        elif f == 6:
            sub = view[v[0]:v[1]]
            rows = {f2: v2 for f2, t2, v2 in _wire._fields(sub)}
            assert rows.get(1, 0) == state["epoch"], "HeldRows of the state's epoch (after it on the wire)"
            state["yielded"].append([rows.get(2, 0), list(_wire._packed(sub, rows[3])) if 3 in rows else []])
    return state


def test_a_resuming_client_registers_with_its_state():
    state = {"job": "job", "epoch": 3, "batches": 7, "consumers": 2, "consumer_index": 1,
             "yielded": [[0, [1, 2]], [9, [0, 300, 0xFFFFFFFF]]]}
    message = _wire.encode_register_client("ns", "p", "job", 1, "", consumers=2, resume=state)
    assert decode_register_request(message) == {"job": "job", "client_id": "", "resume": state}
    # The state comes last, as field 7, its rows HeldRows (field 6) with packed positions.
    fields = list(_wire._fields(memoryview(message)))
    assert fields[-1][0] == 7
    start, end = fields[-1][2]
    resume = memoryview(message)[start:end]
    start, end = next(v for f, _, v in _wire._fields(resume) if f == 6)
    assert [f for f, _, _ in _wire._fields(resume[start:end])] == [1, 2, 3]
    # Zeros are left out; no state, no field 7.
    empty = {"job": "j", "epoch": 0, "batches": 0, "consumers": 0, "consumer_index": 0, "yielded": []}
    message = _wire.encode_register_client("ns", "p", "j", 0, "", resume=empty)
    assert message.endswith(field(7, field(1, b"j")))
    assert 7 not in {f for f, _, _ in _wire._fields(memoryview(_wire.encode_register_client("ns", "p", "j", 0, "c")))}


def test_the_registration_response_names_the_job_to_stream_as_and_the_dispatchers_incarnation():
    message = field(1, b"c-1") + _wire._key(2, 0) + varint(500) + field(3, b"job~run-1") + _wire._key(4, 0) + varint(9)
    assert _wire.decode_register_client(message) == ("c-1", 500, "job~run-1", 9)
    assert _wire.decode_register_client(message).incarnation == 9
    # A dispatcher that says nothing: the job as named, incarnation 0.
    assert _wire.decode_register_client(field(1, b"c-1")) == ("c-1", 0, "", 0)
