"""The communicator interface every fusedist feature talks to.

Two implementations sit behind it: :class:`~fusedist.comm.torch_comm.TorchCommunicator`
(``torch.distributed``: gloo on CPU, NCCL through torch on GPU) and the direct-NCCL
communicator of the CUDA extension. Code above this interface (DDP, ZeRO, SyncBN) must not
care which one runs.

Every collective returns a :class:`CommHandle`. ``wait()`` is idempotent and bounded by a
timeout, so a rank that never joins a collective turns into a :class:`CollectiveError`
naming the operation, its tag and the rank -- never a silent hang.
"""

from __future__ import annotations

import abc
import contextlib
import datetime
import itertools
import time
from typing import Callable, Optional

import torch

from ..distributed import bounded_timeout, collective_timeout, wait_timeout
from .checks import _overlaps, _row_numel, _tag, check_flat, check_in_place, check_op
from .failure_wording import is_timeout as _is_timeout, still_running_message, why_failed
from .group_ranks import global_note, global_ranks
from .sliced_wait import wait_probed

_uids = itertools.count()


class CollectiveError(RuntimeError):
    """A collective failed or did not complete within its timeout."""

    def __init__(self, message: str, *, op: str = "", tag: str = "", rank: int = -1, seq: int = -1):
        super().__init__(message)
        self.op, self.tag, self.rank, self.seq = op, tag, rank, seq


