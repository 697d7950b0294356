"""ZeRO-Offload for ``ZeroRedundancyOptimizer(..., offload="cpu")``: the rank's FP32 master
shard and its Adam state live in host memory and are stepped there by the C++ CPU Adam.

Why it exists: for Adam, master weights and the two moments are 12 of the 16 bytes per
parameter a mixed-precision rank holds in stage 1/2. Keeping them on the host frees that
device memory; the cost is moving the gradient shard down and the parameter shard up, which
is hidden by overlapping the copies with backward and with the parameter all-gathers.

Note [offload pipeline]
    * Backward (stage 2): as soon as a bucket's reduce-scatter has been stored into the
      device gradient shard, its slice is copied device-to-host on a side stream (it waits for
      the compute stream first, so it sees the stored gradient) and an event records its
      completion; nothing waits for it until ``step()``. DDP finishes a bucket (waits for its
      collective and stores the result) in the first gradient hook after the collective has
      completed (Note [finishing buckets during backward] in ``fusedist/ddp/in_flight.py``), so
      the copies of early buckets are issued while backward is still computing the gradients
      of earlier layers and overlap that compute; only buckets whose collective is still in
      flight when the last gradient arrives are finished, and copied, at the end of backward.
      Stage 1 has no per-bucket hook here: its slices are copied at the start of ``step()``,
      all issued before the first update, so the copies of later buckets overlap the updates
      of earlier ones.
    * If the device gradient shard changed after its copy (e.g. a pending GradScaler unscale
      was materialized in place, or another backward accumulated into it), the tensor's
      version counter says so and ``step()`` copies that dtype's shard again.
    * ``step()`` reads found_inf / inv_scale / clip_coef on the host -- the CPU kernel needs
      them there, so unlike the device-side fused path this is a host synchronization (one
      copy of three numbers). Everything on the device stays asynchronous. An overflow (all
      ranks agree: the flag is all-reduced) skips the update, the copies up and the
      all-gathers; the parameters are unchanged, as with a skipped non-offloaded step.
    * The updates start in ``step()``, not during backward: the overflow flag and the clip
      coefficient depend on every bucket's gradient, and ``step()`` is where they are known.
      What overlaps backward is the copies down.
    * Per bucket, in the order gradients landed: wait for its copy down, run the CPU Adam on
      its segments (unscale and clip applied inline), copy the updated shard up (bf16/fp16
      parameters: the kernel writes the rounded copy into pinned staging in the same pass),
      then issue the bucket's all-gather. The CPU update of bucket k+1 overlaps the copy up
      and all-gather of bucket k.
    * Host buffers read by an asynchronous copy up are not written again until that copy
      has completed (its event is waited for before the bucket's next update, and before
      ``load_state_dict`` / ``sync_master_from_params`` overwrite masters).

With CPU "device" tensors (no GPU), every copy is a plain synchronous ``copy_`` and no
stream or event exists: the same code path, which is how CI tests it.
"""

from __future__ import annotations

import torch

from .. import _extension
from . import param_labels, trainable_check

OFFLOAD_CHOICES = (None, "none", "cpu")
HOST_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.complex64)
_HALF = (torch.bfloat16, torch.float16)


# Note [complex parameters offloaded]
#     The host kernel steps real FP32 elements. torch's Adam/AdamW step a complex parameter as
#     ``view_as_real`` of it and of its gradient and moments: every operation is elementwise
#     and the weight decay scales both parts alike, so stepping the real pairs is its math.
#     A complex64 shard therefore keeps complex64 host masters and gradients (and complex
#     moments, as torch's state dict holds them) and hands the kernel their real pairs; a
#     range ``[lo, hi)`` of complex elements is ``[2 lo, 2 hi)`` of the pairs. complex128
#     would need FP64 masters the kernel does not have, as float64 parameters do.
def host_master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the host masters and gradients of a ``dtype`` shard (Note [complex
    parameters offloaded])."""
    return torch.complex64 if dtype.is_complex else torch.float32


def _pairs(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernel reads it: a complex range as its flat real pairs, a real one as is."""
    return torch.view_as_real(t).view(-1) if t.is_complex() else t


def supported_optimizer_classes() -> tuple:
    from ..optim import FusedAdam, FusedAdamW
    return (FusedAdam, FusedAdamW, torch.optim.Adam, torch.optim.AdamW)


