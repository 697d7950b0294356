"""The futures a buffer communication hook returns, waited for where torch's DDP waits for them.

Note [a buffer hook's futures]
    A buffer communication hook (Note [a buffer communication hook] in buffer_hook.py) may return futures
    (``dist.all_reduce(buffer, async_op=True).get_future()``). torch's DDP installs them in its reducer and
    waits for them at the end of the backward, so the buffers' communication overlaps the backward's
    compute -- the reason its documentation gives for returning futures from a hook run after the forward
    (``POST_FORWARD``). fusedist waited for them as the hook returned: the backward began only once the
    buffers had arrived. Now the futures of a ``POST_FORWARD`` hook of a training forward are waited for at
    the end of the backward that passes through that forward's outputs (queued by the outputs' autograd
    nodes, after the gradient reduction's own end), and those still pending -- no backward came, or one that
    did not pass through the outputs -- before the next forward, before the hook runs again and before
    ``_sync_buffers()``: the buffers hold their synchronized values by the end of the backward, as torch
    guarantees, and never later than the next forward. A hook run where no backward follows (a forward
    without gradients, a compiled wrapper's) and a ``PRE_FORWARD`` hook, whose buffers the module reads right
    after, are waited for as they return, as ``_sync_buffers()`` is. Every wait is bounded by the collective
    timeout (``FUSEDIST_TIMEOUT_S``): a future that never completes raises, naming the hook and the rank.
"""

from __future__ import annotations

import datetime
import threading

import torch
from torch.autograd import Variable

from ..comm.base import CollectiveError


class PendingBufferFutures:
    """A buffer hook's futures, until one bounded wait (Note [a buffer hook's futures])."""

    def __init__(self, futures, hook_name: str, rank: int, timeout: datetime.timedelta):
        self.futures = list(futures)
        self.hook_name, self.rank, self.timeout = hook_name, rank, timeout
        self.waited = False
        self._queued = False
        self._left = len(self.futures)
        self._lock = threading.Lock()
        self._done = threading.Event()
        if not self.futures:
            self._done.set()
        for future in self.futures:
            future.add_done_callback(self._one_done)

    def _one_done(self, _future) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self._done.set()

    def wait(self) -> None:
        """Block until every future completed, at most the collective timeout; raise what one raised."""
        if self.waited:
            return
        self.waited = True
        if not self._done.wait(self.timeout.total_seconds()):
            raise CollectiveError(
                f"fusedist.DistributedDataParallel (rank {self.rank}): the futures of the buffer communication hook "
                f"{self.hook_name} did not complete within {self.timeout.total_seconds():g} s (FUSEDIST_TIMEOUT_S): "
                "a rank may have stopped or skipped this forward, or the hook returns a future nobody completes",
                op="buffer hook", tag="ddp buffers", rank=self.rank)
        for future in self.futures:
            try:
                future.wait()  # completed: returns at once (on CUDA, orders the current stream)
            except Exception as exc:  # noqa: BLE001 - whatever the hook's collectives raised
                raise CollectiveError(
                    f"fusedist.DistributedDataParallel (rank {self.rank}): the buffer communication hook "
                    f"{self.hook_name} failed: {exc}", op="buffer hook", tag="ddp buffers", rank=self.rank) from exc

    def wait_at_the_end_of_backwards_through(self, nodes) -> None:
        """Wait at the end of the first backward that passes through one of the autograd ``nodes`` (queued
        after the callbacks their earlier hooks queued: the gradient reduction's end)."""

        def queue_wait(_grad_outputs):
            if not self._queued and not self.waited:
                self._queued = True
                Variable._execution_engine.queue_callback(self._wait_in_backward)

        for node in nodes:
            node.register_prehook(queue_wait)

    @torch.compiler.disable
    def _wait_in_backward(self) -> None:
        self.wait()
