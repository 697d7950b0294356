"""Per-step cross-rank agreement check of DDP: one tiny all-reduce per synchronized backward.

Note [step check]
    Bucket collectives pair up by issue order, not by meaning: if rank 1 skips a backward,
    its next step's buckets silently average with rank 0's current ones, and the run only
    fails (or hangs) at the very end, far from the cause. So at the end of every synchronized
    backward, after the last bucket was launched (the same position in the collective order
    on every rank), each rank contributes a few integers describing where it is:

        sync_step        synchronized backwards completed before this one
        forward          training forwards (grad enabled) so far, this step's included
        backward         all backwards (no_sync ones included)
        optimizer_steps  optimizer steps taken on this model's parameters
        layout           CRC of the gradient bucket layout
        collective_seq   sequence number of this step's last bucket collective
        unused           parameters without a gradient (0 with find_unused_parameters)
        trainable        CRC of the module's requires_grad flags at this step's forward
                         (Note [trainable set changes] in fusedist/ddp/trainable.py)
        modes            CRC of its modules' train/eval flags at that forward (Note [train
                         and eval modes in the step check] in mode_check.py)
        loss_scale       the float32 bits of the GradScaler scale the loss was scaled by, where
                         it is on the host, else 0 (Note [loss scale in the step check] in
                         scale_check.py)
        grads_cleared    optimizer steps taken with every gradient of the model cleared after a
                         synchronized backward (Note [gradients cleared before the step] in
                         optimizer_guard.py)
        clips            clip_grad_norm_ calls over the model's parameters (Note [a clip on
                         some ranks only] in clip_check.py)
        params           every few steps and at check_consistency(), a digest of the
                         replicated parameters' values, else 0 (Note [parameter check] in
                         param_check.py)
        replicas         fully_shard on a (replicate, shard) mesh, at the parameter check's
                         period: a flag, nonzero where the replicas of this rank's pieces ran
                         different steps (Note [replica check] in sharded_watch.py); else 0

    The vector ``[v, -v]`` is all-reduced with MAX, giving every rank ``max(v)`` and
    ``min(v)`` exactly (int64), so every rank reaches the same verdict -- agreement iff
    max == min -- and on disagreement all of them take the same extra step: an all-gather of
    the vectors, then the same :class:`RankMismatchError` naming the ranks and values.
    Nothing here touches the gradients, so the numerics of the default path are unchanged.

    The verdict is read lazily, at the next training forward (or right away when this rank
    is about to raise its own unused-parameter error): the tiny all-reduce runs behind the
    optimizer step, so it adds no exposed latency to a step whose optimizer step and
    forward bookkeeping outlast it, and on CUDA (a pinned host copy behind an event) no host
    synchronization. On the host (gloo) it is a point-to-point exchange driven by the
    communicator's progress thread; on a tiny model the forward still waits for it
    (``benchmarks/bench_ddp_step_overhead.py --phases`` shows the wait) -- so where it can, DDP
    sends the values in the last bucket's all-reduce instead, and the verdict is read from
    there at the same points (Note [the check carried by the last bucket] in
    carried_check.py). The price: a
    divergence is reported at the start of the step after it happened, and one in the very
    last step of a run has no next forward: ``DistributedDataParallel.check_consistency()``
    reads the pending verdict and checks the counters once more, at once (and
    ``fusedist.checkpoint.save`` calls it, so a diverged run is not saved). Every rank reads
    the verdict at the same point of its program, so on a mismatch the extra all-gather
    pairs up. (A pipeline stage reads a verdict the last bucket carried at its step's end
    instead, before any optimizer step: Note [the step check's verdict read at the step's end]
    in fusedist/pipelining/step_verdict.py.)

    A rank that joined (ran out of inputs under ``model.join()``, Note [joined ranks] in
    fusedist/ddp/join.py) takes part with ``JOINED`` in every slot, which is below any ``v``
    or ``-v`` and so neutral for MAX: the verdict compares the ranks still training, and an
    error lists the joined ones apart.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
import zlib
from typing import Callable, Optional

import torch

from .._consistency import RankMismatchError
from ..comm import Communicator, given_up_exit
from ..comm.base import CollectiveError, global_ranks
from .._process_hooks import at_exit
from . import carried_check
from .step_check_text import FIELDS, JOINED, differs, render_bounds, render_mismatch


def layout_crc(layout) -> int:
    """A rank-independent 31-bit digest of a layout's fingerprint (Python's hash() is salted)."""
    return zlib.crc32(repr(layout.fingerprint()).encode()) & 0x7FFFFFFF


class StepCheck:
    """Launch/settle pair for the check of one DDP reducer (see Note [step check])."""

    def __init__(self, comm: Communicator, tag: str = "ddp step check"):
        self.comm = comm
        # How its collectives are named in errors and stall reports: a fully_shard model's
        # check is not called a DDP one there.
        self.tag = tag
        self.k = len(FIELDS)
        self.buf = torch.zeros(2 * self.k, dtype=torch.int64, device=comm.device)
        self.on_cuda = comm.device.type == "cuda"
        # Where the verdict is copied to the host: a stream of its own, so that the step's
        # kernels never wait for the check (Note [the check off the step's stream]).
        self._stream = torch.cuda.Stream(comm.device) if self.on_cuda else None
        self._pending: Optional[tuple] = None  # (handle, host copy, event, values, detail)
        #: The pending verdict's summed rows when the last bucket carried it (Note [the check carried
        #: by the last bucket] in carried_check.py), else None.
        self._tail: Optional[torch.Tensor] = None
        self._pending_tag = tag  # the tag the pending check's all-reduce was launched with
        _checks.add(self)
        at_exit("report unread step-check verdicts", _report_unread_at_exit)  # Note [verdicts unread at exit]

    def launch(self, values: Optional[list[int]], detail: dict, digest: Optional[torch.Tensor] = None,
               replicas: Optional[torch.Tensor] = None) -> None:
        """Start this step's check (async); its verdict is read by :meth:`settle`.
        ``values=None``: this rank has joined and is not compared. ``digest``: the ``params``
        field (a 0-dim int64 tensor on the device, Note [parameter check]), written there;
        else ``values`` holds it. ``replicas``: the ``replicas`` field, the same way (Note
        [replica check] in sharded_watch.py)."""
        self.settle()
        if values is None:
            values = [JOINED] * self.k
            local = torch.full((2 * self.k,), JOINED, dtype=torch.int64)
        else:
            local = torch.tensor(values + [-v for v in values], dtype=torch.int64)
        if self.on_cuda:  # pinned + non_blocking: a pageable copy would synchronize the host
            local = local.pin_memory()
        self.buf.copy_(local, non_blocking=self.on_cuda)
        on_device = {name: t for name, t in (("params", digest), ("replicas", replicas)) if t is not None}
        if on_device and values[0] != JOINED:
            for name, t in on_device.items():
                field = FIELDS.index(name)
                self.buf[field].copy_(t)
                self.buf[self.k + field].copy_(-t)
            detail = dict(detail, on_device=on_device)
        self._pending_tag = tag = tag_inside_call(self.tag)  # Note [a step check inside a save]
        handle = self.comm.all_reduce(self.buf, op="max", async_op=True, tag=tag)
        host = event = None
        if self.on_cuda:
            # Note [the check off the step's stream]
            #     Waiting on the current stream would order the optimizer step, and every
            #     kernel after it, behind the check's all-reduce, which the communicator runs
            #     after the last bucket's: one more collective's latency on the critical path
            #     of every step. The check's own stream waits for it instead, and the host copy
            #     and its event are queued there; the step's stream goes on with the gradients.
            #     (Measured on an H200 with two ranks over NCCL sockets, the difference did not
            #     show: DDP took 1.075x torch DDP's step before and 1.083x after, 1.073x with
            #     the check off -- the check costs ~1% there either way.)
            with torch.cuda.stream(self._stream):
                handle.wait()  # orders the check's stream after the all-reduce; no host sync
                host = torch.empty(self.buf.shape, dtype=self.buf.dtype, pin_memory=True)
                host.copy_(self.buf, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
        self._pending = (handle, host, event, values, detail)

    def carried(self, handle, tail: torch.Tensor, values: Optional[list[int]], detail: Callable[[], dict]) -> None:
        """This step's check went out with the last bucket's all-reduce (``handle``), ``tail`` its
        rows (Note [the check carried by the last bucket] in carried_check.py); read by :meth:`settle`.
        ``values`` as for :meth:`launch` (the parameter digest, if due, in place); ``detail``: a
        function that builds :meth:`launch`'s detail, called only for an error."""
        self.settle()
        self._pending = (handle, None, None, values if values is not None else [JOINED] * self.k, detail)
        self._tail = tail

    def _carried_bounds(self) -> list[int]:
        """``[max(v), max(-v)]`` from the pending verdict's summed rows."""
        return carried_check.bounds(carried_check.decode(self._tail, self.comm.world_size, self.k), JOINED)

    def is_pending(self) -> bool:
        """Whether a verdict was launched and not read yet."""
        return self._pending is not None

    def readable_on_host(self) -> bool:
        """Whether the pending verdict can be read without the host waiting on the device (it is
        carried by the last bucket, or the check's own all-reduce ran on the host)."""
        return self._pending is not None and self._pending[2] is None

    def disagreement_flag(self, device: torch.device) -> Optional[torch.Tensor]:
        """A one-element int64 tensor on ``device``, nonzero where the pending verdict says the ranks
        diverged; None where none is pending or its collective failed (:meth:`settle` raises that).
        No host wait on CUDA: the current stream waits for the check's copy event (Note [the step
        check's verdict read at the step's end] in fusedist/pipelining/step_verdict.py)."""
        if self._pending is None:
            return None
        handle, _, event, _, _ = self._pending
        k = self.k
        try:
            if self._tail is not None:  # (the backward waited for the bucket: nothing is waited for here)
                handle.wait()
                agreed = carried_check.agree(self._tail, self.comm.world_size)
                if not agreed:  # (rows that differ: a divergence, or a joined rank's row, neutral in the bounds)
                    bounds = self._carried_bounds()
                    agreed = all(bounds[i] == -bounds[k + i] for i in range(k))
                return torch.tensor([0 if agreed else 1], dtype=torch.int64, device=device)
            if event is not None:
                torch.cuda.current_stream(self.buf.device).wait_event(event)
            else:
                handle.wait()
        except CollectiveError:
            return None
        return (self.buf[:k] != -self.buf[k:]).any().to(torch.int64).view(1).to(device, non_blocking=True)

    def settle(self, reported_at: Optional[str] = None) -> None:
        """Read the pending verdict (if any); raise :class:`RankMismatchError` on every rank
        if the ranks disagreed. Called at the next training forward, by which time the tiny
        all-reduce has long completed, so the wait costs nothing. ``reported_at``: where the
        error says the verdict was read, when not at the next training forward."""
        if self._pending is None:
            return
        handle, host, event, values, detail = self._pending
        if reported_at is not None:
            detail = _reported_at(detail, reported_at)
        if self._tail is not None:
            try:
                handle.wait()  # (the last bucket's: finished by the backward already, or about to be)
            except CollectiveError:
                # The bucket's own failure, raised by the backward that finishes it: no verdict.
                self._pending = self._tail = None
                return
            agreed = carried_check.agree(self._tail, self.comm.world_size)
            reduced = None if agreed else self._carried_bounds()
            self._pending = self._tail = None
            if reduced is not None:
                self._verdict(reduced, values, detail())
            return
        self._pending = None
        handle.wait()
        if event is not None:
            event.synchronize()
            # wait() did not block the host: an aborted all-reduce would have left garbage.
            self.comm.raise_if_failed(self._pending_tag)
            reduced = host.tolist()
        else:
            reduced = self.buf.tolist()
        self._verdict(reduced, values, detail)

    def unread_divergence(self) -> Optional[str]:
        """Note [verdicts unread at exit]: the message of a pending verdict that says the ranks
        diverged, read without communicating (None when there is none, it is not complete yet,
        or the ranks agreed)."""
        if self._pending is None:
            return None
        handle, host, event, values, detail = self._pending
        if event is not None or not handle.is_completed() or not _succeeded(handle):
            return None  # (a CUDA copy, a collective still open or failed: never block, never guess)
        reduced = self._carried_bounds() if self._tail is not None else self.buf.tolist()
        k = self.k
        if all(reduced[i] == -reduced[k + i] for i in range(k)):
            return None
        if self._tail is not None:
            detail = detail()
        lines = render_bounds(reduced, _with_digest(values, detail), self.comm.rank, detail, None).replace(
            "detected on every rank that took part; ", "").splitlines()
        lines[0] = (f"{lines[0]} [found at exit: the verdict of this rank's last synchronized backward was "
                    "never read, as no training forward followed it; call check_consistency() on every rank "
                    "at the end of training to raise it on every rank]")
        return "\n".join(line for line in lines if not line.startswith("Which rank holds"))

    def _verdict(self, reduced: list[int], values: list[int], detail: dict) -> None:
        k = self.k
        if all(reduced[i] == -reduced[k + i] for i in range(k)):
            return
        values = _with_digest(values, detail)  # (read from the device on a mismatch only)
        # Every rank saw the same max/min, so every rank is here: the all-gather pairs up.
        mine = torch.tensor(values, dtype=torch.int64, device=self.comm.device)
        everyone = torch.empty(self.comm.world_size * k, dtype=torch.int64, device=self.comm.device)
        try:
            # (its own tag on every rank: an all-gather pairs by its tag, Note [a step check inside a save])
            self.comm.all_gather(everyone, mine, tag=f"{self.tag} details")
        except CollectiveError as exc:
            # Note [verdict without details] in step_check_text.py: the divergence is known from the reduction.
            raise RankMismatchError(render_bounds(reduced, values, self.comm.rank, detail, exc)) from exc
        table = everyone.view(self.comm.world_size, k).tolist()
        column = FIELDS.index("trainable")
        describe = detail.get("describe_trainable")
        if describe is not None and differs(table, column):
            detail = dict(detail, trainable_lines=describe(self.comm))  # a collective: same verdict everywhere
        describe = detail.get("describe_modes")
        if describe is not None and differs(table, FIELDS.index("modes")):
            detail = dict(detail, mode_lines=describe(self.comm))  # (a collective too)
        describe = detail.get("describe_params")
        if describe is not None and differs(table, FIELDS.index("params")) and not differs(table, 0):
            # (a collective too; with different step counts the digests are of different steps)
            joined = [r for r, row in enumerate(table) if row[0] == JOINED]
            detail = dict(detail, param_lines=describe(self.comm, joined))
        describe = detail.get("describe_replicas")
        if describe is not None and differs(table, FIELDS.index("replicas")):
            detail = dict(detail, replica_lines=describe())  # (local: what this rank's replicas exchanged)
        raise RankMismatchError(render_mismatch(table, self.comm.rank, dict(detail, global_ranks=global_ranks(
            self.comm))))


