"""The gradient side of a sharded unit: from the unsharded parameters' gradients to this
rank's gradient shard.

Note [unit gradients]
    When a unit's backward is over (every trainable unsharded parameter's gradient has been
    accumulated -- autograd accumulates a leaf once per backward, after all its uses, so a
    unit called twice, a tied weight or a checkpointed recompute are all counted once), its
    gradients are copied into one flat buffer laid out like the gathered trainable section
    (Note [trainable section] in layout.py: the whole unit unless some parameters are
    frozen; one per dtype in a unit of several, Note [dtype sections] in layout.py), in
    ``reduce_dtype``, and dropped from the unsharded parameters at once. One
    reduce-scatter (average) of that buffer leaves this rank's slice of the section, whose
    pieces become (or are added to, as torch accumulates) the sharded parameters' ``.grad``:
    views of one gradient shard per unit. Frozen parameters get neither buffer slots nor
    gradient storage; a unit with no trainable parameter issues no reduce-scatter.
    Reduce-scatters run asynchronously; each launch finishes those that have landed
    (oldest first) and, before allocating its buffers, waits for the oldest while
    ``MAX_IN_FLIGHT`` are pending (or the ``set_reduce_scatter_max_input_buffers`` cap);
    the end of backward finishes the rest.

    ``set_all_reduce_hook``: the hook gets the landed output (this rank's shard of the
    section, ``reduce_dtype``) before the division left after the sum and before the pieces'
    ``.grad`` are made from it, so an in-place change reaches the gradients -- FSDP2's point
    on a 1-D mesh. A hooked reduction is never finished early because it happened to land
    (that depends on timing): the oldest-first waits above and the end of backward finish
    it, at the same point of every rank's backward, so a hook may issue collectives.

    The average is taken as the sum of ``1/pre``-scaled gradients divided by ``post``
    afterwards, ``pre * post = world_size`` (Note [fp16 reduction] below), or the world size
    replaced by a ``set_gradient_divide_factor`` factor (``reduce_factors``); on HSDP the
    world size is the shard group's times the replicate group's (Note [replicate all-reduce]
    in replicate.py).

    ``set_requires_gradient_sync(False)``: no reduce-scatter; the flat buffer is kept as an
    accumulator (``reduce_dtype``; the size of the trainable section, unsharded) and the
    next synchronized backward adds its gradients to it and reduce-scatters the sum.

    Only parameters that received a gradient (this backward, or accumulated) get ``.grad``;
    the others' slots are zeros in the reduction and their ``.grad`` stays as it was, as with
    torch's FSDP2 (an optimizer then skips them).

Note [rank-independent reductions]
    Reduce-scatters pair up by issue order, so neither whether nor when a unit reduces may
    depend on which gradients this rank happened to get. Whether: a unit whose forward ran
    with gradients enabled reduces its trainable sections in every synchronized backward, also
    when no gradient reached it on this rank (zeros: another rank's gradients may be in the
    sum); under ``set_reduce_scatter_unused_params(True)`` so does one that did not run, once
    it has been gathered (``FullyShardState.reduces_unused_unit``). When: a unit's backward is
    over once all its parameters have their gradients, or
    at the end of backward if some never get one, and that differs between ranks; so the
    reduce-scatters are issued in one fixed order, the reverse of the units' first forward
    calls (``IterationContext.reduce_in_order`` in ``iteration.py``; a unit that is done waits,
    with its gradients, for the ones before it -- in the usual case backward finishes them
    in that order anyway). Which parameters get
    ``.grad`` from the result follows this rank's gradients (as torch's FSDP2: a parameter no
    gradient reached keeps ``grad=None``, and the optimizer skips it), so it must be the same
    set on every rank, or the ranks would step different pieces of one parameter: each
    reduction logs its set, and the per-step cross-rank check compares a digest of the
    backward's log (Note [stage-3 step check] in ``reliability/sharded_watch.py``), naming
    the parameters that had no gradient on some ranks.

    A unit that runs forward on every rank but whose *output* reaches the loss on some only
    (a data-dependent branch) is thus reduced on every rank at the same place of the order;
    under ``set_reduce_scatter_unused_params(True)`` its pieces get ``.grad`` on every rank
    (the skipping ranks' part of the sum is zeros), else the step check reports the
    differing gradient sets, naming that setting. torch's FSDP2 needs the setting too and
    still fails there: its root's final callback reduces such a unit after the others on
    the ranks that skipped it, so its reduce-scatter pairs with another unit's. The unit's
    backward all-gather pairs up because the unit after it prefetches it on every rank (the
    default backward prefetch), or it stayed gathered; an explicit backward prefetch list
    that leaves it out breaks that. Not covered: a unit whose *forward* runs on some ranks
    only (its forward all-gather is one-sided; FSDP2 hangs alike).

Note [fp16 reduction]
    An fp16 sum over N ranks overflows (65504) where the average would not. So an fp16
    ``reduce_dtype`` divides by ``pre`` (about sqrt(N), a power of two: exact) before the
    reduce-scatter and by ``post = N / pre`` after it -- in the shard's dtype when that is
    wider (FP32 master weights), so small gradients do not underflow on the way. ``pre`` is
    torch's FSDP2's (``fp16_divisors``, the rule DDP and ZeRO share), and
    a ``set_gradient_divide_factor`` factor F takes N's place: the sum divided by F. fp32 and
    bf16 reduce with ``avg`` (sum, then divide), whose range needs no split; with another
    factor, or ``set_force_sum_reduction_for_comms(True)``, with ``sum`` and a division by F
    after it (FSDP2's forced-sum path; its NCCL default for F != N, a PreMulSum by 1/F,
    rounds differently, within an ulp).

Note [bf16 reduction order]
    A bf16 ``reduce_dtype`` (or bf16 gradients and none) reduces as FSDP2 does: ``avg`` in
    bf16, no upcast -- each addition rounds to bf16, then the sum is divided. On gloo FSDP2
    calls gloo's own reduce-scatter (``ReduceOp.AVG``), whose order of additions is gloo's
    (at 3 ranks, small tensors: the other ranks in ring order, this rank's part last; other
    orders at other sizes); fusedist's gloo exchange adds in rank order (Note [exchange
    determinism] in comm/exchange_fold.py). Even one algorithm would not line up: the order
    depends on which rank an element's reduction lands on, and that differs (Note [row-aligned
    flat layout] in layout.py against FSDP2's per-parameter dim-0 chunks), on NCCL too.
    Matching FSDP2 bit for bit would take its layout (a copy-out after every all-gather).
    So at world size 2 (one addition: commutative; halving: exact) the results are
    bit-identical; at N >= 3 a reduced element may differ from FSDP2's by the rounding of
    the N - 1 additions, ``|diff| <= 2 (N - 1) 2**-8 sum_i |g_i| / N`` -- in practice a bf16
    ulp of the gradient, so one SGD step moves the weights apart by about ``lr * 2**-8 *
    |grad|`` (e.g. 5e-4 at lr 1 for gradients near 0.1). Compare against FSDP2 with that
    tolerance, or reduce in float32 (bf16 gradients of a few ranks add exactly there).
    fp32 reductions differ likewise at fp32's precision.
"""

