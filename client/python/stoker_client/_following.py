"""The client's dispatcher mode: reading epoch by epoch (for a job read by ranks, within the
dispatcher's quotas), acknowledging completions, and the client as its follower
(`_dispatcher.Follower`) sees it. With a fixed list of workers none of this runs."""

import time
from typing import Iterable, List, Optional, Tuple

import grpc

from . import _wire
from ._ration import Ration, Step, rows_in
from ._resume import Yielded
from .stats import WindowStats

# How long dropping a worker the dispatcher no longer lists waits for its streams' threads.
STOP_TIMEOUT = 10.0

# What the caller's next item is when the epoch it read ended.
EPOCH_END = object()


class Following:
    """`Client`'s methods for dispatcher mode, on the fields `Client.__init__` sets up (the
    streams, buffers and lock are the client's)."""

    def _ensure_streams(self) -> None:
        """Under the dispatcher, starts the streams missing for the epochs being read: every
        listed worker's, unless its stream of that epoch is over. Called with the lock held."""
        if not self._follow or self._current is None or self._closed.is_set():
            return
        for epoch in range(self._current, self._open_through + 1):
            finished = self._finished.get(epoch, ())
            for worker in self._listed:
                if (worker, epoch) not in self._pumps and worker not in finished:
                    self._start(worker, epoch)

    def _take_current(self):
        """The next item of the epoch being read, `EPOCH_END` once it is over, or None to
        wait. Called with the lock held."""
        if self._open_through < self._current:
            # Without prefetching, an epoch's streams open when it is asked for.
            self._open_through = self._current
            self._ensure_streams()
        if self._consumers > 1:
            return self._take_rationed(self._current)
        buffer = self._buffers.get(self._current)
        if buffer:
            item = buffer.popleft()
            self._changed.notify_all()
            return item
        if self._over(self._current):
            self._advance()
            return EPOCH_END
        return None

    # Epochs.

    def _ended(self, epoch: int) -> bool:
        """Whether no more of `epoch` comes: the job is past it and every listed worker's
        stream of it is over (a worker's that left the list was cut). Called with the lock held."""
        if self.open_epoch <= epoch:
            return False
        finished = self._finished.get(epoch, ())
        return all(worker in finished for worker in self._listed)

    def _over(self, epoch: int) -> bool:
        """Whether this client has everything of `epoch`: it `_ended` and the caller took all
        it buffered. Called with the lock held."""
        return self._ended(epoch) and not self._buffers.get(epoch)

    def _advance(self) -> None:
        """The current epoch is over: read the next. Called with the lock held."""
        done = self._current
        self._buffers.pop(done, None)
        self._finished.pop(done, None)
        # The epoch just read stays until the next advance: its final counts still go to the
        # dispatcher with the next acknowledgements.
        for epoch in [e for e in self._rations if e < done]:
            del self._rations[epoch]
        for epoch in [e for e in self._quotas if e < done]:
            del self._quotas[epoch]
        self._current = done + 1
        self._yielded.next_epoch(self._current)
        if self._prefetch_next_epoch:
            self._open_through = max(self._open_through, self._current + 1)
        self._ensure_streams()
        self._changed.notify_all()

    # A job read by ranks.

    def _ration(self, epoch: int) -> Ration:
        """The epoch's ration, made with the latest quota on first use. Called with the lock held."""
        ration = self._rations.get(epoch)
        if ration is None:
            ration = self._rations[epoch] = Ration()
            quota = self._quotas.get(epoch)
            if quota is not None:
                ration.set_quota(quota.batches, quota.complete, quota.order)
        return ration

    def _take_rationed(self, epoch: int):
        """The next item of `epoch` the caller may take (a data batch within the quota, in
        coordinated mode that of the order's next round, or completions only), `EPOCH_END`
        once the epoch is over, or None to wait. Meanwhile moves what arrived into the epoch's
        FIFO, so that the streams keep flowing while the quota holds the caller back,
        acknowledging the completions of what it moves (the epoch, and so the final quota,
        waits for them), and drops what is beyond the final quota. Called with the lock held."""
        ration = self._ration(epoch)
        buffer = self._buffers.get(epoch)
        while True:
            step, batch = ration.step()
            if step is Step.YIELD and batch.round is not None:
                # The rank's position in the order may have moved: the dispatcher forgets
                # the rounds every rank has yielded.
                self._progressed()
            if step is Step.YIELD or step is Step.PASS:
                return batch
            if step is Step.DROP:
                self.dropped_rows += rows_in(batch)
                self._progressed()
            elif step is Step.DONE:
                self._advance()
                return EPOCH_END
            elif buffer:
                batch = buffer.popleft()
                ration.push(batch)
                self._record_completed([(batch.epoch, s) for s in batch.completes])
                self._changed.notify_all()
            elif not ration.ended and self._ended(epoch):
                ration.end()
                self._progressed()
            else:
                return None

    def _progressed(self) -> None:
        """For a job read by ranks, what this rank received (or dropped) may have changed:
        the follower tells the dispatcher. Called with the lock held."""
        if self._consumers > 1:
            self._wake.set()

    def _complete(self, done: List[Tuple[int, int]]) -> None:
        """The caller took the last batch of these (epoch, split)s."""
        with self._lock:
            self._record_completed(done)

    def _record_completed(self, done: List[Tuple[int, int]]) -> None:
        """These (epoch, split)s' last batches were taken (or, for a job read by ranks,
        arrived): acknowledged as done (unless a rejoin told the dispatcher already), and their
        rows are no longer held from any worker nor kept for a rejoin. Called with the lock
        held. A rank keeps holding them until the epoch is finished: the split is done only
        once every rank acknowledged it, and if its worker dies before, it is produced again
        without the rows any rank holds."""
        if not done:
            return
        if self._consumers <= 1:
            for held in self._held.values():
                for key in done:
                    held.pop(key, None)
            self._received.taken(done)
        done = self._received.unreported(done)
        if done:
            self._completed.extend(done)
            self._wake.set()

    def _saw_open_epoch(self, epoch: int) -> None:
        """The job's open epoch is `epoch` (or later already): what was kept of the epochs
        before it for a rejoin goes, and for a job read by ranks the rows held of them too:
        all their splits are done. Called with the lock held."""
        if epoch <= self.open_epoch:
            return
        self.open_epoch = epoch
        self._received.saw_open_epoch(epoch)
        if self._consumers > 1:
            for held in self._held.values():
                for key in [k for k in held if k[0] < epoch]:
                    del held[key]
            self._progressed()
        self._changed.notify_all()


