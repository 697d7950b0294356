"""Communicator implemented on ``torch.distributed`` (gloo on CPU, torch's NCCL on GPU).

On gloo, reduce-scatter, all-gather, broadcast, gather and all-to-all of CPU tensors (and small
all-reduces) go through the point-to-point exchange of :mod:`.gloo_exchange`
(``FUSEDIST_GLOO_COLLECTIVES=builtin`` keeps gloo's own). gloo's own all-reduces of CPU tensors compare
the ranks' parts (:mod:`.part_agreement`).
"""

from __future__ import annotations

import datetime
import functools
import itertools
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from .._dtypes import real_pairs
from . import aborted_groups, given_up_exit, gloo_builtin_closed, gloo_exchange
from . import part_agreement, released_group
from .part_agreement import AgreedAllReduce
from .base import CollectiveError, CommHandle, Communicator
from .checks import _row_numel, _tag
from .closed_connections import ClosedConnections, closed_by_peer
from .group_ranks import global_ranks

#: All-reduces up to this size go through the gloo exchange when their result does not depend
#: on the summation order (Note [small all-reduces through the exchange]).
SMALL_ALL_REDUCE_BYTES = 256

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
# torch >= 2.12 renamed the flat-tensor collectives; older releases only have the old names.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _SequenceCounter:
    """``itertools.count`` that remembers the number it handed out last: the exchange derives
    its message tags from the sequence number of the collective being launched."""

    def __init__(self):
        self._count = itertools.count()
        self.last = -1

    def __iter__(self):
        return self

    def __next__(self) -> int:
        self.last = next(self._count)
        return self.last