def check_offload_isa(zero) -> None:
    """Note [a forced ISA on every rank] in fusedist/optim/_cpu_adam.py. A collective, so the
    constructor makes it, where every rank is -- not the first read of ``.optim``, which builds the
    shards and which a rank may do alone."""
    from ..optim._cpu_adam import check_isa_on_every_rank

    check_isa_on_every_rank(zero.comm, zero._device, "ZeroRedundancyOptimizer(offload='cpu')")


def check_offload_config(optimizer_class, params: dict, name=None) -> None:
    """Raise a clear error for anything ``offload="cpu"`` cannot run. ``params``: each trainable
    parameter by its index in the optimizer's parameters (the index the error names); ``name(index)``:
    its name in the error after the dtype (:func:`param_labels.named`), or nothing."""
    supported = supported_optimizer_classes()
    if optimizer_class not in supported:
        names = ", ".join(f"{c.__module__}.{c.__name__}" for c in supported)
        raise TypeError(
            f"ZeroRedundancyOptimizer(offload='cpu') runs Adam/AdamW on the host with the C++ CPU "
            f"kernel; optimizer_class={getattr(optimizer_class, '__name__', optimizer_class)} is not "
            f"supported. Supported: {names}. Use offload=None for other optimizers."
        )
    for i, p in params.items():
        if p.dtype not in HOST_DTYPES:
            advice = ("; complex64 parameters are stepped as their real pairs (FP32); a complex128 or complex32 "
                      "one has no host format that keeps its precision: shard it with offload=None (on the "
                      "device, stepped as torch's Adam steps it)" if p.is_complex() else "")
            raise TypeError(
                f"ZeroRedundancyOptimizer(offload='cpu'): parameter {i} has dtype {p.dtype}{name(i) if name else ''}; "
                "the host Adam "
                f"supports float32, bfloat16, float16 and complex64 parameters (FP32 masters){advice}"
            )
    _extension.require("_cpu_ops")  # raises the build failure and how to rebuild


def check_offload_group(group: dict, index: int, constructing: bool = False) -> None:
    """Options of Adam that the host kernel does not implement raise instead of being ignored.
    (``foreach``/``fused`` only pick one of torch's implementations of the same math; with
    offload the host kernel replaces all of them.) ``capturable``: refused when the optimizer is
    ``constructing`` (asked for), taken in a loaded group (Note [a capturable group offloaded])."""
    for flag in ("amsgrad", "differentiable"):
        if group.get(flag):
            raise ValueError(
                f"ZeroRedundancyOptimizer(offload='cpu'), param group {index}: {flag}=True is not "
                "supported by the host Adam"
            )
    if constructing and group.get("capturable"):
        raise ValueError(
            f"ZeroRedundancyOptimizer(offload='cpu'), param group {index}: capturable=True asks for a step that "
            "can be captured in a CUDA graph; the offloaded step runs on the host (the C++ CPU Adam, which reads "
            "the GradScaler's found-inf flag there), which no CUDA graph captures. Build it with capturable=False "
            "(the same update; a state dict saved with capturable=True still loads), or use offload=None to keep "
            "the step on the device"
        )


# Note [a capturable group offloaded]
#     A state dict of torch's Adam/AdamW made with ``capturable=True`` (a CUDA-graph run) keeps
#     the flag in its groups and its step counts as fp32 tensors. It was refused here ("not
#     supported by the host Adam"), where torch's non-capturable optimizer and FusedAdam/
#     FusedAdamW load it (Note [a capturable state dict] in fusedist/optim/adam.py). The flag
#     says how the saving optimizer ran its step, not what it computes: the host Adam computes
#     that update, reading the step count once per piece. The groups keep the flag, so a state
#     dict saved again gives it back to a torch optimizer.
#     Construction is another matter: ``capturable=True`` there (in the defaults, a group, or a
#     ``functools.partial``) asks for a step that a CUDA graph can capture, and the offloaded step
#     cannot be captured (a host kernel, a host read of the overflow flag). It was taken
#     silently, and the failure came later, inside the user's graph capture, far from the cause;
#     torch's Adam over parameters it cannot capture refuses the flag too (at its first step,
#     naming the devices it supports). So the constructor refuses it, naming the group, as
#     FusedAdam/FusedAdamW refuse it when built; the load path keeps taking it.