from __future__ import annotations

import sys
import weakref
from typing import Optional

import torch

from .._dtypes import fp16_divisors
from .._dtypes import real_pairs
from .grad_view import as_shard_grad, note_reduced
from .memory import COUNTERS
from .replicate import start_across_replicas
from .tree_names import param_path

#: Reduce-scatters pending at once before the oldest is waited for (bounds the gradient
#: buffers alive during backward to this many units).
MAX_IN_FLIGHT = 2


def reduce_factors(world_size: int, dtype: torch.dtype, factor: Optional[float] = None,
                   force_sum: bool = False, replicas: int = 1) -> tuple[float, str, float]:
    """``(pre, op, post)``: reduce-scatter ``grads / pre`` with ``op`` (and on HSDP all-reduce
    the result across the ``replicas`` with ``op`` too), then divide by ``post``, so the result
    is the sum over all ranks divided by ``factor`` (default: the data-parallel size
    ``world_size * replicas``, an average). Why the split: Note [fp16 reduction]; HSDP: Note
    [replicate all-reduce] in replicate.py."""
    size = world_size * replicas
    if factor is None:
        factor = float(size)
    if dtype == torch.float16:
        pre, post = fp16_divisors(factor)
        return pre, "sum", post
    if factor == size and not force_sum:
        return 1.0, "avg", 1.0
    return 1.0, "sum", float(factor)


