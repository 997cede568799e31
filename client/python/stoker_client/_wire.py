"""The few protobuf messages the client exchanges (api/proto/stoker/v1alpha1/*.proto), encoded
and decoded by hand: no generated code, and payload pieces come back as memoryview slices of the
received message, so tensors are built without copying."""

from typing import Dict, List, NamedTuple, Optional, Tuple

# Wire types.
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class WireError(ValueError):
    """A message that is not valid protobuf for its type."""


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _len_field(field: int, payload: bytes) -> bytes:
    return _key(field, _LEN) + _varint(len(payload)) + payload


def _read_varint(buf, pos: int):
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise WireError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 64:
            raise WireError("varint longer than 10 bytes")


def _fields(buf):
    """(field, wire type, value, start, end) of each field; LEN values are (start, end) spans."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, pos = _read_varint(buf, pos)
            yield field, wire_type, value
        elif wire_type == _LEN:
            length, pos = _read_varint(buf, pos)
            if pos + length > end:
                raise WireError("field runs past the end of the message")
            yield field, wire_type, (pos, pos + length)
            pos += length
        elif wire_type == _I64:
            pos += 8
            if pos > end:
                raise WireError("truncated fixed64")
        elif wire_type == _I32:
            pos += 4
            if pos > end:
                raise WireError("truncated fixed32")
        else:
            raise WireError(f"unsupported wire type {wire_type}")


def encode_stream_request(namespace: str, pipeline: str, job: str, consumer_index: int,
                          start_epoch: Optional[int], max_message_bytes: int, epoch: Optional[int] = None,
                          consumers: int = 0, coordinated: bool = False, shared_memory=None) -> bytes:
    """A StreamRequest. `start_epoch`: a standalone worker's first epoch; `epoch`: under the
    dispatcher, the one epoch the stream carries (it ends once the worker finished it);
    `consumers`: the ranks of a job read by ranks, `consumer_index` being this one's;
    `coordinated`: they are dealt rounds (coordinated mode); `shared_memory`: the
    `_shared.Identity` of the directory this client maps batches from."""
    ref = _len_field(1, namespace.encode()) + _len_field(2, pipeline.encode())
    out = _len_field(1, ref) + _len_field(2, job.encode())
    if consumer_index:
        out += _key(3, _VARINT) + _varint(consumer_index)
    if start_epoch is not None:
        out += _key(4, _VARINT) + _varint(start_epoch)
    if max_message_bytes:
        out += _key(5, _VARINT) + _varint(max_message_bytes)
    if epoch is not None:
        out += _key(6, _VARINT) + _varint(epoch)
    if consumers:
        out += _key(7, _VARINT) + _varint(consumers)
    if coordinated:
        out += _key(8, _VARINT) + _varint(1)
    if shared_memory is not None:
        shared = (_len_field(1, shared_memory.boot_id.encode()) + _key(2, _VARINT) + _varint(shared_memory.device)
                  + _key(3, _VARINT) + _varint(shared_memory.inode) + _key(4, _VARINT) + _varint(shared_memory.uid))
        out += _len_field(9, shared)
    return out


def _packed(buf, span):
    """The varints of a packed repeated field (proto3's default for repeated numbers)."""
    pos, end = span
    while pos < end:
        value, pos = _read_varint(buf, pos)
        yield value


class TensorMeta(NamedTuple):
    name: str
    dtype: int
    shape: List[int]
    byte_length: int


# One round of one worker's deal of an epoch (RoundRef): (the worker's dispatcher id, the
# round's index, counted from 0 in each epoch).
RoundRef = Tuple[str, int]


class Header(NamedTuple):
    epoch: int
    split: int
    sequence: int
    tensors: List[TensorMeta]
    # Splits whose last element is in this batch (reported to the dispatcher).
    completes: List[int] = []
    # Where each row came from: split << 32 | position.
    rows: List[int] = []
    # The dispatcher that handed out the splits of the rows (0 from a standalone worker): a
    # client that rejoined a restarted dispatcher drops batches of the one before.
    incarnation: int = 0
    # Coordinated mode: the round the batch was dealt in.
    round: Optional[RoundRef] = None


class Chunk(NamedTuple):
    header: Optional[Header]
    pieces: List[memoryview]
    last: bool
    # The file in this client's shared-memory directory holding the whole payload.
    shared_file: str = ""
    # The worker takes the file back once its arrays are gone (`_shared.take`).
    reuse_shared_file: bool = False


def _tensor_meta(buf) -> TensorMeta:
    name, dtype, shape, byte_length = "", 0, [], 0
    for field, wire_type, value in _fields(buf):
        if field == 1 and wire_type == _LEN:
            name = bytes(buf[value[0]:value[1]]).decode()
        elif field == 2 and wire_type == _VARINT:
            dtype = value
        elif field == 3 and wire_type == _LEN:
            shape.extend(_packed(buf, value))
        elif field == 3 and wire_type == _VARINT:
            shape.append(value)
        elif field == 4 and wire_type == _VARINT:
            byte_length = value
    return TensorMeta(name, dtype, shape, byte_length)


def _round_ref(buf) -> RoundRef:
    worker, index = "", 0
    for field, wire_type, value in _fields(buf):
        if field == 1 and wire_type == _LEN:
            worker = bytes(buf[value[0]:value[1]]).decode()
        elif field == 2 and wire_type == _VARINT:
            index = value
    return worker, index


def _header(buf) -> Header:
    epoch = split = sequence = incarnation = 0
    round_ref = None
    tensors, completes, rows = [], [], []
    for field, wire_type, value in _fields(buf):
        if wire_type == _VARINT and field in (1, 2, 3):
            if field == 1:
                epoch = value
            elif field == 2:
                split = value
            else:
                sequence = value
        elif field == 4 and wire_type == _LEN:
            tensors.append(_tensor_meta(buf[value[0]:value[1]]))
        elif field == 5 and wire_type == _LEN:
            completes.extend(_packed(buf, value))
        elif field == 5 and wire_type == _VARINT:
            completes.append(value)
        elif field == 6 and wire_type == _LEN:
            rows.extend(_packed(buf, value))
        elif field == 6 and wire_type == _VARINT:
            rows.append(value)
        elif field == 7 and wire_type == _VARINT:
            incarnation = value
        elif field == 8 and wire_type == _LEN:
            round_ref = _round_ref(buf[value[0]:value[1]])
    return Header(epoch, split, sequence, tensors, completes, rows, incarnation, round_ref)


def decode_chunk(message: bytes) -> Chunk:
    """A BatchChunk; its pieces are views into `message`."""
    view = memoryview(message)
    header, pieces, last, shared_file, reuse = None, [], False, "", False
    for field, wire_type, value in _fields(view):
        if field == 1 and wire_type == _LEN:
            header = _header(view[value[0]:value[1]])
        elif field == 2 and wire_type == _LEN:
            pieces.append(view[value[0]:value[1]])
        elif field == 3 and wire_type == _VARINT:
            last = bool(value)
        elif field == 4 and wire_type == _LEN:
            shared_file = bytes(view[value[0]:value[1]]).decode("utf-8", "replace")
        elif field == 5 and wire_type == _VARINT:
            reuse = bool(value)
    return Chunk(header, pieces, last, shared_file, reuse)


def _pipeline_ref(namespace: str, pipeline: str) -> bytes:
    return _len_field(1, namespace.encode()) + _len_field(2, pipeline.encode())


class Held(NamedTuple):
    """Rows of a split the client received (HeldRows): of an unfinished split from a worker
    that left the list, in an acknowledgement; of a split not completed, in a `Rejoin`."""
    epoch: int
    split: int
    positions: List[int]


class Rejoin(NamedTuple):
    """What a client has of its job's unfinished epochs, for a dispatcher that restarted: the
    dispatcher it was registered with, the job's open epoch and clients as that one last said,
    the (epoch, split)s whose completion it received and the rows it received of the others."""
    incarnation: int
    open_epoch: int
    clients: int
    completed: List[Tuple[int, int]]
    received: List[Held]


def encode_register_client(namespace: str, pipeline: str, job: str, consumer_index: int, client_id: str,
                           consumers: int = 0, resume: Optional[dict] = None, rejoin: Optional[Rejoin] = None,
                           coordinated: bool = False) -> bytes:
    """A RegisterClientRequest; `consumers` and `coordinated` as in `encode_stream_request`;
    `resume`: a consumer's saved state, as `Client.state()` gives it; `rejoin`: registering
    again with a dispatcher that forgot the client. (Field 5, the epoch read, is no longer sent.)"""
    out = _len_field(1, _pipeline_ref(namespace, pipeline)) + _len_field(2, job.encode())
    if consumer_index:
        out += _key(3, _VARINT) + _varint(consumer_index)
    if client_id:
        out += _len_field(4, client_id.encode())
    if consumers:
        out += _key(6, _VARINT) + _varint(consumers)
    if resume is not None:
        out += _len_field(7, _resume_state(resume))
    if rejoin is not None:
        # Sent even when every field is zero: its presence is what says "rejoining".
        out += _len_field(8, _rejoin(rejoin))
    if coordinated:
        out += _key(9, _VARINT) + _varint(1)
    return out


def _rejoin(rejoin: Rejoin) -> bytes:
    """A Rejoin; its rows are HeldRows with packed positions."""
    out = b""
    for field, value in ((1, rejoin.incarnation), (2, rejoin.open_epoch), (3, rejoin.clients)):
        if value:
            out += _key(field, _VARINT) + _varint(value)
    for epoch, split in rejoin.completed:
        out += _split_ref(4, epoch, split)
    for epoch, split, positions in rejoin.received:
        out += _held_rows(5, epoch, split, positions)
    return out


def _resume_state(state: dict) -> bytes:
    """A ResumeState; its rows are HeldRows of its epoch."""
    out = _len_field(1, state["job"].encode())
    for field, name in ((2, "epoch"), (3, "batches"), (4, "consumers"), (5, "consumer_index")):
        if state[name]:
            out += _key(field, _VARINT) + _varint(state[name])
    for split, positions in state["yielded"]:
        out += _held_rows(6, state["epoch"], split, positions)
    return out


class Registered(NamedTuple):
    """A RegisterClientResponse."""
    client_id: str
    window_ms: int
    # What to stream and watch as (empty: the job as named).
    job: str
    # The dispatcher's start (0 from one that predates restarts being told apart).
    incarnation: int = 0


def decode_register_client(message: bytes) -> Registered:
    view = memoryview(message)
    client_id, window_ms, job, incarnation = "", 0, "", 0
    for field, wire_type, value in _fields(view):
        if field == 1 and wire_type == _LEN:
            client_id = bytes(view[value[0]:value[1]]).decode()
        elif field == 2 and wire_type == _VARINT:
            window_ms = value
        elif field == 3 and wire_type == _LEN:
            job = bytes(view[value[0]:value[1]]).decode()
        elif field == 4 and wire_type == _VARINT:
            incarnation = value
    return Registered(client_id, window_ms, job, incarnation)


def encode_watch_workers(namespace: str, pipeline: str, job: str) -> bytes:
    return _len_field(1, _pipeline_ref(namespace, pipeline)) + _len_field(2, job.encode())


# An epoch's order of rounds in coordinated mode (RoundOrder): (the position in the epoch's
# order of the first round listed, the rounds from there on).
RoundOrder = Tuple[int, List[RoundRef]]


class EpochQuota(NamedTuple):
    """Batches of `epoch` each rank of a job read by ranks may yield; `complete`: the epoch's
    final count (every rank's streams of it ended), beyond which a rank drops what it got;
    `order`: in coordinated mode, the order every rank yields the epoch's rounds in (None: the
    epoch is not coordinated, or the job is not)."""
    epoch: int
    batches: int
    complete: bool
    order: Optional[RoundOrder] = None


class WorkerList(NamedTuple):
    addresses: List[str]
    # Grows whenever the list changes; acknowledged once applied.
    version: int
    # The job's open epoch.
    epoch: int
    # A job read by ranks: the quotas of its recent epochs.
    quotas: List[EpochQuota] = []
    # The dispatcher sending it (a client registered with another one rejoins).
    incarnation: int = 0
    # The job's live clients: after a restart the job waits for as many rejoins.
    clients: int = 0
    # The id of the worker at each address (a new process at an address is another worker).
    workers: List[str] = []
    # Set when the workers serve TLS: the name their certificates are for (verified instead of
    # the IP the client dials); empty for plaintext workers.
    tls_server_name: str = ""
    # The workers are those of the previous list on the same stream: `addresses` and
    # `workers` are empty, and the client keeps what it has (`following`).
    same_workers: bool = False

    def following(self, previous: Optional["WorkerList"]) -> "WorkerList":
        """This list with the workers filled in from `previous` (the last on the same
        stream) when it says they did not change."""
        if self.same_workers and previous is not None:
            return self._replace(addresses=previous.addresses, workers=previous.workers, same_workers=False)
        return self

    def keys(self) -> List[str]:
        """How the client keys the listed workers: `address#id` where the id is given, so that
        a new process at an address (a pod's IP reused) is another worker, and the rows the
        one before delivered are held rows of a worker that left."""
        ids = list(self.workers) + [""] * (len(self.addresses) - len(self.workers))
        return [f"{a}#{i}" if i else a for a, i in zip(self.addresses, ids)]


def _round_order(buf) -> RoundOrder:
    base, rounds = 0, []
    for field, wire_type, value in _fields(buf):
        if field == 1 and wire_type == _VARINT:
            base = value
        elif field == 2 and wire_type == _LEN:
            rounds.append(_round_ref(buf[value[0]:value[1]]))
    return base, rounds


def _epoch_quota(buf) -> EpochQuota:
    epoch = batches = 0
    complete = False
    order = None
    for field, wire_type, value in _fields(buf):
        if field == 1 and wire_type == _VARINT:
            epoch = value
        elif field == 2 and wire_type == _VARINT:
            batches = value
        elif field == 3 and wire_type == _VARINT:
            complete = bool(value)
        elif field == 4 and wire_type == _LEN:
            # Present even when empty: a coordinated epoch nothing of which is ordered yet.
            order = _round_order(buf[value[0]:value[1]])
    return EpochQuota(epoch, batches, complete, order)


def decode_worker_list(message: bytes) -> WorkerList:
    view = memoryview(message)
    addresses, version, epoch, quotas, incarnation, clients, workers, tls_name = [], 0, 0, [], 0, 0, [], ""
    same_workers = False
    for field, wire_type, value in _fields(view):
        if field == 1 and wire_type == _LEN:
            addresses.append(bytes(view[value[0]:value[1]]).decode())
        elif field == 2 and wire_type == _VARINT:
            version = value
        elif field == 3 and wire_type == _VARINT:
            epoch = value
        elif field == 4 and wire_type == _LEN:
            quotas.append(_epoch_quota(view[value[0]:value[1]]))
        elif field == 5 and wire_type == _VARINT:
            incarnation = value
        elif field == 6 and wire_type == _VARINT:
            clients = value
        elif field == 7 and wire_type == _LEN:
            workers.append(bytes(view[value[0]:value[1]]).decode())
        elif field == 8 and wire_type == _LEN:
            tls_name = bytes(view[value[0]:value[1]]).decode()
        elif field == 9 and wire_type == _VARINT:
            same_workers = bool(value)
    return WorkerList(addresses, version, epoch, quotas, incarnation, clients, workers, tls_name, same_workers)


def _double(field: int, value: float) -> bytes:
    import struct
    return _key(field, _I64) + struct.pack("<d", value)


def encode_report_window(client_id: str, batches: int, median: float, p90: float, wait_fraction: float,
                         workers: int, mean: float) -> bytes:
    out = _len_field(1, client_id.encode()) + _key(2, _VARINT) + _varint(batches)
    out += _double(3, median) + _double(4, p90) + _double(5, wait_fraction)
    return out + _key(6, _VARINT) + _varint(workers) + _double(7, mean)


class RankProgress(NamedTuple):
    """What a rank of a job read by ranks has received of an epoch: data batches (with
    tensors), whether every stream of the epoch ended (`batches` is final), and the rows it
    dropped beyond the epoch's final quota so far. In coordinated mode also `rounds`: by
    worker id, how many of its rounds the rank received without a gap from round 0, and
    `position`: how many rounds of the epoch's order it yielded."""
    epoch: int
    batches: int
    ended: bool
    dropped_rows: int
    rounds: Dict[str, int] = {}
    position: int = 0


def _rank_progress(progress: RankProgress) -> bytes:
    out = _key(1, _VARINT) + _varint(progress.epoch) + _key(2, _VARINT) + _varint(progress.batches)
    if progress.ended:
        out += _key(3, _VARINT) + _varint(1)
    if progress.dropped_rows:
        out += _key(4, _VARINT) + _varint(progress.dropped_rows)
    # A map is a repeated entry message (key 1, value 2); sorted, so equal maps encode alike.
    for worker, count in sorted(progress.rounds.items()):
        out += _len_field(5, _len_field(1, worker.encode()) + _key(2, _VARINT) + _varint(count))
    if progress.position:
        out += _key(6, _VARINT) + _varint(progress.position)
    return _len_field(7, out)


def _held_rows(field: int, epoch: int, split: int, positions) -> bytes:
    """A HeldRows, its positions packed."""
    rows = _key(1, _VARINT) + _varint(epoch) + _key(2, _VARINT) + _varint(split)
    if positions:
        rows += _len_field(3, b"".join(_varint(p) for p in positions))
    return _len_field(field, rows)


def _split_ref(field: int, epoch: int, split: int) -> bytes:
    return _len_field(field, _key(1, _VARINT) + _varint(epoch) + _key(2, _VARINT) + _varint(split))


def encode_acknowledge(client_id: str, completed, list_version: int, held, leaving: bool = False,
                       discarded: bool = False, received=()) -> bytes:
    """An AcknowledgeRequest: `completed` (epoch, split)s, `held` `Held`s; `leaving`: the
    client is closing (the dispatcher forgets it at once), `discarded`: with `leaving`, it
    received batches it never handed to the caller; `received`: a rank's `RankProgress`es."""
    out = _len_field(1, client_id.encode())
    for epoch, split in completed:
        out += _split_ref(2, epoch, split)
    if list_version:
        out += _key(3, _VARINT) + _varint(list_version)
    for epoch, split, positions in held:
        out += _held_rows(4, epoch, split, positions)
    if leaving:
        out += _key(5, _VARINT) + _varint(1)
    if discarded:
        out += _key(6, _VARINT) + _varint(1)
    for progress in received:
        out += _rank_progress(progress)
    return out


def decode_acknowledge(message: bytes) -> int:
    """The open epoch an AcknowledgeResponse reports."""
    epoch = 0
    for field, wire_type, value in _fields(memoryview(message)):
        if field == 1 and wire_type == _VARINT:
            epoch = value
    return epoch