def _adamw(optimizer_class, group: dict) -> bool:
    from ..optim import FusedAdamW
    return bool(group.get("decoupled_weight_decay", issubclass(optimizer_class, (FusedAdamW, torch.optim.AdamW))))


def group_hyperparameters(optimizer_class, group: dict, index: int) -> dict:
    """The host kernel's arguments for param group ``index``, checked for every group before
    the first bucket is updated. The kernel checks only the call it gets, one per bucket: a bad
    value (an lr a schedule made NaN, betas edited to 1.0) raised after earlier buckets had been
    stepped, and only on the ranks whose shard holds that group's pieces -- the others went on
    into an all-gather the failing rank never joined. Every rank holds the same groups, so all
    raise here, before anything changes."""
    from ..optim._cpu_adam import check_hyperparameters

    check_offload_group(group, index)
    hyper = dict(lr=float(group["lr"]), beta1=float(group["betas"][0]), beta2=float(group["betas"][1]),
                 eps=float(group["eps"]), weight_decay=float(group["weight_decay"]))
    try:
        check_hyperparameters(**hyper)
    except ValueError as e:
        raise ValueError(f"ZeroRedundancyOptimizer(offload='cpu'), param group {index}: {e}; nothing was "
                         "updated") from None
    return dict(hyper, adamw=_adamw(optimizer_class, group), maximize=bool(group.get("maximize", False)),
                bias_correction=bool(group.get("bias_correction", True)))