class PendingReduce:
    """A reduce-scatter in flight (of one section of a unit) and the buffers it needs until
    it has landed."""

    def __init__(self, grads: "UnitGrads", section: int, handle, output: torch.Tensor, input: torch.Tensor,
                 with_grad: list, post: float = 1.0, op: str = "sum"):
        self.grads, self.section, self.handle = grads, section, handle
        self.output, self.input, self.with_grad = output, input, with_grad
        self.post = post  # divisor still to apply to the output (Note [fp16 reduction])
        self.op = op  # the reduce-scatter's op, which the replicate all-reduce repeats
        # HSDP: all-reduced across replicas when finished, or kept as a partial sum (Note [replicate all-reduce])
        self.replicated = grads.replicate is not None
        self.all_reduce = self.replicated and grads.all_reduce_grads
        self.across = None  # HSDP: the all-reduce in flight, once started (``advance``)
        self.advanced = False
        self.hook = grads.all_reduce_hook  # the hook as set when the reduction was issued
        self.hook_stream = grads.all_reduce_hook_stream

    def __del__(self):
        """Collected still holding its buffers (a model dropped after an aborted backward, before
        a forward discarded its reductions): they leave the scratch count with it (Note [held
        gradient buffers of a dropped model]). At interpreter shutdown, or for an instance whose
        ``__init__`` did not finish, there is nothing to count: silent (Note [reductions
        collected at shutdown])."""
        counters = COUNTERS  # None once the interpreter has cleared this module's globals
        if counters is None or sys.is_finalizing():
            return
        for t in (getattr(self, "input", None), getattr(self, "output", None)):
            if t is not None:
                counters.add_scratch(-t.numel() * t.element_size())

    def ready(self) -> bool:
        """Landed, and may be finished now: a hooked or replicated reduction waits for its
        fixed point (Note [replicate all-reduce] in replicate.py)."""
        return self.hook is None and not self.replicated and self.handle.is_completed()