# Note [a step check inside a save]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``fusedist.checkpoint.save`` is a collective, and on a DDP or fully_shard model its first collective is
# this check (``check_consistency()``, so that a diverged run is not saved). A rank that did not call the
# save went on to its next collective -- a backward's bucket -- and its stall report showed its peers
# "inside check_consistency()" at "all_reduce [ddp step check]": nothing said they were saving, and the
# report's "behind by 1 backward" pointed at a skipped backward. While the save's entry runs
# (``inside_call("fusedist.checkpoint.save")``), the check's collectives carry the call's name in their
# tag, which every rank's report shows: "ranks [0] reached all_reduce [fusedist.checkpoint.save: ddp
# step check]". An all-reduce pairs by order, size and op, never by its tag (Note [exchange tags] in
# fusedist/comm/exchange_tags.py; the divergence probe compares no tags), so a healthy save pairs as
# before; the details all-gather after a mismatch, which pairs by its tag, keeps its own. Per thread: a
# save in a background thread does not rename the training thread's checks.
_calls = threading.local()


@contextlib.contextmanager
def inside_call(name: str):
    """Name the step checks this thread launches inside ``name`` (a collective call every rank must
    make, e.g. ``fusedist.checkpoint.save``) after it (Note [a step check inside a save])."""
    before = getattr(_calls, "name", None)
    _calls.name = name
    try:
        yield
    finally:
        _calls.name = before