class HostShardOffload:
    """Host masters, host gradient staging and the per-bucket pipeline (Note [offload pipeline])
    for one :class:`ZeroRedundancyOptimizer`. Built with the shards at the first step, grown
    with them when parameters join (:meth:`grow`)."""

    def __init__(self, zero):
        # Parameters that joined since construction (unfrozen, ``add_param_group``) are checked
        # here, before any update: a float64 one failed in the kernel call after the buckets
        # before it had been stepped, so every failed step changed the parameters.
        check_offload_config(zero.optimizer_class, {i: zero._params[i] for i in zero._trainable},
                             lambda i: param_labels.named(zero, i))
        self.zero = zero
        part = zero._partition
        device = zero._device
        self.cuda = device.type == "cuda"
        pin = self.cuda
        self.masters = {dt: torch.empty(n, dtype=host_master_dtype(dt), pin_memory=pin)
                        for dt, n in part.shard_numel.items()}
        self.host_grads = {dt: torch.zeros(n, dtype=host_master_dtype(dt), pin_memory=pin)
                           for dt, n in part.shard_numel.items()}
        # bf16/fp16 parameters: the kernel writes the rounded master here (half the bytes up).
        # Zeros, not garbage: the bucket's whole slice goes up, padding included.
        self.staging = {dt: torch.zeros(n, dtype=dt, pin_memory=pin)
                        for dt, n in part.shard_numel.items() if dt in _HALF}
        self.d2h_stream = torch.cuda.Stream(device) if self.cuda else None
        self.h2d_stream = torch.cuda.Stream(device) if self.cuda else None
        self.d2h_done: dict[int, torch.cuda.Event] = {}
        self.h2d_done: dict[int, torch.cuda.Event] = {}
        self._copied: set[int] = set()  # buckets whose gradient was copied down since the last step
        self._copied_version: dict[torch.dtype, int] = {}
        self.segments: list[list[tuple[int, int, int]]] = []
        self.build_segments()

    def build_segments(self) -> None:
        """Per bucket shard: the (piece index, start, end) runs of the flat shard it covers.
        Rebuilt whenever pieces are split (Note [piece splitting] in ``partition.py``)."""
        part = self.zero._partition
        self.segments = []
        for bs in part.bucket_shards:
            lo, hi = bs.pos, bs.pos + bs.hi - bs.lo
            segs = []
            for k, piece in enumerate(part.pieces):
                if piece.dtype == bs.bucket.dtype and piece.start < hi and lo < piece.end:
                    segs.append((k, max(lo, piece.start), min(hi, piece.end)))
            self.segments.append(segs)

    # ------------------------------------------------------------------ growing
    @torch.no_grad()
    def grow(self) -> None:
        """The host buffers sized for the grown partition (Note [growing the partition] in
        ``grow.py``): the old masters, gradients and staging copied to their front, so the
        existing slices (and the Adam state of their pieces) stay where they are; the caller
        fills the new slices of the masters from the parameters. Every copy still reading or
        writing the old buffers is waited for first, and every gradient slice is copied down
        again at the next step (the device gradient shards were reallocated too)."""
        for event in self.d2h_done.values():
            event.synchronize()
        self.d2h_done.clear()
        self.wait_host_buffers()
        part = self.zero._partition
        self.masters = _regrown(self.masters, part, host_master_dtype, torch.empty, self.cuda)
        self.host_grads = _regrown(self.host_grads, part, host_master_dtype, torch.zeros, self.cuda)
        self.staging = _regrown(self.staging, part, None, torch.zeros, self.cuda, half_only=True)
        self._copied.clear()
        self._copied_version.clear()
        self.build_segments()

    # ------------------------------------------------------------------ gradients down
    def before_grad_write(self, bs) -> None:
        """The device gradient slice of ``bs`` is about to be overwritten: order that after
        its pending copy down (another backward before ``step()``)."""
        event = self.d2h_done.get(bs.bucket.index)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def grad_ready(self, bs) -> None:
        """Copy bucket ``bs``'s gradient slice down (asynchronously on CUDA)."""
        dt = bs.bucket.dtype
        n = bs.hi - bs.lo
        src = self.zero._grad_shards[dt][bs.pos:bs.pos + n]
        dst = self.host_grads[dt][bs.pos:bs.pos + n]
        if self.cuda:
            self.d2h_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.d2h_stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            self.d2h_done[bs.bucket.index] = event
        else:
            dst.copy_(src)
        self._copied.add(bs.bucket.index)
        self._copied_version[dt] = self.zero._grad_shards[dt]._version

    def _refresh_grads(self) -> None:
        """Copy down whatever is missing or changed since its copy (stage 1: everything)."""
        shards = self.zero._grad_shards
        part = self.zero._partition
        stale = {dt for dt, shard in shards.items() if self._copied_version.get(dt) != shard._version}
        for bs in part.bucket_shards:
            if bs.bucket.dtype in stale or bs.bucket.index not in self._copied:
                self.grad_ready(bs)

    # ------------------------------------------------------------------ step
    def _host_scalars(self):
        """found_inf, inv_scale, clip_coef as 1-element fp32 host tensors (or None)."""
        z = self.zero
        values = [trainable_check.with_skip(z, z.found_inf), z._effective_inv_scale(), z.step_context.clip_coef]
        present = [v.reshape(1).float() for v in values if v is not None]
        if not present:
            return None, None, None
        host = torch.cat([v.to(present[0].device) for v in present]).cpu()  # host sync (Note)
        out, k = [], 0
        for v in values:
            if v is None:
                out.append(None)
            else:
                out.append(host[k:k + 1].clone())
                k += 1
        return tuple(out)

    def _piece_states(self, pieces, stepped):
        """The inner optimizer's state of each piece this step updates, created in its own
        format if missing; returns the step number this update uses per piece (None for a
        skipped piece, whose state stays as it is -- or absent, as torch leaves it)."""
        inner = self.zero.inner
        steps = []
        for t, active in zip(pieces, stepped):
            if not active:
                steps.append(None)
                continue
            st = inner.state[t]
            if "step" not in st:
                st["step"] = torch.zeros((), dtype=torch.float32)
            for key in ("exp_avg", "exp_avg_sq"):
                if st.get(key) is None:
                    st[key] = torch.zeros_like(t, memory_format=torch.contiguous_format)
            steps.append(int(st["step"]) + 1)
        return steps

    @torch.no_grad()
    def step(self, stepped) -> None:
        """One optimizer step over every bucket (Note [offload pipeline]); issues the
        parameter all-gathers like ``ParamGatherer.publish`` (``gather.py``). Pieces with
        ``stepped[k]`` False (parameters without a gradient) are left unchanged, their step
        count included."""
        from ..optim._cpu_adam import adam_update

        z = self.zero
        part = z._partition
        fp = z._flat_params
        inner = z.inner
        self._refresh_grads()  # stage 1: ``step()`` just collected the slices into the shard
        found_inf, inv_scale, clip_coef = self._host_scalars()
        self._copied.clear()
        if found_inf is not None and float(found_inf) != 0.0:
            for event in self.d2h_done.values():
                event.synchronize()  # nothing may still write the host gradients
            self.d2h_done.clear()
            return  # every rank skips: found_inf was all-reduced
        hyper = [group_hyperparameters(z.optimizer_class, g, gi) for gi, g in enumerate(inner.param_groups)]
        steps = self._piece_states(z._pieces, stepped)
        states = [inner.state[t] if active else None for t, active in zip(z._pieces, stepped)]
        if self.cuda:
            # The copies up overwrite parameter slices that queued kernels may still read.
            self.h2d_stream.wait_stream(torch.cuda.current_stream())
        for bs, segs in zip(part.bucket_shards, self.segments):
            index, dt = bs.bucket.index, bs.bucket.dtype
            if self.cuda:
                self.d2h_done.pop(index).synchronize()
                previous_up = self.h2d_done.pop(index, None)
                if previous_up is not None:
                    previous_up.synchronize()  # last step's copy up still reading the host buffers
            master, grad = self.masters[dt], self.host_grads[dt]
            staging = self.staging.get(dt)
            for k, lo, hi in segs:
                if not stepped[k]:
                    if staging is not None:  # Note [staging of pieces a step skips]
                        staging[lo:hi].copy_(master[lo:hi])
                    continue
                piece = part.pieces[k]
                st = states[k]
                off_lo, off_hi = lo - piece.start, hi - piece.start
                adam_update(  # (complex ranges as their real pairs: Note [complex parameters offloaded])
                    [staging[lo:hi] if staging is not None else _pairs(master[lo:hi])], [_pairs(grad[lo:hi])],
                    [_pairs(st["exp_avg"][off_lo:off_hi])], [_pairs(st["exp_avg_sq"][off_lo:off_hi])],
                    [master[lo:hi]] if staging is not None else None,
                    step=steps[k], inv_scale=inv_scale, clip_coef=clip_coef,
                    **hyper[piece.group])
            self._copy_up(bs, staging if staging is not None else master)
            if z.world_size > 1:
                z._gatherer.gather(fp, bs)
        for st in states:
            if st is not None:
                st["step"] += 1
        if self.cuda and z.world_size == 1:
            torch.cuda.current_stream().wait_stream(self.h2d_stream)

    # Note [staging of pieces a step skips]
    #     A bucket's whole slice of the staging goes up, but the kernel writes only the pieces
    #     it steps. A piece a step skips (its parameter got no gradient) sent up what the
    #     staging held from its last update: uninitialized memory when it had none (the
    #     parameter turned NaN after a first step without its gradient), or the value before
    #     a ``model.load_state_dict`` / ``load_state_dict`` / ``sync_master_from_params`` had
    #     written the master (the parameter silently went back). torch leaves such a parameter
    #     as it is; its master rounded is exactly that value, so that is what goes up.
    def _copy_up(self, bs, source: torch.Tensor) -> None:
        n = bs.hi - bs.lo
        src = source[bs.pos:bs.pos + n]
        dst = self.zero._flat_params.shard_view(bs)
        if not self.cuda:
            dst.copy_(src)
            return
        with torch.cuda.stream(self.h2d_stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self.h2d_done[bs.bucket.index] = event
        # The all-gather (and any later kernel) reads the new slice: device-side wait only.
        torch.cuda.current_stream().wait_event(event)

    def wait_host_buffers(self) -> None:
        """Block until no copy up still reads the host masters / staging (before writing them)."""
        for event in self.h2d_done.values():
            event.synchronize()
        self.h2d_done.clear()

    # ------------------------------------------------------------------ accounting
    def host_bytes(self) -> dict:
        def size(d):
            return sum(t.numel() * t.element_size() for t in d.values())
        return {"master": size(self.masters), "gradient_staging": size(self.host_grads),
                "param_staging": size(self.staging)}


def _regrown(tensors: dict, part, dtype_of, alloc, pin: bool, half_only: bool = False) -> dict:
    """Host flat shards sized for ``part`` (in ``dtype_of(shard dtype)``, or each shard's own
    dtype for None; ``half_only``: for the bf16/fp16 shards only, as the staging), the old
    contents copied to their front."""
    out = {}
    for dt, n in part.shard_numel.items():
        if half_only and dt not in _HALF:
            continue
        t = alloc(n, dtype=dtype_of(dt) if dtype_of else dt, pin_memory=pin)
        previous = tensors.get(dt)
        if previous is not None:
            t[:previous.numel()].copy_(previous)
        out[dt] = t
    return out
