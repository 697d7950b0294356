"""Direct-NCCL communicator on the CUDA extension (``fusedist._C``).

:class:`NcclCommunicator` implements :class:`~fusedist.comm.base.Communicator` by calling NCCL
itself -- not through ``torch.distributed`` -- on a dedicated high-priority comm stream. The
process group is used once, at construction, to agree on readiness and share the NCCL unique
id; every collective afterwards goes straight to NCCL.

Stream semantics (Note [comm stream ordering] in ``csrc/cuda/comm_stream.h``): a collective
starts after everything the caller enqueued on its current stream before the call, and
``handle.wait()`` orders the caller's *current* stream after it without blocking the host.
Timeouts and NCCL's asynchronous errors are watched from a thread (Note [stream-ordered waits
and the watchdog] in ``watchdog.py``): past the timeout the rank prints the error naming the
operation, its tag and the rank, with fusedist's stall report, aborts NCCL and exits
(``FUSEDIST_NCCL_WATCHDOG=raise``: the next ``wait()`` or launch raises
:class:`~fusedist.comm.base.CollectiveError` instead). ``blocking_wait``
(``FUSEDIST_NCCL_BLOCKING_WAIT=1``) makes ``wait()`` also block the host until the collective
finished, as a debugging aid: the error is then raised by the wait of the collective that
caused it.

``get_communicator(device="cuda")`` returns one of these when the extension is built (see
:func:`make_nccl_communicator`); ``FUSEDIST_COMM=torch`` opts out.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time
import traceback
from typing import Optional

import torch
import torch.distributed as dist

from .. import _extension
from ._nccl_types import NCCL_DTYPES, nccl_dtype, nccl_op
from .base import CollectiveError, Communicator
from .nccl_setup import (NcclUnavailableError, TorchChosen, create_within_timeout, load_nccl, local_problem,
                         return_comm_stream, take_comm_stream)
from .torch_comm import TorchCommunicator
from .watchdog import CollectiveWatchdog

__all__ = ["NcclCommunicator", "NcclUnavailableError", "load_nccl", "make_nccl_communicator"]

log = logging.getLogger(__name__)


class _Work:
    """One launched collective: its done event, the tensors it must keep alive and its entry
    in the watchdog."""

    __slots__ = ("done", "op", "tensors", "watched")

    def __init__(self, done, op: str, tensors, watched):
        self.done, self.op, self.tensors, self.watched = done, op, tensors, watched

    def is_completed(self) -> bool:
        return self.done.query()


# Note [all-to-all through torch]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# NCCL has no all-to-all collective: it is a group of ncclSend / ncclRecv calls, which the
# CUDA extension does not expose. Until it does, ``all_to_all_single`` on the direct-NCCL
# communicator runs torch.distributed's on the same process group (torch's NCCL, its own
# stream and communicator): the caller's stream is ordered before it at the launch and after
# it at ``wait()``, as with this communicator's own collectives, but its timeout is the
# process group's, enforced by torch's NCCL watchdog, not fusedist's.
class _TorchWork:
    """A collective run by torch.distributed for the direct-NCCL communicator."""

    __slots__ = ("work", "op")

    def __init__(self, work, op: str):
        self.work, self.op = work, op

    def is_completed(self) -> bool:
        return self.work.is_completed()


class NcclCommunicator(Communicator):
    """Collectives through NCCL directly, on a dedicated high-priority CUDA stream.

    Args:
        process_group: the group whose ranks form the NCCL communicator (default: WORLD). It
            is used only at construction (readiness check and unique-id exchange).
        timeout: bound on each ``wait()`` (default :func:`fusedist.distributed.collective_timeout`).
        blocking_wait: ``wait()`` also blocks the host until the collective completed, so an
            error surfaces at the wait of the collective that caused it (a debugging aid; it
            costs the CPU/GPU overlap). With False (the default), ``wait()`` only orders the
            caller's stream and the watchdog enforces the timeout (Note [stream-ordered waits
            and the watchdog]). Default: ``FUSEDIST_NCCL_BLOCKING_WAIT`` (``0``).
        device: the CUDA device the communicator binds to (an index or ``torch.device``);
            default: the current device. Tensors must live there.

    Raises :class:`NcclUnavailableError` on every rank when any rank cannot run it
    (no extension, no driver, no NCCL), so all ranks take the same decision.
    """

    name = "nccl"

    def __init__(self, process_group=None, timeout: Optional[datetime.timedelta] = None, *,
                 blocking_wait: Optional[bool] = None, device=None):
        if blocking_wait is None:
            flag = os.environ.get("FUSEDIST_NCCL_BLOCKING_WAIT", "0").strip()
            if flag not in ("0", "1"):
                raise ValueError(f"FUSEDIST_NCCL_BLOCKING_WAIT must be 0 or 1, got {flag!r}")
            blocking_wait = flag == "1"
        on_failure = os.environ.get("FUSEDIST_NCCL_WATCHDOG", "exit").strip().lower()
        if on_failure not in ("exit", "raise"):
            raise ValueError(f"FUSEDIST_NCCL_WATCHDOG must be exit or raise, got {on_failure!r}")
        from . import communicator_choice

        choice = communicator_choice()
        problem = local_problem() if choice != "torch" else None
        if not dist.is_initialized():
            raise NcclUnavailableError(
                problem
                or "fusedist: torch.distributed is not initialized; call fusedist.init_distributed() "
                "(under torchrun) or torch.distributed.init_process_group() first"
            )
        self.group = process_group
        super().__init__(dist.get_rank(process_group), dist.get_world_size(process_group), timeout)
        direct = problem is None and choice != "torch"
        C = _extension.require("_C") if direct else None
        unique_id = None
        if direct and self.rank == 0:
            try:
                unique_id = C.get_unique_id()
            except RuntimeError as exc:
                problem = f"ncclGetUniqueId failed: {exc}"
        # One exchange settles every question: do the ranks ask for the same path, can every
        # rank run NCCL directly, and which id do they join? A rank that raised alone would
        # leave the others blocked in ncclCommInitRank (Note [bounded NCCL init]).
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, (choice, problem, unique_id), group=process_group)
        choices = [c for c, _, _ in gathered]
        if len(set(choices)) > 1:
            from .._consistency import RankMismatchError

            detail = ", ".join(f"rank {r}: {c}" for r, c in enumerate(choices))
            raise RankMismatchError(
                f"fusedist: FUSEDIST_COMM differs across the ranks of this process group ({detail}; "
                f"this is rank {self.rank}); set it the same on every rank (or leave it unset)")
        if choice == "torch":
            raise TorchChosen("FUSEDIST_COMM=torch on every rank")
        failures = {r: p for r, (_, p, _) in enumerate(gathered) if p}
        if failures:
            detail = "; ".join(f"rank {r}: {p}" for r, p in sorted(failures.items()))
            raise NcclUnavailableError(f"fusedist: the direct-NCCL communicator cannot run ({detail})")
        unique_id = gathered[0][2]
        self._device = _device_index(device)
        self.blocking_wait = blocking_wait
        #: What a watchdog failure does (Note [stream-ordered waits and the watchdog]): "exit"
        #: (report, abort, end the process) or "raise" (abort; the next wait or launch raises).
        self.on_watchdog_failure = on_failure
        self._comm = create_within_timeout(
            lambda: C.NcclComm(unique_id, self.world_size, self.rank, self._device),
            self.timeout.total_seconds(), f"ncclCommInitRank on rank {self.rank} of {self.world_size}")
        # Every collective of this communicator runs on its comm stream (Note [comm stream
        # ordering]); the stream outlives it (Note [comm streams live as long as the process]).
        self._stream, self.torch_stream = take_comm_stream(C, self._device)
        self.nccl_version = C.nccl_version()
        self.closed = False
        self._failure_raised = False  # the watchdog's failure reached the program
        self.watchdog = CollectiveWatchdog(self._watchdog_failed, self._poll_async_error,
                                           name=f"rank{self.rank}-cuda{self._device}",
                                           crashed_peer=self._crashed_peer,
                                           divergence_probe=self._divergence_probe)

    # ---- Communicator interface
    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self._device)

    def _all_reduce(self, tensor, op):
        dtype, red = nccl_dtype(tensor.dtype, "all_reduce"), nccl_op(op, "all_reduce")

        def launch(stream):
            ptr = tensor.data_ptr()
            self._comm.all_reduce(ptr, ptr, tensor.numel(), dtype, red, stream, "all_reduce")

        return self._enqueue("all_reduce", (tensor,), tensor.numel(), launch)

    def _reduce_scatter(self, output, input, op):
        dtype, red = nccl_dtype(input.dtype, "reduce_scatter"), nccl_op(op, "reduce_scatter")

        def launch(stream):
            self._comm.reduce_scatter(input.data_ptr(), output.data_ptr(), output.numel(), dtype,
                                      red, stream, "reduce_scatter")

        return self._enqueue("reduce_scatter", (output, input), output.numel(), launch)

    def _all_gather(self, output, input):
        dtype, count = _moved(input)

        def launch(stream):
            self._comm.all_gather(input.data_ptr(), output.data_ptr(), count, dtype, stream, "all_gather")

        return self._enqueue("all_gather", (output, input), input.numel(), launch)

    def _broadcast(self, tensor, src):
        dtype, count = _moved(tensor)

        def launch(stream):
            ptr = tensor.data_ptr()
            self._comm.broadcast(ptr, ptr, count, dtype, src, stream, "broadcast")

        return self._enqueue("broadcast", (tensor,), tensor.numel(), launch)

    def _all_to_all(self, output, input, output_splits, input_splits):
        # Note [all-to-all through torch]: the extension exposes no ncclSend / ncclRecv.
        self._check_usable("all_to_all_single", (output, input))
        work = dist.all_to_all_single(output, input, output_splits, input_splits, group=self.group, async_op=True)
        return _TorchWork(work, "all_to_all_single")

    def _wait_work(self, work: _Work, timeout: datetime.timedelta) -> None:
        if isinstance(work, _TorchWork):
            self._raise_watchdog_failure(work.op)
            # Orders the caller's stream after it, as this communicator's waits do; with
            # blocking_wait, blocks the host too (torch's NCCL blocks for a wait with a timeout).
            if self.blocking_wait:
                work.work.wait(timeout)
            else:
                work.work.wait()
            return
        # Ordering 2 of Note [comm stream ordering]: whoever waits reads the result next.
        consumer = torch.cuda.current_stream(self._device).cuda_stream
        self._stream.make_wait(consumer, work.done)
        # Only a wait(timeout) shorter than what is left of the deadline moves it. Every other wait is
        # handed that remainder (Note [one deadline per collective] in base.py), which ends no sooner.
        if time.monotonic() + timeout.total_seconds() < work.watched.deadline:
            self.watchdog.tighten(work.watched, timeout.total_seconds())
        self._raise_watchdog_failure(work.op)
        try:
            if self.blocking_wait:
                self._comm.wait(work.done, timeout.total_seconds(), work.op)
            else:
                self._comm.check_async_error(work.op)
        except Exception:
            self._failure_raised = True  # the program learns of it here
            raise
        work.tensors = ()

    def raise_if_failed(self, what: str) -> None:
        try:
            self._raise_watchdog_failure(what)
        except CollectiveError as exc:  # reported like a failed wait: through the observer
            raise self._report_failure(exc) from None

    def _raise_watchdog_failure(self, what: str) -> None:
        """Raise the watchdog's failure, naming the collective that failed (which is what the
        stall report must be about), not ``what`` -- the operation that found out."""
        if self.watchdog.failure is not None:
            self._failure_raised = True
            raise self._watchdog_error(what)

    def _watchdog_error(self, what: str) -> CollectiveError:
        reason, failed = self.watchdog.failure, self.watchdog.failed
        op, tag, seq = (failed.op, failed.tag, failed.seq) if failed is not None else (what, "", -1)
        name = f"{op} (tag {tag!r}, collective #{seq})" if failed is not None else "a collective in flight"
        # Worded as CommHandle.wait words a failed wait, so reports read the same either way.
        return CollectiveError(
            f"fusedist: {name} failed on rank {self.rank} of {self.world_size}: {reason}. "
            f"fusedist's watchdog aborts the NCCL communicator on such a failure, so {what} cannot run",
            op=op, tag=tag, rank=self.rank, seq=seq)

    def _divergence_probe(self, entry, pending_s: float):
        """The probe of the oldest pending collective once it has been pending as long as the observer's
        ``probe_delay_s`` (Note [probing stream-ordered waits for divergence] in watchdog.py)."""
        delay = getattr(self.observer, "probe_delay_s", 0.0)
        if not delay or pending_s < delay:
            return None
        return self.observer.divergence_probe(entry.op, entry.tag, entry.seq)

    def _watchdog_failed(self, reason: str, failed) -> None:
        """The watchdog's failure handler (Note [stream-ordered waits and the watchdog])."""
        if self.blocking_wait or self.on_watchdog_failure == "raise":
            self._comm.abort(reason)  # the waiting host, or the next wait or launch, raises it
            return
        # Report while whatever depends on the collective is still unreadable on the host, and
        # end the process without aborting NCCL first (the abort would release a blocked read).
        error = self._watchdog_error("the rest of the program")
        try:
            error = self._report_failure(error)  # the stall report, if monitored
        finally:
            _exit_reporting(error)

    def settle_at_exit(self, limit_s: float) -> None:
        # Note [stream-ordered waits and the watchdog]: a failure in the last collectives of a
        # program is reported, not lost with the process. (In "exit" mode the watchdog thread
        # ends the process itself when it finds one.)
        if self.closed or (self._comm.aborted and self.watchdog.failure is None):
            return  # closed, or aborted by a failure the program was already told of
        settled = self.watchdog.settle(limit_s)
        if self.watchdog.failure is not None and not self._failure_raised:
            _exit_reporting(self._watchdog_error("the program's exit"))
        if not settled:
            oldest = self.watchdog.oldest()
            _exit_reporting(CollectiveError(
                f"fusedist: rank {self.rank} of {self.world_size} is exiting with {self.watchdog.pending} "
                f"collective(s) still in flight on the direct-NCCL communicator {limit_s:g} s after the "
                f"program ended (the oldest: {oldest}); some rank did not join them. The communicator is "
                "aborted and the process exits with status 1", rank=self.rank),
                lambda: self._comm.abort("in flight at exit"))

    def _poll_async_error(self) -> None:
        self._comm.check_async_error("a collective in flight (seen by the watchdog)")

    def _crashed_peer(self) -> Optional[str]:
        """A peer's published crash (Note [a crashed peer, seen through the store] in
        watchdog.py): through the reliability monitor, when one watches this communicator."""
        check = getattr(self.observer, "crashed_peer", None)
        return check() if check is not None else None

    # ---- helpers
    def _check_usable(self, op: str, tensors) -> None:
        """Refuse a launch on a closed or failed communicator, or with tensors elsewhere."""
        if self.closed:
            raise RuntimeError(f"the NCCL communicator of rank {self.rank} was closed (destroyed with "
                               "its process group, or by close()); use the communicator of a live group")
        self._check_tensors(op, tensors)
        self._raise_watchdog_failure(op)

    def _enqueue(self, op: str, tensors, count: int, launch) -> _Work:
        self._check_usable(op, tensors)
        producer = torch.cuda.current_stream(self._device).cuda_stream
        # Ordering 1: the collective reads what the caller enqueued so far.
        self._stream.wait_for(producer)
        # Watched from before the launch call: a launch can block (lazy connection).
        watched = self.watchdog.begin(op, self.last_tag, self.last_seq, self.timeout.total_seconds())
        try:
            if count > 0:  # NCCL gets no zero-size calls (null data pointers)
                launch(self._stream.handle)
        except BaseException as exc:
            self.watchdog.cancel(watched)
            if isinstance(exc, Exception):
                # A launch stuck past its deadline (NCCL connects lazily inside the first
                # collective of each algorithm, waiting for every peer) ends when the watchdog
                # aborts the communicator, with NCCL's "internal error": say what happened.
                self._raise_watchdog_failure(op)
            raise
        for t in tensors:
            # Ordering 3: keep the caching allocator from reusing the memory too early.
            t.record_stream(self.torch_stream)
        done = self._stream.record_done()
        self.watchdog.launched(watched, done)
        return _Work(done, op, tensors, watched)

    def _check_tensors(self, op: str, tensors) -> None:
        for t in tensors:
            if t.device.type != "cuda" or t.device.index != self._device:
                raise ValueError(
                    f"fusedist {op}: the NCCL communicator works on cuda:{self._device} (the "
                    f"device it was created for) but got a tensor on {t.device}; move "
                    f"the tensor, or use the communicator of that device "
                    f"(get_communicator(device=...))"
                )

    @property
    def aborted(self) -> bool:
        return self._comm.aborted and not self.closed  # closing aborts too, after the work ended

    @property
    def abort_reason(self) -> str:
        return self._comm.abort_reason

    @property
    def comm_stream(self) -> torch.cuda.Stream:
        """The dedicated comm stream as a torch stream (read-only use: record_stream, events)."""
        return self.torch_stream

    def stop_helpers(self, join_timeout: Optional[float] = None) -> None:
        self.watchdog.stop(join_timeout)

    def release(self, join_timeout: Optional[float] = None) -> None:
        self.close()

    def close(self) -> None:
        """Free the NCCL communicator once its launched work completed (waited for up to the
        timeout) and hand its comm stream back for the next communicator on this device.
        Idempotent; later collectives raise. Runs when ``torch.distributed`` destroyed the
        process group (Note [releasing destroyed groups] in ``fusedist/comm/__init__.py``).

        Why ncclCommAbort and not ncclCommDestroy: destroying finalizes the communicator,
        which can wait on its peers, and a rank that closes alone (its group destroyed,
        the others elsewhere) must not block on them; once this rank's own work completed,
        aborting frees the same resources without asking anyone.

        The process group goes too, once the last error naming its ranks was made: a communicator
        kept past the destroy (by a model at module scope) would keep the destroyed group alive into
        the interpreter's finalization (Note [a released communicator lets go of its group] in
        released_group.py); later collectives are refused by ``closed`` before any reaches it."""
        if self.closed:
            return
        self.closed = True
        try:
            if not self._comm.aborted:
                # Its work first, watched as always: in "exit" mode a failure ends the process
                # here, with the report (Note [stream-ordered waits and the watchdog]).
                self.watchdog.settle(self.timeout.total_seconds())
        finally:
            self.watchdog.stop(join_timeout=1.0)
            self._comm.abort("closed (its process group was destroyed, or close() was called)")
            return_comm_stream(self._device, self._stream, self.torch_stream)
        try:
            if self.watchdog.failure is not None and not self._failure_raised:
                self._failure_raised = True
                raise self._watchdog_error("closing the communicator")
        finally:
            self.group = None

    def __repr__(self) -> str:
        return (f"NcclCommunicator(rank={self.rank}, world_size={self.world_size}, "
                f"device=cuda:{self._device}, nccl={self.nccl_version})")