def inside_call_name():
    """The collective call (``fusedist.checkpoint.save``) this thread is inside of, or None: a rank's
    position in its stall-report entries says it (a ``checking`` entry is written before the check's
    collective exists)."""
    return getattr(_calls, "name", None)


def with_call(position: dict) -> dict:
    """``position`` (a rank's training position for its stall-report entries), with the call this
    thread is inside of where there is one (Note [a step check inside a save])."""
    name = inside_call_name()
    if name is not None:
        position["inside_call"] = name
    return position


def tag_inside_call(tag: str) -> str:
    """``tag``, prefixed with the call this thread is inside of, if any."""
    name = getattr(_calls, "name", None)
    return tag if name is None else f"{name}: {tag}"


def _reported_at(detail, where: str):
    """``detail`` (a dict, or a function that builds one for a carried verdict) saying it was read at ``where``."""
    if callable(detail):
        return lambda: dict(detail(), reported_at=where)
    return dict(detail, reported_at=where)


def _with_digest(values: list[int], detail: dict) -> list[int]:
    """``values`` with this rank's fields that stayed on the device (the parameter digest, the
    replica flag) read in."""
    on_device = detail.get("on_device")
    if not on_device:
        return values
    values = list(values)
    for name, t in on_device.items():
        values[FIELDS.index(name)] = int(t.item())
    return values


