"""The gradients a pipeline step's division reaches, set aside at the step's beginning so the division
takes only the step's own part of them.

Note [accumulating over synchronized pipeline steps]
    torch's division at a step's end takes ``p.grad`` whole, what earlier steps left there
    included: two synchronized steps before one optimizer step (gradient accumulation, the
    way an unpipelined model accumulates two batches' ``backward()``) gave ``g1 / n + g2``,
    the first batch weighted ``n_microbatches`` times less than the second, silently (torch's
    stage alike, for every kind of stage module). A step with backward sets aside a copy of
    the gradients the division will reach (``p.grad``, ZeRO-2's shards) at its first
    forward, and after the division adds back what it took of them: ``g1 + g2``, as without
    pipelining. Under the user's own switch (Note [accumulating across pipeline steps]) the
    copy waits for the next synchronized step, whose division is then undone for it alone.
    The copy costs one gradient-sized buffer in a step that starts with gradients held; none
    when they were zeroed, to None or (``set_to_none=False``) to zeros: a gradient all zeros
    has nothing to give back, and one pass reading the gradients (their largest magnitudes)
    finds those, where a copy would write them and the give-back read them twice. That pass runs
    at the step's first forward, and its result is read, and the copies taken, at the step's first
    backward, the first pass that changes the gradients (a read at the forward made the host wait
    for the device there, every step); a step that raised before any backward reads nothing. A
    tensor no longer the gradient at the division (the user set the gradients to None meanwhile)
    gets nothing back; a step that raised before its division drops its copy, or puts the gradients back
    from it (Note [a step that raised] in step_failures.py). (A DDP stage's accumulating step
    after a synchronized one adds its undivided sum to the divided ``p.grad``: the copy taken
    before the accumulating step is what keeps the two apart.)


Note [several devices in one stage]
    The gradients a stage holds may live on several devices (a layer kept on the host, the others on an
    accelerator). The set-aside's one pass finding the gradients that are all zeros stacked every norm into
    one tensor, which raised at the step's first forward with norms on two devices; the norms are now
    stacked, compared and sent towards the host per device (an event per device where it is an
    accelerator), and read at the first backward as before (``_zero_flags``). A gradient with no values
    to read (``meta``) counts as one to copy.
"""

from __future__ import annotations

import torch

from ..fsdp.grad_view import ShardGrad


def _divided(module) -> list:
    """The gradients a step's division reaches: ``p.grad`` of the module's parameters, and the
    shards of ZeRO-2 optimizers over them (Note [gradients held outside p.grad] in __init__.py)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return grads + [g for holder in _holders_outside_grad(module) for g in holder._fusedist_unscale_targets()]


class _SetAside:
    """Gradients held at a step's first forward; which are all zeros (``zero_grad(set_to_none=False)``:
    nothing to keep, no copy) is measured there but read, and the others copied, only at the step's
    first backward, the first pass that changes them: a read at the forward waited for the device
    there, once per step."""

    def __init__(self, grads: list):
        self.grads, self._pairs = grads, None
        self._zero, self._pending = _zero_flags(grads)

    def pairs(self) -> list:
        """Each gradient with a copy of its value at the step's beginning, or None where all zeros."""
        if self._pairs is None:
            zero = list(self._zero)
            for where, flags, ready in self._pending:  # one measurement per device
                if ready is not None:
                    ready.synchronize()  # (the measurement only: recorded right after it)
                for i, flag in zip(where, flags.tolist()):
                    zero[i] = flag
            with torch.no_grad():
                self._pairs = [(g, None if z else g.clone()) for g, z in zip(self.grads, zero)]
        return self._pairs


_PLAIN = (torch.Tensor, ShardGrad)  # gradients measured as plain tensors


def _zero_flags(grads: list):
    """Whether each gradient is all zeros (NaN is not) -- None where measured on its device -- and the
    measurements: per device (Note [several devices in one stage]), the gradients' indices, their flags
    copied towards the host without waiting, and an event marking them there. One pass over the
    gradients, of any floating dtypes; a tensor of another kind (sparse, a subclass other than a
    ``fully_shard`` piece's ``ShardGrad``, a plain tensor to every op) counts as not all zeros, as does
    one with no values to read (meta)."""
    zero = [True if g.numel() == 0 else None if type(g) in _PLAIN and g.layout == torch.strided  # (an empty
            and g.is_floating_point() and g.device.type != "meta" else False for g in grads]  # shard holds nothing)
    by_device: dict = {}
    for i, (g, z) in enumerate(zip(grads, zero)):
        if z is None:
            by_device.setdefault(g.device, []).append(i)
    return zero, [_measured(where, [grads[i] for i in where]) for where in by_device.values()]


def _measured(where: list, dense: list) -> tuple:
    """Whether each of ``dense`` (tensors on one device) is all zeros: the flags on the way to the host."""
    flags = torch.stack([n.float() for n in torch._foreach_norm(dense, float("inf"))]) == 0
    if flags.device.type != "cuda":
        return where, flags.cpu(), None
    host, ready = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True), torch.cuda.Event()
    host.copy_(flags, non_blocking=True)
    ready.record(torch.cuda.current_stream(flags.device))
    return where, host, ready


def _give_back(module, held: list, factor: int) -> None:
    """Add back to each gradient held before the step the part of its earlier value the step's
    division took, where it is still a gradient the division reached."""
    current = {id(grad) for grad in _divided(module)}
    with torch.no_grad():
        for grad, before in held:
            if before is not None and id(grad) in current:
                grad.add_(before, alpha=1 - 1 / factor)


def _holders_outside_grad(module) -> list:
    """The distinct gradient holders of ``module``'s parameters that keep the gradients where
    ``p.grad`` is not (ZeRO stage 2's shards; a ``fully_shard`` shard is ``p.grad`` itself)."""
    from ..ownership import any_gradient_holder, gradient_holder

    found = {}
    for p in module.parameters() if any_gradient_holder() else ():
        holder = gradient_holder(p)
        in_user_view = getattr(holder, "_fusedist_grads_in_user_view", None)
        if in_user_view is not None and not in_user_view():
            found.setdefault(id(holder), holder)
    return list(found.values())