class _Followed:
    """The client as its dispatcher follower sees it (`_dispatcher.Followed`): the follower
    starts and stops streams into the client and reports what the client measured and received."""

    def __init__(self, client):
        self._client = client
        self.wake = client._wake

    @property
    def metadata(self):
        return self._client._metadata

    def closed(self) -> bool:
        return self._client._closed.is_set()

    def wait_closed(self, timeout: float) -> bool:
        return self._client._closed.wait(timeout)

    def add_channel(self, channel: grpc.Channel) -> None:
        with self._client._lock:
            self._client._channels.append(channel)

    def add_call(self, call) -> None:
        with self._client._lock:
            self._client._calls.append(call)

    def on_close(self, leave) -> None:
        self._client._on_close = leave

    def tls_problem(self, e) -> Optional[str]:
        return self._client._tls.problem(e)

    def plaintext_refused(self, e) -> Optional[str]:
        return self._client._tls.plaintext_refused(e)

    def set_tls_name(self, name: str) -> None:
        """The name listed workers' certificates are for ("" for plaintext workers)."""
        with self._client._lock:
            self._client._tls_name = name

    def stream_as(self, job: str) -> None:
        with self._client._lock:
            self._client._stream_job = job

    def follow(self, addresses: Iterable[str], epoch: int) -> List[_wire.Held]:
        client = self._client
        listed = dict.fromkeys(addresses)
        with client._changed:
            client._listed = listed
            gone = [pump for (worker, _), pump in client._pumps.items() if worker not in listed]
            for pump in gone:
                pump.stop.set()
                if pump.call is not None:
                    pump.call.cancel()
            client._changed.notify_all()
        # Once their threads are out, everything a dropped worker buffered is recorded.
        deadline = time.monotonic() + STOP_TIMEOUT
        for pump in gone:
            pump.thread.join(max(0.0, deadline - time.monotonic()))
        held = []
        with client._changed:
            # Including workers whose streams had already ended on their own.
            for worker in [w for w in client._held if w not in listed]:
                for (e, split), positions in sorted(client._held.pop(worker).items()):
                    if positions:
                        held.append(_wire.Held(e, split, sorted(positions)))
            for worker in [w for w in client._delivering if w not in listed]:
                client._delivering.discard(worker)
            client._saw_open_epoch(epoch)
            if client._current is None:
                # The first list: reading starts at the job's open epoch (a resumed run's is
                # the state's), where the caller has had nothing yet or what the state says.
                client._current = max(epoch, client._start_epoch or 0)
                resume = client._resume
                resumed = resume is not None and resume["epoch"] == client._current
                client._yielded = Yielded.resumed(resume) if resumed else Yielded(client._current)
                client._open_through = client._current + (1 if client._prefetch_next_epoch else 0)
            client._ensure_streams()
            client._changed.notify_all()
        return held

    def take_report(self) -> Tuple[WindowStats, int]:
        client = self._client
        window = client._meter.window()
        client._meter.reset()
        with client._lock:
            workers = len(client._delivering)
        return window, workers

    def rejoin(self, incarnation: int, clients: int) -> _wire.Rejoin:
        client = self._client
        with client._lock:
            # Completions waiting to be acknowledged arrived: the rejoin tells them.
            client._completed = []
            return client._received.rejoin(incarnation, clients)

    def take_completed(self) -> List[Tuple[int, int]]:
        client = self._client
        with client._lock:
            completed, client._completed = client._completed, []
        return completed

    def restore_completed(self, completed: List[Tuple[int, int]]) -> None:
        with self._client._lock:
            self._client._completed.extend(completed)

    def saw_epoch(self, epoch: int) -> None:
        client = self._client
        with client._changed:
            client._saw_open_epoch(epoch)

    def set_quotas(self, quotas: List[_wire.EpochQuota]) -> None:
        client = self._client
        if client._consumers <= 1 or not quotas:
            return
        with client._changed:
            for quota in quotas:
                client._quotas[quota.epoch] = quota
                ration = client._rations.get(quota.epoch)
                if ration is not None:
                    ration.set_quota(quota.batches, quota.complete, quota.order)
            client._changed.notify_all()

    def rank_progress(self) -> List[_wire.RankProgress]:
        client = self._client
        if client._consumers <= 1:
            return []
        with client._lock:
            if client._current is None:
                return []
            current = client._current
            epochs = sorted({e for e in client._rations if e < current} | set(range(current, client._open_through + 1)))
            progress = []
            for epoch in epochs:
                # An epoch nothing of which arrived yet has no ration: an empty one says so.
                ration = client._rations.get(epoch, Ration())
                # An epoch before the one read is over. The rounds are copied: the follower
                # compares what it sends with what it sent last.
                ended = epoch < current or client._ended(epoch)
                progress.append(_wire.RankProgress(epoch, ration.received, ended, ration.dropped_rows,
                                                   dict(ration.rounds), ration.position))
            return progress
