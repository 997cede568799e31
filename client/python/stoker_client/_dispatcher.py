"""Dispatcher mode: register as a consumer, follow the worker list (and, for a job read by
ranks, its quotas), acknowledge what the client received, report windows, and rejoin a
dispatcher that restarted (or the one of a new leader) with what the client has of the job."""

import threading
import time
from typing import Iterable, List, Optional, Protocol, Tuple

import grpc

from . import _wire
from .errors import TlsError, WorkerError
from .stats import WindowStats

DISPATCHER = "/stoker.v1alpha1.Dispatcher/"
RETRY = 0.25
RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED,
           grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND)
# After an acknowledgement, completions gather this long before the next one: a split is done
# only once acknowledged, so they go promptly, but not one request per batch.
ACK_PAUSE = 0.02
# How long closing waits for the dispatcher to take the last acknowledgement.
LEAVE_TIMEOUT = 1.0
# Metadata of the dispatcher's NOT_FOUND answers: its incarnation (decimal). A client that finds
# its own there was only forgotten (it went silent too long); any other, the dispatcher restarted.
INCARNATION = "stoker-incarnation"


def answered_incarnation(error: grpc.RpcError) -> Optional[int]:
    """The incarnation a NOT_FOUND names (`INCARNATION`), None if it names none."""
    for name in ("trailing_metadata", "initial_metadata"):
        metadata = getattr(error, name, None)
        for key, value in (metadata() if callable(metadata) else None) or ():
            if key == INCARNATION:
                value = value.decode() if isinstance(value, bytes) else value
                return int(value) if value.isdigit() else None
    return None