class TorchCommunicator(Communicator):
    name = "torch"

    def __init__(self, process_group=None, timeout: Optional[datetime.timedelta] = None,
                 gloo_collectives: Optional[str] = None):
        """``gloo_collectives``: ``"p2p"`` or ``"builtin"`` reduce-scatter / all-gather for CPU
        tensors on gloo; None reads ``FUSEDIST_GLOO_COLLECTIVES`` (default p2p)."""
        if not dist.is_initialized():
            raise RuntimeError(
                "fusedist: torch.distributed is not initialized; call fusedist.init_distributed() "
                "(under torchrun) or torch.distributed.init_process_group() first"
            )
        self.group = process_group
        #: The group object itself (the default group resolved): what "destroyed" is asked of.
        self._group_obj = process_group if process_group is not None else dist.group.WORLD
        #: Whether it serves the default group (for messages, also once ``release()`` dropped the group) and whether
        #: it was released (Note [a released communicator lets go of its group] in released_group.py).
        self._on_default_group, self.released = process_group is None, False
        #: Its collectives launched with ``async_op=True`` whose handles still hold the group (Note [a finished
        #: collective never waited for] in released_group.py).
        self._holding_group: "weakref.WeakSet" = weakref.WeakSet()
        super().__init__(dist.get_rank(process_group), dist.get_world_size(process_group), timeout)
        self.backend = dist.get_backend(process_group)
        self._seq = _SequenceCounter()
        self._launching_async = False
        #: Whether synchronous gloo all-reduces agree on their parts first (Note [parts agreed before gloo's own
        #: all-reduce] in part_agreement.py).
        self.agree_parts = part_agreement.enabled()
        #: The first of gloo's own collectives whose wait failed, and why (Note [no collectives after
        #: a failed builtin collective]); None while none did.
        self.builtin_failure: Optional[str] = None
        #: (op, tag, seq) of the collective whose failure gave this communicator up, once one did (Note
        #: [refusing collectives of a given-up communicator]).
        self._stopped_at: Optional[tuple] = None
        #: What the observer made of that failure (a StallError with its report), if anything.
        self._stopped_reported: Optional[BaseException] = None
        #: Point-to-point reduce-scatter / all-gather for CPU tensors on gloo (None: builtin).
        self.exchange = None
        #: The first failure of any communicator of this group (Note [one failure per process group]).
        self._group_failed = _GROUP_FAILURES.setdefault(self._group_obj, _GroupFailure())
        mode = gloo_exchange.mode_from_env() if gloo_collectives is None else gloo_collectives
        if mode not in gloo_exchange.MODES:
            raise ValueError(f"gloo_collectives must be one of {gloo_exchange.MODES} or None, got {mode!r}")
        # (an abort of this process's is over: Note [an abort told to waits in the store] in aborted_groups.py)
        aborted_groups.withdraw_record()
        #: This rank's failure for its peers, a peer's for this rank (Note [connections a peer closed]).
        self._closing: Optional[ClosedConnections] = None
        if "gloo" in str(self.backend) and mode == "p2p":
            self.exchange = gloo_exchange.GlooExchange(process_group, self.rank, self.world_size, self.timeout)
            self.exchange.on_failure = self._group_failed.record  # Note [one failure per process group]
            self._timeout_changed()  # (bounded by the group's own timeout too)
            self._closing = self.exchange._closing
        elif "gloo" in str(self.backend):
            global_rank = (global_ranks(self) or range(self.world_size))[self.rank]
            self._closing = ClosedConnections(self._group_obj, global_rank)
        released_group.track(self)  # Note [a communicator built directly] in released_group.py

    # Note [the exchange ends at the group's timeout]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # The exchange stands in for gloo's own collectives, which end at the process group's timeout
    # whatever fusedist's is; so does each exchange. Before, it waited with fusedist's timeout
    # only (FUSEDIST_TIMEOUT_S, 600 s by default): in a job whose group was made with
    # ``init_process_group(timeout=30 s)``, ranks that diverged into two exchange collectives that
    # can never pair (one rank caught an error and went on to another) stayed blocked for ten
    # minutes, where with gloo's own collectives both fail at 30 s. The error names the group's
    # timeout as the cause (Note [one deadline per collective] in base.py).
    def _timeout_changed(self) -> None:
        # The exchange counts each collective's deadline from its own copy: a timeout set on the
        # communicator after it was made (longer ones included) bounds the exchange's collectives too.
        exchange = getattr(self, "exchange", None)  # (None while __init__ has not made it yet)
        if exchange is not None:
            group = self._group_timeout()
            exchange.timeout_s = min(self.timeout.total_seconds(), group if group is not None else float("inf"))

    def _group_timeout(self) -> Optional[float]:
        """The process group's own timeout in seconds (gloo's), or None where it cannot be read."""
        if "gloo" not in str(self.backend) or self.released:
            return None
        try:
            return self._group_obj._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        except Exception:  # noqa: BLE001 - internals moved: fusedist's timeout alone
            return None

    def _launch(self, op, tag, async_op, start, label=None, part=None, variant=None):
        self._check_group_alive(op, tag)
        if self.aborted:
            raise self._refusal(op, tag)
        self._launching_async = async_op  # (read by _all_reduce: Note [parts agreed before gloo's own all-reduce])
        handle = super()._launch(op, tag, async_op, start, label, part, variant)
        if handle._group is not None:
            self._holding_group.add(handle)
        return handle

    # Note [refusing collectives of a given-up communicator]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Once a collective of this group failed -- an exchange (Note [no collectives after a failed
    # exchange] in gloo_exchange.py), one of gloo's own (Note [no collectives after a failed builtin
    # collective]) or a wait the divergence probe ended (Note [divergence probe] in
    # fusedist/reliability/divergence.py) -- every later launch is refused, all three alike: passed
    # through the observer, so where a monitor watches the refusal is a StallError with the report, as
    # the failure was. (Before, only the builtin path went through it; the other two were a bare
    # CollectiveError under DDP.) A caller may launch again before raising the failure it found: DDP
    # finishes buckets during backward and raises a failed one's error at the end of backward, after
    # launching its step check -- so the refusal may be the first error the user sees.
    # The refused collective was never launched and has no sequence number: the error names it by op
    # and tag (``seq`` -1), and the report's "waiting_on" names the collective this rank stopped at --
    # the one whose failure gave the group up, else the last one launched -- a number it used, which
    # the other ranks' entries and the divergence probe can be compared with. (Before, the refusal was
    # numbered ``last_seq + 1``, a collective that never existed.) Where the observer already reported
    # that failure, the refusal carries the same report (a StallError of the observer's type) without
    # publishing again: a second entry would overwrite the first in the store, and the peers' reports
    # built later would read where this rank went after catching the error, not where it stopped.
    def _refusal(self, op: str, tag: str) -> BaseException:
        """The error refusing ``op`` (tag ``tag``) on a given-up communicator, through the observer."""
        refused = CollectiveError(
            f"fusedist: refused on rank {self.rank} of {self.world_size}{self._global_note([self.rank])}: "
            f"{op}{_tag(tag)} was not launched: this process group can no longer run collectives, because an "
            f"earlier one failed ({self.abort_reason}); gloo closes its connection to a peer after a failed "
            "transfer, and the ranks are out of step. Destroy and re-create the process group on every rank "
            "(torch.distributed.destroy_process_group() + init_process_group(), or a new "
            "torch.distributed.new_group()), or restart the job (torchrun --max-restarts)",
            op=op, tag=tag, rank=self.rank)
        at_op, at_tag, at_seq = self._stopped_at or (self.last_op, self.last_tag, self.last_seq)
        earlier = self._stopped_reported
        if getattr(earlier, "report", None) is not None:
            # The observer reported the failure that gave the group up: its report, not a new one. A new
            # one would replace this rank's entry in the store -- where it stopped, and in what (inside
            # check_consistency()) -- with where the program went after catching the error.
            return type(earlier)(f"{refused}\n{earlier.report}", report=earlier.report, cause=refused,
                                 op=at_op, tag=at_tag, rank=self.rank, seq=at_seq)
        stopped = CommHandle(self, None, op=at_op, tag=at_tag, seq=at_seq, timeout=self.timeout)
        return self._on_failure(stopped, refused) or refused

    @property
    def aborted(self) -> bool:
        if (self.gave_up is not None or self.builtin_failure is not None
                or (self.exchange is not None and self.exchange.failure() is not None)):
            if self._group_failed.reason is None:  # (the first failure of the group: the others learn it)
                self._group_failed.reason = self._own_failure()
            return True
        return self._group_failed.reason is not None

    @property
    def abort_reason(self) -> str:
        own = self._own_failure()
        if own or self._group_failed.reason is None:
            return own
        return (f"{self._group_failed.reason}, in another communicator of this process group, whose gloo "
                "connections this one shares")

    def _own_failure(self) -> str:
        failed = self.exchange.failure() if self.exchange is not None else None
        return failed or self.builtin_failure or self.gave_up or ""

    # Note [no collectives after a failed builtin collective]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # What Note [no collectives after a failed exchange] (gloo_exchange.py) says of the exchange
    # holds for gloo's own collectives too (all-reduces over SMALL_ALL_REDUCE_BYTES -- a DDP
    # bucket --, and every collective under FUSEDIST_GLOO_COLLECTIVES=builtin): when a wait for one
    # fails -- its deadline passed, or gloo closed the connection to a peer -- gloo has closed that
    # connection (or, where fusedist's deadline came first, the communicator closes it: Note [closing the
    # connections of an abandoned collective]), and the ranks no
    # longer agree on which collective comes next. Before, nothing recorded it: the next collective
    # failed with gloo's bare "pair closure" or waited out its deadline, and the exit paths for a
    # given-up communicator did not apply (Note [ending after given-up collectives]), so a process
    # with probe off ended through the interpreter's shutdown, waiting on gloo's threads. So the
    # first such failure is recorded here, where the handle reports it -- on the failure path only:
    # a successful wait costs nothing more --, later launches are refused naming it, and the exit
    # paths apply. A wait that ran out before the collective's deadline (``wait(timeout)`` shorter
    # than the communicator's, a slice of a probed wait) is not a failure: the collective goes on.
    # The failure is also left in the store, before any connection is closed here, for a peer that
    # finds its connection to this rank closed (Note [connections a peer closed] in closed_connections.py):
    # its error said this rank "left no error: its process may have ended" while it lived.
    def _on_failure(self, handle, error: BaseException) -> Optional[BaseException]:
        work = handle._work
        # (parts that differed fail on every rank alike: the ranks are still in step)
        if (work is not None and "gloo" in str(self.backend) and not isinstance(work, gloo_exchange.ExchangeWork)
                and not getattr(work, "mismatched", False)):
            if not self.aborted:  # Note [a peer gone under gloo's own collective] in gloo_builtin_closed.py
                error = gloo_builtin_closed.explained(self, handle, error, close_connections) or error
            # The first failure, or the wait the divergence probe ended (which gave the communicator up first)
            abandoned = not self.aborted or (self.gave_up is not None and self._stopped_at is None)
            if not self.aborted:
                self.builtin_failure = str(error).removeprefix("fusedist: ")  # (it names the collective)
                if self._closing is not None:  # (for a peer that finds the connection closed: before closing it)
                    self._closing.publish(self.builtin_failure)
                # (a program that catches the error and ends by sys.exit(n) ends at once, with n)
                given_up_exit.watch_exit_requests()
            if abandoned and not work.is_completed():  # Note [closing the connections of an abandoned collective]
                self._close_connections()
        first = self.aborted and self._stopped_at is None  # (Note [refusing collectives of a given-up communicator])
        if first:
            named = isinstance(error, CollectiveError) and error.seq >= 0
            self._stopped_at = (error.op, error.tag, error.seq) if named else (handle.op, handle.tag, handle.seq)
        reported = super()._on_failure(handle, error)
        if first:
            self._stopped_reported = reported
        return reported or error  # (the error told again where the peer that closed it was named)

    # Note [closing the connections of an abandoned collective]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # fusedist's timeout may be shorter than the process group's (FUSEDIST_TIMEOUT_S, a communicator's
    # ``timeout``). When a wait for one of gloo's own collectives fails at fusedist's deadline, gloo keeps
    # the collective queued until the group's timeout, and a peer that arrives late pairs with it: its
    # all-reduce returned "successfully" with whatever this rank's buffer held by then (a buffer the
    # program, told the collective failed, had already reused), and that buffer was overwritten with the
    # result after the error had been raised. With torch's own timeout the late peer gets an error (gloo
    # closes the connections when its collective times out), and so does a late peer of a failed exchange
    # (a receive whose wait times out closes them). So the collective abandoned at fusedist's deadline
    # closes them too: a receive no peer will ever send, waited for a millisecond, which gloo answers by
    # closing the group's connections. The abandoned collective then fails at once without touching the
    # buffer again, and a late peer's collective fails with gloo's "Connection closed by peer" instead of
    # pairing with it. (Once, at the failure; the group refuses collectives from then on anyway.) A wait the
    # divergence probe ended abandons its collective too: before, gloo kept it until the group's timeout, and
    # ``destroy_process_group()`` -- what the refusal tells a program that caught the error to do -- blocked
    # until then.
    def _sliced_waits(self, work, async_op: bool) -> bool:
        # gloo's own works wait on a condition (a slice that runs out leaves them running); an
        # exchange is sliced only once its progress thread drives it (a synchronous one is driven
        # by its caller, with one deadline: Note [exchange progress] in exchange_progress.py).
        # A synchronous all-reduce whose parts are agreed first neither (Note [parts agreed before gloo's own
        # all-reduce] in part_agreement.py). Those two are probed from a watcher thread instead
        # (``_watched_waits``: Note [probing waits that cannot be sliced] in watched_wait.py).
        work = work.work if isinstance(work, _GlooReduceScatter) else work
        if isinstance(work, AgreedAllReduce):
            return work.launched_first
        return "gloo" in str(self.backend) and (async_op or not isinstance(work, gloo_exchange.ExchangeWork))

    def _watched_waits(self, work) -> bool:
        # (Note [probing waits that cannot be sliced] in watched_wait.py: a synchronous exchange, a synchronous
        # all-reduce whose parts are agreed first, gloo's own reduce-scatter made of one)
        work = work.work if isinstance(work, _GlooReduceScatter) else work
        return "gloo" in str(self.backend) and isinstance(work, (gloo_exchange.ExchangeWork, AgreedAllReduce))

    def _end_watched_wait(self, work, verdict: str) -> bool:
        if work.is_completed():
            return False
        if isinstance(work, gloo_exchange.ExchangeWork):
            work.ended_by = verdict  # (what its error, and the entry its peers read, say)
        self._close_connections()
        return True

    def _close_connections(self) -> None:
        """Close the group's connections (Note [closing the connections of an abandoned collective]); once released,
        only while something else still holds the group (Note [a released communicator lets go of its group])."""
        group = released_group.held_elsewhere(self) if self.released else self._group_obj
        if group is not None:
            close_connections(group, self.rank, self.world_size)

    def _group_while_in_flight(self):
        return self._group_obj

    def release(self, join_timeout: Optional[float] = None) -> None:
        try:
            super().release(join_timeout)
        finally:  # Note [a released communicator lets go of its group] in released_group.py
            released_group.let_go(self)

    def _check_group_alive(self, op: str, tag: str) -> None:
        """Refuse a collective on a process group torch.distributed destroyed or aborted, as its own collectives do
        (released or not yet: Note [a released communicator lets go of its group])."""
        if self.released or not released_group.is_alive(self._group_obj):
            raise released_group.refused_error(
                op, tag, self.rank, self.world_size, self._on_default_group,
                aborted=getattr(self, "ended_by_abort", None),  # (Note [a refusal names the abort] there)
                failed_before=self.abort_reason if self.aborted else None)

    def _ended_under_collective(self) -> str:
        if self.released or not released_group.is_alive(self._group_obj):
            return released_group.ended_under_collective(self._on_default_group)
        return ""

    @property
    def device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _all_reduce(self, tensor, op):
        return self._reduce(tensor, op, agree=self.agree_parts)

    def _all_reduce_checked(self, tensor, op):
        # no fingerprints: the caller checked the parts (Note [parts a caller checked] in base.py)
        return self._reduce(tensor, op, agree=False)

    def _barrier(self, token):
        # Never paired with a user's one-element all-reduce (base.py's barrier): on the exchange its messages
        # have a label of their own; gloo's own barrier has its own slots.
        if self.exchange is not None and token.device.type == "cpu":
            return self.exchange.all_reduce(token, "sum", seq=self._seq.last, label=gloo_exchange.BARRIER_LABEL)
        if "gloo" in str(self.backend) and token.device.type == "cpu":
            from .barrier_closed import torch_barrier  # (torch's own: this handle tells its failure)

            return torch_barrier()(group=self.group, async_op=True)
        return self._all_reduce(token, "sum")

    def _reduce(self, tensor, op, agree: bool):
        if self._small_all_reduce(tensor, op):
            # Labelled by size and op, not tag: all-reduces of one size pair whatever their tags, as
            # on gloo's own (a joined rank's shadow of an active rank's all-reduce has another tag);
            # with different ops they must not (each rank would fold with its own: results differ).
            return self.exchange.all_reduce(tensor, op, seq=self._seq.last,
                                            label=f"{tensor.numel()} {tensor.dtype} {op}")
        if not agree or "gloo" not in str(self.backend) or tensor.device.type != "cpu":
            return dist.all_reduce(tensor, op=_OPS[op], group=self.group, async_op=True)
        return self._gloo_all_reduce_of(op)(tensor)

    def _gloo_all_reduce_of(self, op: str, kind: str = "all_reduce"):
        """Start gloo's own all-reduce of a CPU tensor with ``op``, its parts agreed across ranks (Note [parts
        agreed before gloo's own all-reduce] in part_agreement.py) unless FUSEDIST_AGREE_PARTS=0: a function of
        the tensor. (gloo's own reduce-scatter is such an all-reduce: ranks that passed different ops each went
        on with a result folded by both; ``kind`` says which collective it serves, Note [the collective's kind
        in a fingerprint].)"""
        def start(tensor):
            launch = functools.partial(dist.all_reduce, tensor, op=_OPS[op], group=self.group, async_op=True)
            if not self.agree_parts:
                return launch()
            group = self._group_timeout()
            limit = min(self.timeout.total_seconds(), group if group is not None else float("inf"))
            return AgreedAllReduce(tensor, op, self._seq.last, self.group, self.rank, self.world_size, launch,
                                   launch_now=self._launching_async, limit_s=limit, kind=kind)
        return start

    # Note [small all-reduces through the exchange]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # gloo pairs its own collectives by issue order alone. When ranks diverge -- one skipped an
    # optimizer step or caught an exception and went on -- one rank's collective pairs with
    # another kind on the others, and when the sizes differ gloo's transport thread fails an
    # assertion ("Received data size doesn't match expected size") and terminates the whole
    # process (SIGABRT): no error, no stall report, nothing for the other ranks' reports. The
    # small all-reduces are where ranks meet at control points (the per-step check, the
    # found-inf and gradient-norm exchanges, the used-parameter map), so they are the ones
    # such a divergence pairs first. On the exchange they are tagged messages (Note [exchange
    # tags]) labelled by their size, dtype and reduce op, so all-reduces of different sizes never
    # pair: a divergence is a timeout and a StallError naming both collectives (and ranks that
    # pass different ops -- max on one, sum on another -- time out rather than each folding with
    # its own and going on with different results). (Not labelled by their
    # tags: all-reduces that must pair carry different tags -- the joined rank's shadows of
    # the active ranks' all-reduces, fusedist/ddp/join.py -- and pair here as on gloo's own
    # collectives, by order.) Each rank's tensor is gathered (one round, like the
    # builtin ring for tensors this small) and folded locally; only reductions whose result
    # does not depend on the order take this path -- max, min, integer sums, and float sums of
    # two ranks (a + b == b + a) -- so results stay bit-identical to gloo's. Except max and
    # min over a NaN: here (and in the exchange's reduce-scatter) a NaN on any rank gives NaN,
    # as torch.maximum does, where gloo's std::max keeps whichever operand comes first, so its
    # result depends on the rank order (and, with this path, it would depend on the size).
    def _small_all_reduce(self, tensor, op) -> bool:
        return (self.exchange is not None and tensor.device.type == "cpu"
                and tensor.dtype in gloo_exchange.REDUCIBLE_DTYPES
                and tensor.numel() * tensor.element_size() <= SMALL_ALL_REDUCE_BYTES
                and (op in ("max", "min")
                     or (op == "sum" and (not tensor.dtype.is_floating_point or self.world_size == 2))))

    def scratch_bytes(self) -> int:
        return self.exchange.scratch_bytes() if self.exchange is not None else 0

    def _progress_in_background(self, work) -> None:
        if isinstance(work, gloo_exchange.ExchangeWork):
            self.exchange.progress_in_background(work)

    def stop_helpers(self, join_timeout: Optional[float] = None) -> None:
        if self.exchange is not None:
            self.exchange.stop_progress_thread(join_timeout)

    def _use_exchange(self, output, input, reduces: bool) -> bool:
        # Anything else (CUDA tensors on a gloo group, dtypes the exchange does not reduce) goes
        # to torch's collectives, which support it or raise their own error.
        return (self.exchange is not None and output.device.type == "cpu" and input.device.type == "cpu"
                and (not reduces or input.dtype in gloo_exchange.REDUCIBLE_DTYPES))

    # Checked before launching, so misuse is a ValueError like the base class's shape checks
    # (a launch failure would be reported as a failed collective).
    def reduce_scatter(self, output, input, *, op: str = "sum", async_op: bool = False, tag: str = "",
                       label=None):
        if self._use_exchange(output, input, reduces=True):
            gloo_exchange.validate_reduce_op(op, input.dtype)
        return super().reduce_scatter(output, input, op=op, async_op=async_op, tag=tag, label=label)

    def _reduce_scatter(self, output, input, op):
        if self._use_exchange(output, input, reduces=True):
            return self.exchange.reduce_scatter(output, input, op, seq=self._seq.last, label=self.last_label)
        if "gloo" in str(self.backend) and output.device.type == "cpu":
            # FUSEDIST_GLOO_COLLECTIVES=builtin (or a dtype the exchange does not reduce)
            return _GlooReduceScatter(output, input, self._gloo_all_reduce_of(op, "reduce_scatter"), self.rank,
                                      self.world_size)
        return _reduce_scatter_flat(output, input, op=_OPS[op], group=self.group, async_op=True)

    def _all_gather(self, output, input):
        if self._use_exchange(output, input, reduces=False):
            return self.exchange.all_gather(output, input, seq=self._seq.last, label=self.last_label)
        return _all_gather_flat(output, input, group=self.group, async_op=True)

    def _all_to_all(self, output, input, output_splits, input_splits):
        if self._use_exchange(output, input, reduces=False):
            row = _row_numel(input)
            return self.exchange.all_to_all(output, input, [c * row for c in output_splits],
                                            [c * row for c in input_splits], seq=self._seq.last,
                                            label=self.last_label)
        return dist.all_to_all_single(output, input, output_splits, input_splits, group=self.group, async_op=True)

    def _gather(self, output, input, dst):
        if self._use_exchange(input if output is None else output, input, reduces=False):
            return self.exchange.gather(output, input, dst, seq=self._seq.last, label=self.last_label)
        global_dst = dist.get_global_rank(self.group, dst) if self.group is not None else dst
        # (any shape: flat; complex as its real pairs, which gloo's gather takes -- it refuses
        # complex dtypes, which the other collectives here carry)
        chunks = list(real_pairs(output.view(-1)).chunk(self.world_size)) if output is not None else None
        return dist.gather(real_pairs(input.view(-1)), chunks, dst=global_dst, group=self.group, async_op=True)

    def _broadcast(self, tensor, src):
        if self.exchange is not None and tensor.device.type == "cpu":
            return self.exchange.broadcast(tensor, src, seq=self._seq.last)  # Note [broadcasts through the exchange]
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        return dist.broadcast(tensor, src=global_src, group=self.group, async_op=True)

    def _wait_can_resume(self, work) -> bool:
        # A gloo work (and the gloo exchange) goes on after a wait that timed out; torch's NCCL
        # may abort there.
        return "gloo" in str(self.backend) and not work.is_completed()

    def _transport_timeout(self, work) -> Optional[float]:
        # gloo's own collectives, and the exchange, end at the process group's timeout too (Note [one
        # deadline per collective] in base.py, Note [the exchange ends at the group's timeout]).
        return self._group_timeout()

    def _wait_work(self, work, timeout: datetime.timedelta) -> None:
        # gloo honours the timeout here. torch's NCCL work given a timeout blocks the host until
        # the collective completes (a host synchronization at every wait: no overlap of the
        # buckets' collectives with backward); without one, wait() only orders the current
        # stream after the collective, and torch's watchdog enforces the process-group timeout.
        if self.backend == "nccl":
            work.wait()
        else:
            work.wait(timeout=timeout)