# Note [verdicts unread at exit]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The verdict of a rank's last synchronized backward is read at a forward that never comes
# when the rank's loop ends there. If that rank is the one that diverged (it skipped a
# backward, so it runs out of iterations first), the others learn of it (Note [verdict
# without details] in step_check_text.py) but it would exit with status 0 and no word. Its tiny all-reduce has
# usually completed by then, so at exit each rank reads such a verdict locally -- no
# communication, the process group may be gone -- and prints the divergence to stderr.
_checks: "weakref.WeakSet[StepCheck]" = weakref.WeakSet()


#: How long the exit waits for a pending check's all-reduce to complete (it is tiny; a peer
#: that never joins it is reported by the peer's own side).
EXIT_WAIT_S = 5.0


def unread_divergences(wait_s: float = 0.0) -> list[str]:
    """The messages of every pending verdict that says the ranks diverged (Note [verdicts
    unread at exit]), after waiting up to ``wait_s`` seconds for pending checks to complete."""
    # (a check on a communicator that gave up can never complete: Note [ending after given-up
    # collectives] in fusedist/comm/given_up_exit.py)
    checks = [c for c in list(_checks) if c._pending is not None and not given_up_exit.gave_up(c.comm)]
    end = time.monotonic() + wait_s
    while time.monotonic() < end and not all(_completed(c) for c in checks):
        time.sleep(0.05)
    found = []
    for check in checks:
        try:
            message = check.unread_divergence()
        except Exception:  # noqa: BLE001 - at exit, never fail on a half-torn-down state
            message = None
        if message:
            found.append(message)
    return found


def _succeeded(handle) -> bool:
    """Whether a completed collective's result can be read: a failed one may have left a
    partial reduction behind."""
    work = getattr(handle, "_work", None)
    if work is None:
        return getattr(handle, "_error", None) is None
    if hasattr(work, "_error"):  # the gloo exchange's work
        return work._error is None
    try:
        return bool(work.is_success())
    except Exception:  # noqa: BLE001 - unknown work type: do not guess
        return False


def _completed(check: "StepCheck") -> bool:
    pending = check._pending
    try:
        return pending is None or pending[0].is_completed()
    except Exception:  # noqa: BLE001 - a failed collective: nothing to read
        return True


def _report_unread_at_exit() -> None:
    for message in unread_divergences(EXIT_WAIT_S):
        print(f"fusedist: {message}" if not message.startswith("fusedist") else message, file=sys.stderr, flush=True)