class UnitGrads:
    """Note [unit gradients] for one :class:`~fusedist.fsdp.unit.ShardedUnit`, section by
    section (Note [trainable section] in layout.py)."""

    def __init__(self, unit, reduce_dtype):
        self.unit = unit
        #: the policy's; None: the unit's gathered dtype as it is now (a module converted after
        #: sharding, ``model.double()``, reduces in its new dtype, as with FSDP2), and in a
        #: mixed-dtype unit each section's (Note [dtype sections] in layout.py)
        self.policy_reduce_dtype = reduce_dtype
        self.reduce_grads = True
        self.divide_factor = None  # set_gradient_divide_factor; None: the world size
        self.force_sum = False  # set_force_sum_reduction_for_comms
        self.reduce_unused = False  # set_reduce_scatter_unused_params: .grad for every trainable piece
        self.all_reduce_hook = None  # set_all_reduce_hook
        self.all_reduce_hook_stream = None
        #: HSDP (Note [replicate all-reduce] in replicate.py): the replicate group's communicator,
        #: whether to all-reduce across it (set_requires_all_reduce), and the partial sums kept
        #: while it is off (section -> (reduce-scattered sum, parameters with a gradient in it))
        self.replicate = getattr(unit, "replicate_comm", None)
        self.all_reduce_grads = True
        self._partial: dict[int, tuple[torch.Tensor, set]] = {}
        self._acc: dict[int, torch.Tensor] = {}  # section -> flat accumulator of unsynchronized backwards
        self._acc_with_grad: dict[int, set] = {}  # section -> parameters with a gradient in it
        # a model dropped with accumulators or partial sums frees them with it (Note [held
        # gradient buffers of a dropped model]): the same dicts, emptied in place, never replaced
        weakref.finalize(self, _free_held, self._acc, self._partial)

    def dtype_of(self, k: int) -> torch.dtype:
        """The dtype section ``k`` reduces in: the policy's ``reduce_dtype`` for a floating
        section, else its gathered dtype. A complex section keeps its own: a real
        ``reduce_dtype`` would drop the gradients' imaginary parts (FSDP2 keeps complex too
        where ``reduce_dtype`` equals ``param_dtype``, and fails on the cast otherwise)."""
        unit = self.unit
        dtype = unit.param_dtype if unit.param_dtype is not None else unit.section_param_dtype(k)
        if self.policy_reduce_dtype is not None and not dtype.is_complex:
            return self.policy_reduce_dtype
        return dtype

    def _sections(self, grads: list) -> list[int]:
        """The sections to reduce: those with a parameter that requires a gradient now (the
        flags every rank shares, not which gradients this rank happened to get) or with an
        accumulator. The frozen section of a partly frozen unit is not one of them."""
        unit = self.unit
        return [k for k, sec in enumerate(unit.layout.sections)
                if k in self._acc or any(unit.unsharded[i].requires_grad or grads[i] is not None for i in sec.indices)]

    @torch.no_grad()
    def _into_flat(self, k: int, grads: list):
        """Section ``k``'s unsharded gradients ``grads`` (by unit index, None where absent)
        added into its accumulator (taken), or copied into a fresh flat buffer laid out like
        the gathered section, whose other slots and padding are zero."""
        sec = self.unit.layout.sections[k]
        if sec.chunked:
            return self._into_chunked_flat(k, grads)
        slots = sec.layout.slots
        present = [j for j, i in enumerate(sec.indices) if grads[i] is not None]
        flat = self._acc.pop(k, None)
        views = [flat[s.offset:s.offset + s.numel].view(s.shape) for s in slots] if flat is not None else None
        if flat is None:
            flat = torch.empty(sec.layout.total_numel, dtype=self.dtype_of(k), device=self.unit.device)
            COUNTERS.add_scratch(flat.numel() * flat.element_size())
            for a, b in sec.layout.gaps():
                flat[a:b].zero_()
            views = [flat[s.offset:s.offset + s.numel].view(s.shape) for s in slots]
            for j, i in enumerate(sec.indices):
                if grads[i] is None:
                    views[j].zero_()
            if present:
                torch._foreach_copy_([views[j] for j in present], [grads[sec.indices[j]] for j in present])
        elif present:
            # added as they are, not cast first: a gradient wider than ``reduce_dtype`` (fp32
            # parameters, a bf16 reduce) then rounds once, in the sum, as FSDP2's ``+=`` does
            torch._foreach_add_([views[j] for j in present], [grads[sec.indices[j]] for j in present])
        return flat, {sec.indices[j] for j in present}

    @torch.no_grad()
    def _into_chunked_flat(self, k: int, grads: list):
        """:meth:`_into_flat` for a dim-sharded section: each gradient copied (or added) into its
        chunks' places, so the reduce-scatter hands each rank its chunk on the parameter's dim
        (Note [dim-sharded sections] in chunk_layout.py)."""
        sec = self.unit.layout.sections[k]
        present = [j for j, i in enumerate(sec.indices) if grads[i] is not None]
        flat = self._acc.pop(k, None)
        add = flat is not None
        if flat is None:
            flat = torch.zeros(sec.layout.total_numel, dtype=self.dtype_of(k), device=self.unit.device)
            COUNTERS.add_scratch(flat.numel() * flat.element_size())
        for j in present:
            sec.layout.copy_in(flat, j, grads[sec.indices[j]], add=add)
        return flat, {sec.indices[j] for j in present}

    def accumulate(self, grads: list) -> None:
        """An unsynchronized backward: add into the accumulators."""
        if not any(g is not None for g in grads):
            return
        for k in self._sections(grads):
            self._acc[k], present = self._into_flat(k, grads)
            self._acc_with_grad.setdefault(k, set()).update(present)

    def reduce(self, grads: list, pending: list, log: list, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        """Start the reduce-scatter of each section's ``grads`` (plus its accumulator) and queue
        it, with at most ``max_in_flight`` pending; note in ``log`` which parameters had a
        gradient (Note [rank-independent reductions]). On HSDP the reductions queued before
        start their all-reduce first (Note [replicate all-reduce] in replicate.py)."""
        unit = self.unit
        for p in pending:
            if p.replicated and not p.advanced:
                advance(p)
        for k in self._sections(grads):
            while len(pending) >= max_in_flight:  # the cap holds for the buffers this call allocates too
                finish(pending.pop(0))
            flat, present = self._into_flat(k, grads)
            with_grad = sorted(self._acc_with_grad.pop(k, set()).union(present).union(self._unused(k)))
            log.append((unit.label, k, tuple(with_grad),
                        [param_path(unit, i) for i in unit.layout.sections[k].indices
                         if unit.unsharded[i].requires_grad and i not in with_grad]))
            out = torch.empty(unit.layout.sections[k].layout.shard_numel, dtype=flat.dtype, device=unit.device)
            COUNTERS.add_scratch(out.numel() * out.element_size())
            pre, op, post = reduce_factors(unit.world_size, flat.dtype, self.divide_factor, self.force_sum,
                                           self.replicas)
            if pre != 1.0:  # Note [fp16 reduction]
                flat.div_(pre)
            handle = unit.comm.reduce_scatter(real_pairs(out), real_pairs(flat), op=op, async_op=True,
                                              tag=f"fully_shard grads {unit.label}")
            pending.append(PendingReduce(self, k, handle, out, flat, with_grad, post, op))
        self._acc.clear()
        self._acc_with_grad.clear()
        while pending and pending[0].ready():
            finish(pending.pop(0))  # the landed ones free their buffers at once

    def _unused(self, k: int) -> set:
        """Under ``set_reduce_scatter_unused_params(True)``, section ``k``'s trainable parameters,
        which all get ``.grad`` from the reduction (zeros in this rank's part where it had no
        gradient); otherwise none beyond those with a gradient."""
        if not self.reduce_unused:
            return set()
        return {i for i in self.unit.layout.sections[k].indices if self.unit.unsharded[i].requires_grad}

    @property
    def replicas(self) -> int:
        """The replicate group's size (1 without HSDP)."""
        return self.replicate.world_size if self.replicate is not None else 1

    def keep_partial(self, section: int, out: torch.Tensor, with_grad) -> None:
        """Add a reduce-scattered but not all-reduced output to section ``section``'s partial
        sum (Note [replicate all-reduce] in replicate.py); its scratch stays counted."""
        kept = self._partial.get(section)
        if kept is None:
            self._partial[section] = (out, set(with_grad))
            return
        kept[0].add_(out)
        kept[1].update(with_grad)
        COUNTERS.add_scratch(-out.numel() * out.element_size())

    def take_partial(self, section: int):
        """Section ``section``'s partial sum and its parameters with a gradient, or None."""
        return self._partial.pop(section, None)

    @property
    def accumulator_bytes(self) -> int:
        return _held_bytes(self._acc, self._partial)

    def drop_accumulator(self) -> None:
        COUNTERS.add_scratch(-self.accumulator_bytes)
        self._acc.clear()
        self._acc_with_grad.clear()
        self._partial.clear()


# Note [held gradient buffers of a dropped model]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The accumulators of unsynchronized backwards (set_requires_gradient_sync(False)) and HSDP's
# partial sums (set_requires_all_reduce(False)) are scratch that outlives a backward, and so are
# the buffers of reductions a backward that raised left listed until the next forward discards
# them (Note [aborted backward] in recovery.py): a model dropped while it holds them frees them
# with it, and memory_stats()' process-wide ``scratch_bytes`` must then drop too, or every
# later model reports them (as gathered bytes of a collected unit are given back, memory.py).
#
# Note [reductions collected at shutdown]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A script that ends after a backward that raised (or exits from a hook mid-backward) leaves its
# reductions listed; they are collected while the interpreter shuts down, when module globals may
# already be None, and an error in ``__del__`` is printed as "Exception ignored in ..." after the
# script's own output. The counts are process-wide and the process is ending: nothing to update.
def _held_bytes(acc: dict, partial: dict) -> int:
    """Bytes of a unit's accumulators ``acc`` and partial sums ``partial``."""
    return (sum(a.numel() * a.element_size() for a in acc.values())
            + sum(t.numel() * t.element_size() for t, _ in partial.values()))


def _free_held(acc: dict, partial: dict) -> None:
    """The unit's gradients were collected: what they held leaves the scratch count."""
    COUNTERS.add_scratch(-_held_bytes(acc, partial))
    acc.clear()
    partial.clear()


def _land(p: PendingReduce) -> None:
    """Wait for ``p``'s reduce-scatter (once) and free its input buffer."""
    if p.input is None:
        return
    p.handle.wait()
    COUNTERS.add_scratch(-p.input.numel() * p.input.element_size())
    p.input = None


@torch.no_grad()
def advance(p: PendingReduce) -> None:
    """HSDP: ``p``'s reduce-scatter has landed (waited for here); start its all-reduce across
    the replicas, or keep its output as a partial sum (Note [replicate all-reduce] in
    replicate.py)."""
    _land(p)
    p.advanced = True
    p.output, p.across = start_across_replicas(p, p.output)


@torch.no_grad()
def finish(p: PendingReduce) -> None:
    """Wait for a reduce-scatter (and on HSDP its all-reduce) and store its output as (or add
    it to) the pieces' ``.grad``: each piece's gradient is at the piece's offset in its
    section's shard."""
    unit = p.grads.unit
    if p.replicated:  # Note [replicate all-reduce] in replicate.py
        if not p.advanced:
            advance(p)
        if p.output is None:  # kept as a partial sum: no .grad yet, its scratch stays counted
            return
        p.across.wait()
    else:
        _land(p)
    out = p.output
    if p.hook is not None:
        _run_hook(p.hook, out, p.hook_stream)
    dtype = unit.section_dtype(p.section)  # the shard's (Note [dtype sections] in layout.py)
    if p.post != 1.0:  # Note [fp16 reduction]: on the device, in the shard's dtype
        out = out.to(dtype) if out.dtype != dtype else out
        out.div_(p.post)
    if out.dtype != dtype or out.device != unit.shard_device:
        out = _to_shard_device(unit, out, dtype)
    base = unit.layout.sections[p.section].shard_base
    note_reduced(unit)  # Note [gradients read as DTensors] in grad_view.py
    for i in p.with_grad:
        # (a parameter frozen since unsynchronized backwards gave it gradients is one of them:
        # those gradients become its .grad, as FSDP2's and an unsharded model's keep them)
        sp = unit.sharded[i]
        piece = unit.layout.piece(i, unit.rank)
        a = piece.shard_offset - base
        view = out[a:a + piece.numel].view(piece.shape)
        if sp.grad is None:
            sp.grad = as_shard_grad(view)  # Note [gradients read as DTensors] in grad_view.py
        else:
            wait_host_copies(unit)  # the host adds: the copy must have landed
            sp.grad.add_(view)
        _run_grad_hooks(unit, sp)
    COUNTERS.add_scratch(-p.output.numel() * p.output.element_size())
    p.output = None


# Note [the user's gradient hooks on pieces]
#     Autograd never accumulates into a piece (forward and backward use the unsharded
#     parameters), so a ``register_post_accumulate_grad_hook`` on a parameter after sharding --
#     the optimizer-in-backward recipe, a per-parameter clip or scale -- would never run, and
#     the model would silently not train. FSDP2 calls the hooks of its sharded parameter right
#     after the reduced gradient is stored as (or added to) its ``.grad``, once per reduction
#     (not in unsynchronized backwards); so does ``finish``, with that rank's piece's ``.grad``.
def _run_grad_hooks(unit, sp) -> None:
    """The post-accumulate-grad hooks registered on piece ``sp``, on its reduced ``.grad``
    (Note [the user's gradient hooks on pieces]); an offloaded gradient has landed first."""
    hooks = getattr(sp, "_post_accumulate_grad_hooks", None)
    if not hooks:
        return
    wait_host_copies(unit)  # the hook reads .grad on the host
    note_reduced(unit)  # (a gradient stored since the reduction began: the hook may read it as a DTensor's)
    for hook in list(hooks.values()):
        hook(sp)


# Note [offloaded gradients land before backward returns]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# With CPUOffloadPolicy on a GPU a reduced gradient goes to host memory by a non-blocking
# device-to-host copy, so the host keeps queueing backward's kernels. Until that copy lands the
# host ``.grad`` holds nothing meaningful: what reads or writes it -- torch's clip, a scaler's
# inf check, the optimizer's step on the host, code editing gradients -- must come after it
# (an H200 run lost an inf written into such a gradient: the copy landed on top of it). So
# each copy records an event, the end of backward waits for all of them, as FSDP2 does, and a
# host-side accumulation waits before it adds.
def _to_shard_device(unit, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out`` in the shard's dtype on the shard's device; an offloaded unit's copy from a GPU
    is non-blocking and tracked (Note [offloaded gradients land before backward returns])."""
    copy_to_host = unit.offload and out.device.type == "cuda"
    moved = out.to(device=unit.shard_device, dtype=dtype, non_blocking=copy_to_host)
    if copy_to_host:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(out.device))
        unit.host_copies.append(event)
    return moved


def wait_host_copies(unit) -> None:
    """Block until the unit's gradient copies to host memory have landed."""
    while unit.host_copies:
        unit.host_copies.pop(0).synchronize()


def _run_hook(hook, out: torch.Tensor, stream) -> None:
    """``hook(out)``, on ``stream`` when one was given for a CUDA output: the stream waits
    for the reduction, and the gradients' use of ``out`` waits for the hook."""
    if stream is None or out.device.type != "cuda":
        hook(out)
        return
    current = torch.cuda.current_stream(out.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        hook(out)
    current.wait_stream(stream)


def finish_all(pending: list) -> None:
    while pending:
        finish(pending.pop(0))


def discard_all(pending: list) -> None:
    """Wait for the reductions in flight and drop their results (an aborted iteration):
    their buffers are the communicator's until they land."""
    while pending:
        p = pending.pop(0)
        try:
            if p.input is not None:
                p.handle.wait()
            if p.across is not None:
                p.across.wait()
        finally:
            if p.input is not None:
                COUNTERS.add_scratch(-p.input.numel() * p.input.element_size())
            if p.output is not None:  # (an output kept as a partial sum is the partial sum's)
                COUNTERS.add_scratch(-p.output.numel() * p.output.element_size())
            p.input = p.output = None