class _GlooReduceScatter:
    """gloo's flat reduce-scatter is an all-reduce of a copy of the input whose chunk is copied
    out in ``wait()``; its work never reports completion (``is_completed()`` stays False), so
    DDP could not finish such buckets during backward (Note [finishing buckets during
    backward] in ``fusedist/ddp/in_flight.py``). The same two steps here, with a truthful
    ``is_completed`` (and the reduce op honoured)."""

    def __init__(self, output, input, all_reduce, rank: int, world_size: int):
        self.output, self.rank, self.world_size = output, rank, world_size
        self.buffer = input.clone()  # the input stays unchanged, as reduce-scatter promises
        self.work = all_reduce(self.buffer)

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, timeout=None) -> None:
        self.work.wait(timeout=timeout)
        self.output.view(-1).copy_(self.buffer.view(-1).chunk(self.world_size)[self.rank])  # (any shapes: flat)
        self.buffer = None


# Note [one failure per process group]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Several TorchCommunicators may serve one process group (one made directly besides the one
# ``get_communicator`` caches; a fallback of the direct-NCCL communicator). They share the group's
# gloo connections, which a failed collective closes, and its order of collectives, which a failed
# collective breaks (Note [refusing collectives of a given-up communicator]). Before, each kept its
# own failure: after one gave up, the other went on launching collectives that failed with gloo's
# bare "pair closure" or waited out their timeouts. So the first failure of any of them is recorded
# for the group (keyed weakly by the group object: a destroyed group's record goes with it), and
# every communicator of the group refuses collectives from then on, naming it. Recorded when the
# failure happens: an exchange that fails in the progress thread (launched with ``async_op=True``, never
# waited for yet) tells the group at once, through ``GlooExchange.on_failure``. Before, the record was made
# only when the failing communicator's ``aborted`` was next read, so another communicator of the group
# launched on the closed connections in between.
class _GroupFailure:
    """The first failure of a process group's communicators (None while none failed)."""

    __slots__ = ("reason",)

    def __init__(self):
        self.reason: Optional[str] = None

    def record(self, reason: str) -> None:
        """Keep ``reason`` unless an earlier failure was recorded (the first one counts)."""
        if self.reason is None:
            self.reason = reason