def _exit_reporting(error: BaseException, before_exit=None) -> None:
    """Print ``error`` as an uncaught exception would be printed, run ``before_exit`` (the
    abort), and end the process with status 1 at once: from the watchdog thread (or an exit
    hook) nothing else can stop a program that runs on with results it cannot trust.

    Printed through ``sys.excepthook``, as the interpreter prints an uncaught exception: under
    torch.distributed that hook prefixes every line with ``[rank<N>]:``, so a report from here
    reads (and greps) as the same error raised by the program would."""
    try:
        sys.stdout.flush()
        try:
            sys.excepthook(type(error), error, None)
        except Exception:  # noqa: BLE001 - a broken hook must not hide the report
            traceback.print_exception(type(error), error, None, file=sys.stderr)
        sys.stderr.flush()
        if before_exit is not None:
            before_exit()
    finally:
        os._exit(1)


def _moved(tensor: torch.Tensor) -> tuple[int, int]:
    """(NCCL dtype, count) of a collective that only moves ``tensor``'s data (all-gather,
    broadcast): a dtype NCCL has no code for (bool, float8, complex, int16) travels as its bytes,
    as with torch's NCCL backend -- DDP broadcasts a model's bool buffers and float8 weights."""
    if tensor.dtype in NCCL_DTYPES:
        return NCCL_DTYPES[tensor.dtype], tensor.numel()
    return NCCL_DTYPES[torch.uint8], tensor.numel() * tensor.element_size()


def _device_index(device) -> int:
    """The CUDA device index ``device`` names (None: the current device)."""
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"fusedist: the NCCL communicator needs a CUDA device, got {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


_fallback_logged = False


def make_nccl_communicator(process_group=None, device=None) -> Communicator:
    """The factory :func:`fusedist.comm.get_communicator` uses for CUDA tensors.

    Returns an :class:`NcclCommunicator`; if the direct path cannot run on some rank, every
    rank falls back to :class:`TorchCommunicator` together (logged once) -- unless
    ``FUSEDIST_COMM=nccl`` asked for NCCL explicitly, in which case the error is raised.
    """
    global _fallback_logged
    try:
        return NcclCommunicator(process_group, device=device)
    except TorchChosen:
        return TorchCommunicator(process_group)
    except NcclUnavailableError as exc:
        from . import communicator_choice

        if communicator_choice() == "nccl":
            raise
        if not _fallback_logged:
            log.warning("fusedist: using torch.distributed for CUDA collectives: %s", exc)
            _fallback_logged = True
        return TorchCommunicator(process_group)