class Followed(Protocol):
    """What the follower needs from the client it streams into and reports for."""

    metadata: Optional[Tuple[Tuple[str, str], ...]]
    """Sent with every call to the dispatcher (the bearer token)."""

    wake: threading.Event
    """Set when there is something to acknowledge: by the client when the caller takes a batch
    that completes splits not told by a rejoin already (for a job read by ranks: when it
    arrives, and whenever what the rank received changed), by the follower when it applied a
    worker list."""

    def closed(self) -> bool: ...

    def wait_closed(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds for the client to close; whether it has."""

    def add_channel(self, channel: grpc.Channel) -> None:
        """Closed when the client closes."""

    def add_call(self, call) -> None:
        """Cancelled when the client closes."""

    def on_close(self, leave) -> None:
        """`leave(discarded)` is called when the client closes, after its streams stopped,
        with whether it received batches it never handed to the caller."""

    def stream_as(self, job: str) -> None:
        """The job the client streams as: the job, or the run a resumed job goes on as.
        Called before the first worker list."""

    def set_tls_name(self, name: str) -> None:
        """The name the listed workers' certificates are for ("" for plaintext workers)."""

    def tls_problem(self, e: grpc.RpcError) -> Optional[str]:
        """What went wrong in TLS, if `e` is a failed handshake."""

    def plaintext_refused(self, e: grpc.RpcError) -> Optional[str]:
        """Why a plaintext client kept failing, if the server looks like a TLS one."""

    def follow(self, addresses: Iterable[str], epoch: int) -> List[_wire.Held]:
        """Applies a worker list whose job's open epoch is `epoch`: stops streaming from the
        workers not listed (waiting until what each buffered is recorded), opens the streams
        missing to the ones listed (the first list also sets the epoch reading starts at), and
        returns the rows of unfinished splits it got from the workers left out, forgetting
        them as held (they are kept for a rejoin until their split or epoch is done)."""

    def take_report(self) -> Tuple[WindowStats, int]:
        """The batch-time window (restarting it) and how many workers delivered."""

    def rejoin(self, incarnation: int, clients: int) -> _wire.Rejoin:
        """What the client has of the job's unfinished epochs, for a dispatcher that forgot it,
        the one it was registered with being `incarnation` and its last list of the job's
        clients `clients`. At once, batches of `incarnation` arriving are dropped, the
        completions in it are not acknowledged again, and those waiting to be are dropped:
        the rejoin tells them."""

    def take_completed(self) -> List[Tuple[int, int]]:
        """The (epoch, split)s completed since the last take (none a rejoin told)."""

    def restore_completed(self, completed: List[Tuple[int, int]]) -> None:
        """Completions a failed acknowledgement carried: they go with the next one."""

    def saw_epoch(self, epoch: int) -> None:
        """The job's open epoch, as the dispatcher last said."""

    def set_quotas(self, quotas: List[_wire.EpochQuota]) -> None:
        """A job read by ranks: the quotas of a worker list, each the latest of its epoch."""

    def rank_progress(self) -> List[_wire.RankProgress]:
        """A job read by ranks: what this rank received of each epoch it tracks (in coordinated
        mode with its rounds and its position in the order), all of them every time (a
        restarted dispatcher relearns them); empty otherwise."""


class Follower:
    def __init__(self, client: Followed, channel: grpc.Channel, target: str, namespace, pipeline, job, consumer_index,
                 connect_timeout, consumers: int = 0, resume: Optional[dict] = None, coordinated: bool = False):
        self.client = client
        self.channel = channel
        unary = lambda name, decode: channel.unary_unary(
            DISPATCHER + name, request_serializer=lambda r: r, response_deserializer=decode)
        self.register_rpc = unary("RegisterClient", _wire.decode_register_client)
        self.report_rpc = unary("ReportWindow", lambda m: m)
        self.acknowledge_rpc = unary("Acknowledge", _wire.decode_acknowledge)
        self.watch_rpc = channel.unary_stream(DISPATCHER + "WatchWorkers",
                                              request_serializer=lambda r: r, response_deserializer=_wire.decode_worker_list)
        self.args = (namespace, pipeline, consumer_index)
        self.consumers, self.coordinated = consumers, coordinated
        # The job registered, watched and streamed as: once registered with `resume` (sent
        # until then only), the run the resumed job goes on as.
        self.job, self.resume = job, resume
        self.client_id, self.window = "", 1.0
        # The dispatcher registered with (RegisterClientResponse.incarnation; changed under
        # `rejoining` only) and the job's clients it last listed: what a rejoin names.
        self.incarnation = self.clients = 0
        # The newest list applied and the rows held from workers the lists dropped, not yet
        # acknowledged: the watch thread adds, the acknowledging thread sends.
        self.lock = threading.Lock()
        self.version = 0
        self.held: List[_wire.Held] = []
        self.acknowledged = 0
        # Registrations made, and rejoins begun (under `lock`): a thread that saw the counts
        # before a call knows from them whether the dispatcher forgetting the client was dealt
        # with since, and whether what it meant to send was told by a rejoin since. One
        # registration at a time; a rejoin that failed is sent again as it was (`pending`).
        self.registrations = self.rejoins = 0
        self.rejoining = threading.Lock()
        self.pending: Optional[_wire.Rejoin] = None
        # Watch calls opened: a new one may be to a restarted dispatcher, which must hear the
        # rank progress again. With the progress it last took (acknowledging thread only).
        self.watches = 0
        self.acknowledged_progress: Tuple[int, List[_wire.RankProgress]] = (0, [])
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                self.register()
                break
            except grpc.RpcError as e:
                problem = client.tls_problem(e)
                if problem is not None:
                    # A certificate that does not verify will not start verifying: say so now.
                    raise TlsError(target, problem) from None
                if e.code() not in RETRIED or time.monotonic() > deadline:
                    hint = client.plaintext_refused(e)
                    if hint is not None:
                        raise TlsError(target, hint) from None
                    raise WorkerError(target, e.code(), e.details() or "") from None
                time.sleep(RETRY)
        client.add_channel(channel)
        client.on_close(lambda discarded: self.leave(discarded, LEAVE_TIMEOUT))
        threading.Thread(target=self.watch, daemon=True, name="stoker-watch").start()
        threading.Thread(target=self.acknowledge_loop, daemon=True, name="stoker-acknowledge").start()
        threading.Thread(target=self.report, daemon=True, name="stoker-report").start()

    def register(self, rejoin: Optional[_wire.Rejoin] = None):
        namespace, pipeline, index = self.args
        registered = self.register_rpc(
            _wire.encode_register_client(namespace, pipeline, self.job, index, self.client_id, self.consumers,
                                         self.resume, rejoin, self.coordinated),
            metadata=self.client.metadata)
        self.client_id = registered.client_id
        self.registrations += 1
        if registered.window_ms:
            self.window = registered.window_ms / 1000.0
        self.incarnation = registered.incarnation
        # Registering again (the dispatcher forgot the client) is as the run's client.
        self.resume = None
        if registered.job:
            self.job = registered.job
            self.client.stream_as(registered.job)

    def call(self, rpc, request, again=None):
        """`rpc` with `request(client_id)`; if the dispatcher forgot the client, registers
        again (`forgotten`) and calls with `again(client_id)` (by default, `request`'s)."""
        seen = self.registrations
        try:
            return rpc(request(self.client_id), metadata=self.client.metadata)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
            self.forgotten(e, seen)
        return rpc((again or request)(self.client_id), metadata=self.client.metadata)

    def forgotten(self, error: grpc.RpcError, seen: int) -> None:
        """The dispatcher answered NOT_FOUND: if it names the incarnation the client registered
        with, it only forgot the client (silent too long) and it registers again; otherwise the
        dispatcher restarted and the client rejoins it. Nothing if a registration was made
        since the caller saw `seen` (threads that find out together register once). Raises
        the registration's error: the next call that finds the client forgotten tries again."""
        answered = answered_incarnation(error)
        with self.rejoining:
            if self.registrations != seen:
                return
            if answered is not None and answered == self.incarnation and self.pending is None:
                self.register()
            else:
                self.rejoin()

    def rejoin_if_restarted(self, incarnation: int) -> None:
        """A worker list from dispatcher `incarnation`: if the client registered with another
        one, that one restarted (or another operator leads now), and the client rejoins even
        if it has not called the new one yet. Either incarnation 0: one that does not tell."""
        with self.rejoining:
            if incarnation and self.incarnation and incarnation != self.incarnation:
                self.rejoin()

    def rejoin(self) -> None:
        """Registers again, as the same client, telling the dispatcher what the client has of
        the job (`Followed.rejoin`): from that moment the batches of the dispatcher it leaves
        are dropped, and what waited to be acknowledged goes no more (the rejoin tells it). A
        rejoin that failed is sent again as it was. Called with `rejoining` held."""
        if self.pending is None:
            with self.lock:
                self.rejoins += 1
                self.held.clear()
                self.pending = self.client.rejoin(self.incarnation, self.clients)
        self.register(self.pending)
        self.pending = None

    def watch(self):
        namespace, pipeline, _ = self.args
        while not self.client.closed():
            try:
                call = self.watch_rpc(_wire.encode_watch_workers(namespace, pipeline, self.job),
                                      metadata=self.client.metadata)
                self.client.add_call(call)
                with self.lock:
                    self.watches += 1
                previous = None
                for workers in call:
                    workers = previous = workers.following(previous)
                    try:
                        self.rejoin_if_restarted(workers.incarnation)
                    except grpc.RpcError:
                        pass  # the acknowledgement of this list is refused, and rejoins again
                    with self.lock:
                        self.clients = workers.clients
                    self.client.set_quotas(workers.quotas)
                    self.client.set_tls_name(workers.tls_server_name)
                    held = self.client.follow(workers.keys(), workers.epoch)
                    with self.lock:
                        self.version = workers.version
                        self.held.extend(held)
                    # Acknowledged even with nothing held: the dispatcher waits for every
                    # client before it hands a dead worker's splits out again.
                    self.client.wake.set()
            except (grpc.RpcError, ValueError):  # ValueError: the client closed the channel
                pass
            time.sleep(RETRY)  # the dispatcher went away (leader change): watch again

    def acknowledge_loop(self):
        wake = self.client.wake
        while not self.client.closed():
            if not wake.wait(1.0):
                continue
            wake.clear()
            if self.acknowledge():
                self.client.wait_closed(ACK_PAUSE)
            else:
                wake.set()
                self.client.wait_closed(RETRY)

    def acknowledge(self) -> bool:
        """Sends what there is to acknowledge; whether it went (or there was nothing)."""
        with self.lock:
            # Taken together with the rejoin count: a rejoin since tells them.
            version, held, watches, seen = self.version, list(self.held), self.watches, self.rejoins
            completed = self.client.take_completed()
        received = self.client.rank_progress()
        progress = (watches, received)
        if not completed and not held and version == self.acknowledged \
                and (not received or progress == self.acknowledged_progress):
            return True

        def again(client_id):
            """After registering again: a rejoin told a restarted dispatcher the completions
            and rows, and the one that only forgot the client took its splits back."""
            return _wire.encode_acknowledge(client_id, [], version, [], received=received)

        def request(client_id):
            with self.lock:
                rejoined = self.rejoins != seen
            if rejoined:
                return again(client_id)
            return _wire.encode_acknowledge(client_id, completed, version, held, received=received)

        try:
            epoch = self.call(self.acknowledge_rpc, request, again)
        except (grpc.RpcError, ValueError):  # ValueError: the client closed the channel meanwhile
            with self.lock:
                if self.rejoins == seen:
                    self.client.restore_completed(completed)
            return False
        with self.lock:
            if self.rejoins == seen:
                del self.held[:len(held)]  # only the watch thread adds, at the end
        self.acknowledged = version
        self.acknowledged_progress = progress
        self.client.saw_epoch(epoch)
        return True

    def leave(self, discarded: bool, timeout: float) -> None:
        """The client is closing: a last acknowledgement, with `leaving` set, of what is left
        to acknowledge, so that the dispatcher forgets the client at once instead of waiting
        for it (and, if it `discarded` batches it never handed to the caller, hands the job's
        in-flight splits out again). Best effort: a dispatcher that does not answer within
        `timeout` seconds times the client out instead."""
        with self.lock:
            version, held = self.version, list(self.held)
        completed = self.client.take_completed()
        request = _wire.encode_acknowledge(self.client_id, completed, version, held, leaving=True, discarded=discarded)
        try:
            self.acknowledge_rpc(request, metadata=self.client.metadata, timeout=timeout)
        except (grpc.RpcError, ValueError):
            pass

    def report(self):
        while not self.client.wait_closed(self.window):
            w, workers = self.client.take_report()
            mean = w.total_batch_time / w.batches if w.batches else 0.0
            try:
                self.call(self.report_rpc, lambda client_id: _wire.encode_report_window(
                    client_id, w.batches, w.median, w.p90, w.wait_fraction, workers, mean))
            except (grpc.RpcError, ValueError):
                pass  # a lost window (or the client closed): the autoscaler decides from the next