_GROUP_FAILURES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


#: The tag of the receive that closes an abandoned collective's connections: below the exchange's tags
#: (Note [exchange tags] in exchange_tags.py), far from user point-to-point tags; never sent.
_CLOSING_TAG = (1 << 30) - 1


def close_connections(group, rank: int, world_size: int, before_closing=None) -> list:
    """Close ``group``'s gloo connections (Note [closing the connections of an abandoned collective]):
    a receive from every peer that nobody sends, waited for a millisecond -- gloo answers the timeout
    by closing them. Through the group's backend, so it works on a group torch.distributed has already
    forgotten too (Note [aborting a group closes its connections] in aborted_groups.py); ``rank`` and
    ``world_size`` are the group's. Returns the peers whose connection a peer had closed already (posting
    to them failed so: Note [a peer gone under gloo's own collective] in gloo_builtin_closed.py), after
    ``before_closing(those peers)`` ran, before the others' connections close. Never raises."""
    try:
        backend = (group if group is not None else dist.group.WORLD)._get_backend(torch.device("cpu"))
    except Exception:  # noqa: BLE001 - not a gloo group (NCCL's abort ends its own work), or gone
        return []
    works, closed = [], []
    for peer in range(world_size):
        if peer == rank:
            continue
        try:
            works.append(backend.recv([torch.empty(1)], peer, _CLOSING_TAG))
        except Exception as exc:  # noqa: BLE001 - a connection closed already
            if closed_by_peer(exc):
                closed.append(peer)
    if before_closing is not None:
        before_closing(closed)
    for work in works:
        try:
            work.wait(datetime.timedelta(milliseconds=1))
        except Exception:  # noqa: BLE001 - the timeout that closes the connections
            pass
    return closed