class CommHandle:
    """An in-flight (or finished) collective.

    ``wait()`` blocks until the result is usable by the caller (on CUDA: until the caller's
    current stream is ordered after it), runs the completion callbacks once, and raises
    :class:`CollectiveError` on failure or timeout. Calling it again is a no-op. On gloo, a
    ``wait(timeout)`` shorter than the communicator's timeout that runs out raises without
    failing the collective, as torch's gloo work does: a later ``wait()`` returns the result. A
    negative one is refused (Note [negative wait timeouts] in fusedist/distributed.py).

    Note [one deadline per collective]
        A collective is bounded by the communicator's timeout counted from its launch, on
        every path: the gloo exchange and the direct-NCCL watchdog both count from the launch,
        and a torch work is waited for only as long as that deadline leaves. ``wait(timeout)``
        can shorten a wait, never extend the collective: a timeout longer than what is left
        waits until the deadline and then fails. (torch's gloo work, waited for with a longer
        timeout, waited all of it, where the exchange gave up at the deadline: the same call
        succeeded or failed depending on the tensor's size.) gloo's own collectives are also
        bounded by the process group's timeout, which fusedist cannot extend, and so is the gloo
        exchange that stands in for them (Note [the exchange ends at the group's timeout] in
        torch_comm.py); when that one is shorter and fires first, the error says so. Every timeout error names the
        collective, its tag, the rank, the peers when known and how long it waited. One
        exception: torch's NCCL work (the GPU path without the C++ extension) is waited for
        without a timeout -- given one, it blocks the host until the collective completes --
        so its bound is the process group's timeout, which torch's watchdog enforces.
    """

    def __init__(
        self,
        comm: "Communicator",
        work,
        *,
        op: str,
        tag: str,
        seq: int,
        timeout: datetime.timedelta,
    ):
        self._comm = comm
        self._work = work
        self.op, self.tag, self.seq = op, tag, seq
        self._timeout = timeout
        self._launched = time.monotonic()  # Note [one deadline per collective]
        self._callbacks: list[Callable[[], None]] = []
        self._done = work is None
        #: Kept alive until the wait ends: a group destroyed under the collective is freed after it (Note [a
        #: released communicator lets go of its group] in released_group.py).
        self._group = comm._group_while_in_flight() if work is not None else None
        self._error: Optional[BaseException] = None
        #: Launched with ``async_op=True`` (set by the launch): whether a wait may be sliced; and
        #: this rank's part (a tensor whose size every rank's must match; None for an all-to-all),
        #: which the probe compares (Note [divergence probe] in fusedist/reliability/divergence.py); and what
        #: else every rank must pass alike -- the reduce op ("op max"), the root ("from rank 0") -- or None
        #: (Note [reduce ops and roots in the divergence probe] there).
        self.async_op, self.part, self.variant = False, None, None

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` inside ``wait()`` once the collective has completed (or now, if it has)."""
        if self._done:
            fn()
        else:
            self._callbacks.append(fn)

    def is_completed(self) -> bool:
        if self._done:
            return True
        return bool(self._work.is_completed())

    # Never traced (Note [collectives under torch.compile]).
    @torch.compiler.disable
    def wait(self, timeout: Optional[datetime.timedelta] = None) -> None:
        # Refused before anything else, so alike whatever the collective's state (Note [negative wait timeouts]).
        requested = wait_timeout(timeout, self._timeout, lambda: (
            f"{self.op} (tag {self.tag!r}, collective #{self.seq}) on rank {self._comm.rank}"))
        if self._error is not None:
            raise self._error
        if self._done:
            return
        left = self._left()
        # Note [one deadline per collective]: never past the launch + the communicator's timeout.
        shortened = requested < left
        waited = requested if shortened else left
        try:
            wait_probed(self, waited)  # (one call of _wait_work unless it blocks long: Note [divergence probe])
        except CollectiveError as exc:
            # [reliability] observed like any other failure; may come back as a stall report.
            self._error = self._comm._on_failure(self, exc) or exc
            self._group = None
            if self._error is exc:
                raise
            raise self._error from exc
        except Exception as exc:  # noqa: BLE001 - backend errors come in many types
            if shortened and self._comm._wait_can_resume(self._work):
                raise self._still_running(requested, exc) from exc
            failure = self._outcome_once_completed(exc) if shortened else exc
            if failure is not None:
                self._fail(failure, requested if shortened else None)
        self._done = True
        self._work = self._group = None
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()

    def _outcome_once_completed(self, exc: Exception) -> Optional[Exception]:
        """A shortened wait ran out (``exc``) and the work goes on, unless it completed meanwhile (the race of
        Note [a slice that runs out as the work completes] in sliced_wait.py): then its own outcome, None for a
        success, else its error -- not the wait's timeout as the collective's failure on this rank alone, its
        peers done with it. Only where a wait that runs out leaves the work running (gloo, whose waits are
        sliced or watched); the direct-NCCL communicator aborts its collective at a wait's timeout."""
        comm, work = self._comm, self._work
        leaves_running = comm._sliced_waits(work, True) or comm._watched_waits(work)
        if not (_is_timeout(exc) and leaves_running and work.is_completed()):
            return exc  # (a work's own error raised by the wait stands: a second wait may not raise it again)
        try:
            comm._wait_work(work, self._left())  # (returns, or raises, at once)
        except Exception as own:  # noqa: BLE001 - the work's own failure
            return own
        return None

    def _fail(self, exc: Exception, wait_timeout: Optional[datetime.timedelta]) -> None:
        """Record the backend's ``exc`` as the collective's failure and raise it (the observer's richer error,
        a stall report, where it gives one)."""
        self._error = CollectiveError(
            f"fusedist: {self.op} (tag {self.tag!r}, collective #{self.seq}) failed on rank "
            f"{self._comm.rank} of {self._comm.world_size}{self._comm._global_note([self._comm.rank])}: "
            f"{why_failed(self, exc, wait_timeout)}", op=self.op, tag=self.tag, rank=self._comm.rank, seq=self.seq)
        # [reliability] the observer may return a richer error (a stall report): raise that.
        self._error = self._comm._on_failure(self, self._error) or self._error
        self._group = None
        raise self._error from exc

    def _left(self) -> datetime.timedelta:
        """What is left of the collective's deadline (at least a millisecond: torch's works
        read a zero timeout as "no timeout")."""
        # in float seconds: the timeout, a communicator's, is bounded (Note [unbounded timeouts])
        left = self._launched + self._timeout.total_seconds() - time.monotonic()
        return datetime.timedelta(seconds=max(left, 1e-3))

    def _still_running(self, timeout: datetime.timedelta, exc: Exception) -> CollectiveError:
        """(Not recorded as the collective's failure: a later ``wait`` returns the result.)"""
        return CollectiveError(still_running_message(self, timeout, exc),
                               op=self.op, tag=self.tag, rank=self._comm.rank, seq=self.seq)


class Communicator(abc.ABC):
    """Collectives over one process group, on flat contiguous tensors.

    Shapes: ``reduce_scatter(output, input)`` needs ``input.numel() == world_size *
    output.numel()``; ``all_gather(output, input)`` needs ``output.numel() == world_size *
    input.numel()``. Rank ``r`` owns the ``r``-th slice.
    """

    #: Short name of the implementation ("torch", "nccl").
    name: str = "abstract"

    def __init__(self, rank: int, world_size: int, timeout: Optional[datetime.timedelta] = None):
        #: Never reused within the process (unlike ``id()`` of a communicator freed with its
        #: destroyed group): what a per-communicator "done once" record keys on.
        self.uid = next(_uids)
        self.rank = rank
        self.world_size = world_size
        # (None: the default; a zero or negative one is refused by the property below, as when set later)
        self.timeout = collective_timeout() if timeout is None else timeout
        self._seq = itertools.count()
        #: Sequence number, op and tag of the last collective issued (-1: none yet).
        self.last_seq = -1
        self.last_op = ""
        self.last_tag = ""
        #: What the last collective's messages are matched by where the transport tags them
        #: (the gloo exchange, Note [exchange tags] in exchange_tags.py): its tag unless the caller chose another.
        self.last_label = ""
        #: Optional observer with ``on_launch(comm, handle)`` / ``on_failure(comm, handle,
        #: error)``; the reliability monitor plugs in here.
        self.observer = None
        #: Why a collective's wait was ended before its deadline because the ranks can never pair
        #: (None: none was); later collectives are refused (Note [divergence probe] in
        #: fusedist/reliability/divergence.py).
        self.gave_up: Optional[str] = None

    @property
    def timeout(self) -> datetime.timedelta:
        """Each collective's bound, from its launch (Note [one deadline per collective]); set it to
        change the bound of the collectives launched from then on. A longer one than
        ``fusedist.distributed.LONGEST_TIMEOUT_S`` -- ``datetime.timedelta.max`` -- is kept as that
        (Note [unbounded timeouts] in fusedist/distributed.py): no deadline in practice."""
        return self._collective_timeout

    @timeout.setter
    def timeout(self, value) -> None:
        self._collective_timeout = bounded_timeout(value, f"the {self.name} communicator's timeout")
        self._timeout_changed()

    def _timeout_changed(self) -> None:
        """``timeout`` was set: an implementation with helpers that hold a copy updates them."""

    # ---- the interface
    @abc.abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, op: str): ...

    @abc.abstractmethod
    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str): ...

    @abc.abstractmethod
    def _all_gather(self, output: torch.Tensor, input: torch.Tensor): ...

    @abc.abstractmethod
    def _broadcast(self, tensor: torch.Tensor, src: int): ...

    @abc.abstractmethod
    def _wait_work(self, work, timeout: datetime.timedelta) -> None:
        """Block until ``work`` is complete; raise on error or after ``timeout``."""

    def _wait_can_resume(self, work) -> bool:
        """Whether ``work``, whose wait with a timeout shorter than the collective's just ran
        out, is still running and may be waited for again. False by default: the direct-NCCL
        communicator aborts at a wait's timeout, as torch's NCCL does."""
        return False

    def _sliced_waits(self, work, async_op: bool) -> bool:
        """Whether ``work`` may be waited for in short slices that leave it running (Note
        [divergence probe] in fusedist/reliability/divergence.py). False by default."""
        return False

    def _watched_waits(self, work) -> bool:
        """Whether a wait for ``work`` that cannot be sliced is probed from the watcher thread instead (Note
        [probing waits that cannot be sliced] in watched_wait.py). False by default."""
        return False

    def _end_watched_wait(self, work, verdict: str) -> bool:
        """End a watched wait for ``work`` the probe gave up on (``verdict``): its caller's wait fails.
        False where ``work`` had completed (nothing was ended)."""
        return False

    def _group_while_in_flight(self):
        """What a handle keeps alive until its wait ends (the process group where one is held); None by default."""
        return None

    def _transport_timeout(self, work) -> Optional[float]:
        """Seconds after which the transport itself gives up on ``work`` whatever fusedist's
        timeout (gloo's own collectives: the process group's timeout), or None."""
        return None

    def _global_note(self, ranks: list) -> str:
        """:func:`global_note` of ``ranks`` (positions in this communicator's group)."""
        return global_note(ranks, global_ranks(self))

    def _outside_group(self) -> str:
        """Why a root rank was refused: it is a position in this communicator's group, which on a
        subgroup is not the global rank a caller may have meant (as in torch, where
        ``ZeroRedundancyOptimizer.consolidate_state_dict(to=...)`` takes a group rank too)."""
        note = self._global_note(list(range(self.world_size)))
        if not note:  # the default group, or one of the same ranks
            return f"outside world_size {self.world_size}"
        return (f"outside world_size {self.world_size}: it is a rank of this process group, 0..{self.world_size - 1}"
                f"{note}, not a global rank")

    def scratch_bytes(self) -> int:
        """Host or device memory the communicator holds for its own use between collectives
        (landing buffers and the like); 0 unless an implementation says otherwise."""
        return 0

    def _progress_in_background(self, work) -> None:
        """``work`` was launched with ``async_op=True``: the caller will wait later, if at all
        soon. An implementation whose work only advances when driven hands it to a helper
        thread here; a synchronous launch is waited for at once instead. Nothing by default."""

    def stop_helpers(self, join_timeout: Optional[float] = None) -> None:
        """Stop the background threads the communicator started for its own use, once they
        have finished the work already handed to them; they start again on the next
        collective. With ``join_timeout``, wait for them up to so many seconds. Called at
        interpreter exit (Note [draining at exit] in ``fusedist/comm/__init__.py``). Nothing
        to stop by default."""

    def settle_at_exit(self, limit_s: float) -> None:
        """At interpreter exit, before the helpers stop: a communicator whose collectives can
        fail after their ``wait()`` returned makes sure such a failure is reported (it may end
        the process). Nothing by default."""

    def release(self, join_timeout: Optional[float] = None) -> None:
        """Its process group was destroyed: stop the helper threads and free what the
        communicator holds (:func:`fusedist.comm.release_destroyed_groups`). By default the
        helpers are stopped; an implementation with more to free overrides this."""
        self.stop_helpers(join_timeout)

    def raise_if_failed(self, what: str) -> None:
        """Raise :class:`CollectiveError` if a collective already waited for has failed since
        (its result is garbage). Only a communicator whose ``wait()`` does not block the host
        can learn that later; the host reads a result it copied behind an event only after
        asking this. Nothing by default."""

    @property
    def aborted(self) -> bool:
        """True once the communicator gave up after a failure and refuses further collectives
        (Note [no recovery after an abort] in ``fusedist/comm/__init__.py``)."""
        return False

    @property
    def abort_reason(self) -> str:
        """Why it was aborted ('' while it was not)."""
        return ""

    def barrier(self) -> None:
        """Its own collective (``barrier``), not a user's one-element all-reduce: a rank at a barrier never
        pairs with a rank at such an all-reduce (that one went on with its own value), and the divergence
        probe names both."""
        token = torch.zeros(1, device=self.device)
        self._launch("barrier", "barrier", False, lambda: self._barrier(token), part=token)

    def _barrier(self, token: torch.Tensor):
        """Start the barrier (``token``: one zero); a sum all-reduce of it unless the transport has a
        barrier that pairs with nothing else."""
        return self._all_reduce(token, "sum")

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    # ---- public wrappers: validation, sequence numbers, handles
    def all_reduce(self, tensor, *, op: str = "sum", async_op: bool = False, tag: str = "",
                   parts_checked: bool = False) -> CommHandle:
        """``parts_checked``: the caller already made sure every rank passes a tensor of this size and
        dtype, with this op (a DDP bucket: Note [parts a caller checked]). Pass the same value on
        every rank for one collective."""
        check_op(op, "all_reduce", tensor.dtype, tag)
        check_flat("all_reduce", tag, self.rank, tensor=tensor)
        reduce = self._all_reduce_checked if parts_checked else self._all_reduce
        return self._launch("all_reduce", tag, async_op, lambda: reduce(tensor, op), part=tensor, variant=f"op {op}")

    # Note [parts a caller checked]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # An implementation may compare the ranks' parts of an all-reduce before trusting the transport
    # with them (gloo's own all-reduces post a fingerprint to every peer: Note [parts agreed before
    # gloo's own all-reduce] in part_agreement.py). A caller whose parts are already checked across
    # ranks -- DDP's buckets, whose layout is compared at construction and at every synchronized step
    # (Note [step check] in fusedist/reliability/step_check.py) and whose op is fixed; DDP's dense
    # average of a sparse-gradient weight and of parameters unfrozen after wrapping, whose sizes and
    # dtypes ride in an exchange they make anyway (fusedist/ddp/sparse.py, trainable.py) -- says so with
    # ``parts_checked=True`` and pays for no comparison. Every rank must pass the same value for one
    # collective: a rank that compares waits for a fingerprint its peer never posts and times out
    # (DDP passes it from the one place that launches a bucket, for the active ranks' buckets and a
    # joined rank's shadows alike). Implementations that compare nothing ignore it.
    def _all_reduce_checked(self, tensor: torch.Tensor, op: str):
        """``_all_reduce`` of parts the caller checked across ranks (Note [parts a caller checked]):
        the same by default."""
        return self._all_reduce(tensor, op)

    def reduce_scatter(self, output, input, *, op: str = "sum", async_op: bool = False, tag: str = "",
                       label: Optional[str] = None) -> CommHandle:
        check_op(op, "reduce_scatter", input.dtype, tag)
        check_flat("reduce_scatter", tag, self.rank, output=output, input=input)
        if input.numel() != output.numel() * self.world_size:
            raise ValueError(
                f"fusedist reduce_scatter{_tag(tag)}: input has {input.numel()} elements, expected "
                f"world_size ({self.world_size}) x output ({output.numel()})"
            )
        check_in_place("reduce_scatter", output, input, self.rank, self.world_size)
        return self._launch("reduce_scatter", tag, async_op, lambda: self._reduce_scatter(output, input, op), label,
                            part=output, variant=f"op {op}")

    def all_gather(self, output, input, *, async_op: bool = False, tag: str = "",
                   label: Optional[str] = None) -> CommHandle:
        """``label``: what the messages are matched by where the transport tags them (default
        ``tag``; Note [exchange tags] in exchange_tags.py) -- one label for calls that must
        pair although their tags differ (the object exchanges' headers)."""
        check_flat("all_gather", tag, self.rank, output=output, input=input)
        if output.numel() != input.numel() * self.world_size:
            raise ValueError(
                f"fusedist all_gather{_tag(tag)}: output has {output.numel()} elements, expected "
                f"world_size ({self.world_size}) x input ({input.numel()})"
            )
        check_in_place("all_gather", output, input, self.rank, self.world_size)
        return self._launch("all_gather", tag, async_op, lambda: self._all_gather(output, input), label, part=input)

    def broadcast(self, tensor, src: int = 0, *, async_op: bool = False, tag: str = "") -> CommHandle:
        if not 0 <= src < self.world_size:
            raise ValueError(f"fusedist broadcast{_tag(tag)}: src={src} {self._outside_group()}")
        check_flat("broadcast", tag, self.rank, tensor=tensor)
        return self._launch("broadcast", tag, async_op, lambda: self._broadcast(tensor, src), part=tensor,
                            variant=f"from rank {src}")

    def gather(self, output, input, dst: int = 0, *, async_op: bool = False, tag: str = "") -> CommHandle:
        """Rank ``dst`` receives every rank's ``input`` into ``output`` (``world_size x input``,
        rank order); the other ranks pass ``output=None``. Why not an all-gather: consolidating
        sharded state on one rank should not make every rank receive (and hold) all of it."""
        if not 0 <= dst < self.world_size:
            raise ValueError(f"fusedist gather{_tag(tag)}: dst={dst} {self._outside_group()}")
        if (output is not None) != (self.rank == dst):
            raise ValueError(f"fusedist gather{_tag(tag)}: pass an output on rank dst={dst} only "
                             f"(this is rank {self.rank})")
        check_flat("gather", tag, self.rank, input=input, **({} if output is None else {"output": output}))
        if output is not None and output.numel() != input.numel() * self.world_size:
            raise ValueError(
                f"fusedist gather{_tag(tag)}: output has {output.numel()} elements, expected "
                f"world_size ({self.world_size}) x input ({input.numel()})"
            )
        return self._launch("gather", tag, async_op, lambda: self._gather(output, input, dst), part=input,
                            variant=f"to rank {dst}")

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, *,
                          async_op: bool = False, tag: str = "", label: Optional[str] = None) -> CommHandle:
        """``torch.distributed.all_to_all_single``: rank r sends its ``input_split_sizes[j]`` rows
        (along dim 0) to rank j and receives ``output_split_sizes[j]`` rows from rank j into
        ``output``, in rank order. A split list left None splits that tensor evenly. The
        expert exchange of a mixture-of-experts layer. Ranks whose splits disagree (rank i
        sends rank j other than j expects) time out, naming the pair, where gloo's own
        all-to-all terminates the process (Note [exchange tags] in exchange_tags.py)."""
        check_flat("all_to_all_single", tag, self.rank, output=output, input=input)
        out_splits = self._splits("output", output, output_split_sizes, tag)
        in_splits = self._splits("input", input, input_split_sizes, tag)
        if _row_numel(output) != _row_numel(input):
            raise ValueError(
                f"fusedist all_to_all_single{_tag(tag)}: output rows of shape {tuple(output.shape[1:])} and input "
                f"rows of shape {tuple(input.shape[1:])} differ in size (rank {self.rank})")
        if out_splits[self.rank] != in_splits[self.rank]:
            raise ValueError(
                f"fusedist all_to_all_single{_tag(tag)}: rank {self.rank} sends itself {in_splits[self.rank]} "
                f"rows (input_split_sizes[{self.rank}]) but receives {out_splits[self.rank]} from itself "
                f"(output_split_sizes[{self.rank}]); they must be equal")
        if _overlaps(output, input):
            raise ValueError(f"fusedist all_to_all_single{_tag(tag)}: output overlaps input (rank {self.rank}); "
                             "pass a separate output, as torch.distributed.all_to_all_single needs")
        return self._launch("all_to_all_single", tag, async_op,
                            lambda: self._all_to_all(output, input, out_splits, in_splits), label)

    def _splits(self, which: str, t: torch.Tensor, sizes, tag: str) -> list[int]:
        """Rows per rank of ``t`` (``which``: output or input): ``sizes`` checked, or even."""
        if t.dim() == 0:
            raise ValueError(f"fusedist all_to_all_single{_tag(tag)}: the {which} is a 0-dim tensor; "
                             "pass at least one dimension (the rows that are split)")
        rows = t.shape[0]
        if sizes is None:
            if rows % self.world_size:
                raise ValueError(
                    f"fusedist all_to_all_single{_tag(tag)}: the {which}'s {rows} rows (dim 0) do not split "
                    f"evenly over world_size {self.world_size} (rank {self.rank}); pass {which}_split_sizes")
            return [rows // self.world_size] * self.world_size
        sizes = [int(n) for n in sizes]
        if len(sizes) != self.world_size or min(sizes) < 0 or sum(sizes) != rows:
            raise ValueError(
                f"fusedist all_to_all_single{_tag(tag)}: {which}_split_sizes={sizes} on rank {self.rank} must "
                f"have world_size ({self.world_size}) non-negative entries summing to the {which}'s {rows} "
                "rows (dim 0)")
        return sizes

    def _all_to_all(self, output, input, output_splits: list[int], input_splits: list[int]):
        """Start the all-to-all (splits in rows); implementations that have one override this."""
        raise NotImplementedError(f"fusedist: the {self.name} communicator has no all_to_all_single")

    def _gather(self, output, input, dst: int):
        """Default for implementations without a rooted gather: an all-gather, into scratch
        on the ranks other than ``dst``."""
        if output is None:
            output = torch.empty(input.numel() * self.world_size, dtype=input.dtype, device=input.device)
        return self._all_gather(output, input)

    # ---- helpers
    # Note [collectives under torch.compile]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A compiled function (fullgraph=False) that calls a collective must run it as eager code
    # does. Traced by dynamo, the launch fails: the gloo exchange posts its messages through
    # the process group's own ``send``/``recv``, which dynamo sees as an opaque object with no
    # such members ("UnsafeScriptObjectError: ... Member 'send' is not registered"), and the
    # exchange's threads, events and deadlines are not graph material either. So the launch
    # and a handle's ``wait`` are never traced: the compiled function breaks its graph there
    # and the collective runs eagerly, with the values it would have in eager mode (under a
    # microsecond per call).
    @torch.compiler.disable
    def _launch(self, op: str, tag: str, async_op: bool, start, label: Optional[str] = None,
                part: Optional[torch.Tensor] = None, variant: Optional[str] = None) -> CommHandle:
        seq = self.last_seq = next(self._seq)
        self.last_op, self.last_tag = op, tag
        self.last_label = tag if label is None else label
        # A profiler range only while a profiler records: entering and leaving one costs more
        # than posting a small message, on every collective.
        profiling = torch.autograd._profiler_enabled()
        with torch.profiler.record_function(f"fusedist::{op}") if profiling else contextlib.nullcontext():
            try:
                work = start()
            except Exception as exc:  # noqa: BLE001
                if isinstance(exc, CollectiveError) and exc.seq >= 0:
                    # An earlier collective failed, found out after its wait had returned: the
                    # error names that one, and so does the stall report.
                    raise self._report_failure(exc) from None
                error = CollectiveError(
                    f"fusedist: launching {op}{_tag(tag)} (collective #{seq}) failed on rank "
                    f"{self.rank} of {self.world_size}{self._global_note([self.rank])}: {exc}",
                    op=op, tag=tag, rank=self.rank, seq=seq,
                )
                # [reliability] a launch failure is reported like a wait failure.
                failed = CommHandle(self, None, op=op, tag=tag, seq=seq, timeout=self.timeout)
                raise self._on_failure(failed, error) or error from exc
        handle = CommHandle(self, work, op=op, tag=tag, seq=seq, timeout=self.timeout)
        handle.async_op, handle.part, handle.variant = async_op, part, variant
        if async_op:
            self._progress_in_background(work)
        if self.observer is not None:
            self.observer.on_launch(self, handle)
        if not async_op:
            handle.wait()
        return handle

    def _report_failure(self, error: CollectiveError) -> BaseException:
        """The error to raise for a failure of the collective ``error`` names (its op, tag and
        sequence number), passed through the observer like a failed wait (a stall report)."""
        failed = CommHandle(self, None, op=error.op, tag=error.tag, seq=error.seq, timeout=self.timeout)
        return self._on_failure(failed, error) or error

    def _ended_under_collective(self) -> str:
        """Why the process group ended while a collective was in flight, when it was not the
        collective's fault ('' otherwise): a failed wait's error says so rather than timing out."""
        return ""

    def _on_failure(self, handle: CommHandle, error: BaseException) -> Optional[BaseException]:
        """Tell the observer; it may return the error to raise instead (a stall report)."""
        if self.observer is not None:
            return self.observer.on_failure(self, handle, error)
        return None
