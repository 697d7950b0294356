"""torch DDP's buffer synchronization API on fusedist's wrapper: ``_sync_buffers()``,
``_register_buffer_comm_hook`` and the names such a hook calls back (``named_module_buffers``,
``modules_buffers``, ``_default_broadcast_coalesced``).

Note [a buffer communication hook]
    torch's DDP broadcasts rank 0's buffers at a forward (Note [when buffers are broadcast] in
    buffer_broadcast.py) unless ``model._register_buffer_comm_hook(state, hook, location)`` gave
    it a hook: then, at the forwards that would broadcast, it calls ``hook(state,
    named_buffers)`` instead -- before the module runs (``_BufferCommHookLocation.PRE_FORWARD``)
    or after it (``POST_FORWARD``, torch's default) -- with ``{name: buffer}`` of the buffers DDP
    synchronizes (names in the module, rank-local ones left out), so a counter can be summed or
    statistics averaged instead of copied from rank 0. The same here. A hook may return futures
    (``dist.all_reduce(..., async_op=True).get_future()``): waited for at the end of the backward,
    as torch waits for them (Note [a buffer hook's futures] in buffer_futures.py). ``model._sync_buffers()``
    is torch's way to run that synchronization now, outside a forward (a collective: every rank
    calls it). Not under ``join()``, where a joined rank cannot run the user's hook: refused there.
    A deep copy or a loaded pickle of the model keeps the hook and its state, as torch's keep them
    (Note [what a copy keeps] in copies.py).
"""

from __future__ import annotations

import torch
from torch.nn.parallel.distributed import _BufferCommHook, _BufferCommHookLocation

from .buffer_futures import PendingBufferFutures
from .comm_hook import hook_name
from .prepared import output_nodes

__all__ = ["BufferCommHooks"]


class BufferCommHooks:
    """A mixin of the wrapper, beside :class:`~fusedist.ddp.buffer_broadcast.BufferBroadcast`
    (whose ``_module_buffers`` and ``_broadcast_coalesced`` it uses)."""

    @property
    def named_module_buffers(self) -> dict:
        """torch's: ``{name: buffer}`` of the buffers DDP synchronizes (rank-local ones left out)."""
        return dict(self.synced_buffers())

    @property
    def modules_buffers(self) -> list:
        """torch's: the buffers DDP synchronizes."""
        return [b for _, b in self.synced_buffers()]

    def _register_buffer_comm_hook(self, state, hook, comm_hook_location=_BufferCommHookLocation.POST_FORWARD):
        """torch's (private): ``hook(state, {name: buffer})`` synchronizes the buffers instead of the
        broadcast from rank 0, before or after the module's forward (Note [a buffer communication hook])."""
        if not callable(hook):
            raise TypeError(f"fusedist.DistributedDataParallel._register_buffer_comm_hook (rank {self.rank}): "
                            f"the hook must be callable, got {type(hook).__name__}")
        if not isinstance(comm_hook_location, _BufferCommHookLocation):
            raise TypeError(
                f"fusedist.DistributedDataParallel._register_buffer_comm_hook (rank {self.rank}): comm_hook_location "
                "must be torch.nn.parallel.distributed._BufferCommHookLocation.PRE_FORWARD or POST_FORWARD, got "
                f"{comm_hook_location!r}")
        self.buffer_hook = _BufferCommHook(buffer_comm_hook=hook, buffer_comm_hook_state=state,
                                           buffer_comm_hook_location=comm_hook_location)

    _buffer_hook_due = False  # the forward running now ends with the buffer hook (POST_FORWARD)
    _buffer_futures = None  # a POST_FORWARD hook's futures, waited for at the end of the backward

    def _sync_buffers_at_forward(self, buffers: list) -> None:
        """A forward that synchronizes ``buffers`` (the module's, not empty) begins: broadcast them, run
        a PRE_FORWARD hook, or have a POST_FORWARD one run after the module (:meth:`_buffer_hook_after_forward`)."""
        hook = self.__dict__.get("buffer_hook")
        if hook is None:
            self._broadcast_coalesced(buffers, tag="ddp buffers")
        elif hook.buffer_comm_hook_location == _BufferCommHookLocation.POST_FORWARD:
            self._buffer_hook_due = True
        else:
            self._run_buffer_hook(hook)

    @torch.compiler.disable
    def _buffer_hook_after_forward(self, out=None) -> None:
        """Run the POST_FORWARD hook; its futures are waited for at the end of a backward through the
        training forward's output ``out`` (None: no backward follows, waited for now)."""
        if self._buffer_hook_due:
            self._buffer_hook_due = False
            nodes = output_nodes(out) if out is not None else []
            self._run_buffer_hook(self.__dict__["buffer_hook"], nodes)

    def _run_buffer_hook(self, hook, nodes=()) -> None:
        """``hook`` now; its futures waited for at the end of a backward through ``nodes``, or now (Note [a
        buffer hook's futures] in buffer_futures.py)."""
        self._wait_for_buffer_futures()  # (an earlier run's, before the hook touches the buffers again)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(self.modules_buffers)):
            futures = hook.buffer_comm_hook(hook.buffer_comm_hook_state, self.named_module_buffers)
        if futures is None:
            return
        pending = PendingBufferFutures(futures, hook_name(hook.buffer_comm_hook), self.rank, self.comm.timeout)
        if nodes:
            self._buffer_futures = pending
            pending.wait_at_the_end_of_backwards_through(nodes)
        else:
            pending.wait()

    def _wait_for_buffer_futures(self) -> None:
        """Wait for a buffer hook's futures still pending (before a forward, a copy, the next hook run)."""
        pending = self._buffer_futures
        if pending is not None:
            self._buffer_futures = None
            pending.wait()

    def _refuse_buffer_hook_in_join(self) -> None:
        if "buffer_hook" in self.__dict__:
            raise RuntimeError(
                f"fusedist.DistributedDataParallel (rank {self.rank}): a buffer communication hook "
                "(_register_buffer_comm_hook) does not run inside join(), where ranks that ran out of inputs "
                "cannot call it; run the uneven inputs without the hook, or give every rank the same number of "
                "batches")

    def _sync_buffers(self) -> None:
        """torch's: synchronize the buffers now -- the buffer hook, or the broadcast from rank 0. A
        collective: every rank calls it (Note [a buffer communication hook])."""
        if self._join_config.enable:
            raise RuntimeError(
                f"fusedist.DistributedDataParallel._sync_buffers (rank {self.rank}): not inside a join() context, "
                "where ranks that ran out of inputs cannot take part; call it after the context ends")
        self.reducer.tracker.find_inserted()
        hook = self.__dict__.get("buffer_hook")
        self._wait_for_buffer_futures()
        if hook is None:
            self._default_broadcast_coalesced()
        else:
            self._run_buffer_hook(hook)

    def _default_broadcast_coalesced(self, bufs=None, bucket_size=None, authoritative_rank: int = 0) -> None:
        """torch's: broadcast ``bufs`` (default: the buffers DDP synchronizes) from
        ``authoritative_rank``; ``bucket_size`` is torch's coalescing size (each dtype goes in one
        message here)."""
        tensors = self._module_buffers() if bufs is None else list(bufs)
        if tensors:
            self._broadcast_coalesced(tensors, tag="ddp buffers", src=authoritative_rank)
