"""Which peer closed the connection under torch.distributed's barrier on a gloo group, and why.

Note [a peer gone under torch's barrier]
    ``torch.distributed.barrier()`` on a gloo group whose peer aborted its groups (fusedist closes the
    connections of an aborted group its exchanges use: Note [aborting a group closes its connections] in
    aborted_groups.py) or whose process ended fails at once, but with gloo's bare "Connection closed by peer
    [address]:port": no rank, no reason. So once this process has made a gloo exchange, torch's ``barrier`` is
    wrapped (as both ``torch.distributed`` and ``distributed_c10d`` name it), and on that failure only -- a
    barrier whose peers are alive runs torch's own, nothing added, no collective more -- the wrapper asks
    which peers closed their connections as a failed gloo collective of fusedist's does (Note [a peer gone
    under gloo's own collective] in gloo_builtin_closed.py): a receive posted to each peer fails at once on a
    closed pair. It leaves a first word for its live peers, closes their connections too (the group runs no
    collective any more; a live peer still in the barrier fails at once and reads that word), and raises
    naming each closed peer with what it left in the store: that it aborted its groups (written before its
    connections closed), else its entry waited for a moment, else that it left no error (its process may
    have ended). Only the group's first failure is told so (after a failed exchange of fusedist's on the group,
    its connections may be ones this rank closed itself).

    A barrier with ``async_op=True`` returns at once and fails in its work's ``wait()`` (as promptly, with the
    same bare words), which the wrapper does not reach; torch's work takes no attribute, so the wrapper returns
    it inside a :class:`~torch.distributed.Work` of its own that hands every call to torch's and, where
    ``wait()`` fails, tells the failure as above. While the peers are alive that is one small object per
    asynchronous barrier and a call in between, nothing more. fusedist's own barrier on gloo's (a communicator
    without the exchange) calls torch's barrier itself (:func:`torch_barrier`) and keeps torch's work: its handle
    tells its failure (Note [a peer gone under gloo's own collective] in gloo_builtin_closed.py).
"""

from __future__ import annotations

import datetime
import functools
import time
import weakref

from torch.distributed import Work

from .._process_hooks import chain_module_function
from . import aborted_groups
from .base import CollectiveError
from .closed_connections import WAIT_S, closed_by_peer
from .exchange_progress import _where
from .gloo_builtin_closed import _gloo_words

_KEYS = ("name the peer that closed a barrier's connection: distributed_c10d.barrier",
         "name the peer that closed a barrier's connection: torch.distributed.barrier")


def install() -> None:
    """Wrap torch's ``barrier`` (Note [a peer gone under torch's barrier]), once; ``_process_hooks.uninstall()``
    restores torch's own."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    chain_module_function(_KEYS[0], distributed_c10d, "barrier", _wrapped)
    chain_module_function(_KEYS[1], dist, "barrier", _wrapped)


def _wrapped(original):
    @functools.wraps(original)
    def barrier(*args, **kwargs):
        group = kwargs["group"] if "group" in kwargs else (args[0] if args else None)
        try:
            work = original(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised as it was where no peer closed a connection
            told = explained(group, exc)
            if told is None:
                raise
            raise told from exc
        if not isinstance(work, Work):
            return work  # (synchronous)
        return _ExplainedWork(work, group)
    global _torch_barrier
    _torch_barrier = original
    return barrier


#: torch's own barrier, once wrapped (fusedist's own barrier calls it: its handle tells its failure)
_torch_barrier = None


def torch_barrier():
    """torch.distributed's barrier as torch defines it, without this module's wrapper."""
    if _torch_barrier is not None:
        return _torch_barrier
    from torch.distributed import distributed_c10d

    return distributed_c10d.barrier


class _ExplainedWork(Work):
    """An asynchronous barrier's work: torch's, whose failed ``wait()`` names the peers that closed their
    connections (Note [a peer gone under torch's barrier])."""

    def __init__(self, work: Work, group):
        super().__init__()
        # (weakly: a work the program keeps does not keep a destroyed group alive; None: the default group)
        self._work, self._group = work, weakref.ref(group) if group is not None else None

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        try:
            return self._work.wait(timeout)
        except Exception as exc:  # noqa: BLE001 - re-raised as it was where no peer closed a connection
            group = self._group() if self._group is not None else None
            told = explained(group, exc) if group is not None or self._group is None else None
            if told is None:
                raise
            raise told from exc

    # (the rest is torch's work's own)
    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self):
        return self._work.exception()

    def source_rank(self) -> int:
        return self._work.source_rank()

    def result(self):
        return self._work.result()

    def synchronize(self):
        return self._work.synchronize()

    def get_future(self):
        return self._work.get_future()

    def get_future_result(self):
        return self._work.get_future_result()

    def block_current_stream(self):
        return self._work.block_current_stream()


def explained(group, error: BaseException):
    """``error`` (a failed barrier on ``group``, None: the default group) told again naming the peers that closed
    their connections, and why; None where it is no closed connection, or no peer's is closed. Never raises."""
    if not closed_by_peer(error):
        return None
    try:
        return _explained(group, error)
    except Exception:  # noqa: BLE001 - gloo's own error stands where the group cannot be asked
        return None


def _explained(group, error: BaseException):
    from torch.distributed import distributed_c10d

    from .torch_comm import _GROUP_FAILURES, close_connections  # (here: torch_comm imports what imports this)

    target = group if group is not None else distributed_c10d.GroupMember.WORLD
    if target is None:
        return None
    failed = _GROUP_FAILURES.get(target)
    if failed is not None and failed.reason is not None:
        return None  # (its first failure was told; its connections may be ones this rank closed after it)
    rank, size = distributed_c10d.get_rank(target), distributed_c10d.get_world_size(target)
    job_ranks = distributed_c10d.get_process_group_ranks(target)
    this = _where(rank, job_ranks[rank])
    closing = aborted_groups.closing_of(target)

    def publish_first(closed: list) -> None:
        # (before the live connections close: a live peer finding this rank's closed reads this at once)
        if closed and closing is not None:
            named = ", ".join(_where(p, job_ranks[p]) for p in closed)
            closing.publish(f"{this}: torch.distributed's barrier lost its connection to {named}, which closed it")

    closed = close_connections(target, rank, size, publish_first)
    if not isinstance(closed, list) or not closed:
        return None
    deadline = time.monotonic() + WAIT_S  # (one wait for every closed peer's entry)
    why = "; ".join(_why_closed(closing, p, job_ranks[p], max(deadline - time.monotonic(), 0.05)) for p in closed)
    return CollectiveError(f"fusedist: torch.distributed's barrier failed on {this} of {size}: {why} "
                           f"(gloo: {_gloo_words(error)})", op="barrier", rank=rank)


def _why_closed(closing, peer: int, global_peer: int, wait_s: float) -> str:
    """Why ``peer`` closed its connection: what it left for this group's peers, else its whole process's abort
    record, else its entry waited for up to ``wait_s``."""
    where = _where(peer, global_peer)
    if closing is not None and closing.left_by(global_peer, 0.0) is not None:
        return closing.explain(where, global_peer, 0.0)
    from torch.distributed import distributed_c10d

    try:
        store = distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: nothing more to read
        store = None
    record = aborted_groups.aborted_peers(store, [global_peer]).get(global_peer) if store is not None else None
    if record is not None:
        return f"{where} closed the connection: it {record.split(' ', 2)[2]}"
    if closing is not None:
        return closing.explain(where, global_peer, wait_s)
    return (f"{where} closed the connection and left no error: its process may have ended (look at its log), or "
            "it failed without reaching the store")
