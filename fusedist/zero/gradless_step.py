"""A ZeroRedundancyOptimizer step in which no parameter has a gradient.

Note [a step without gradients]
    torch's ZeroRedundancyOptimizer calls its local optimizer's ``step()`` at every step, with or
    without gradients, and broadcasts the parameters after it. A step without any gradient (one
    after a backward that was skipped, a rank whose batch was empty) returned here before the
    inner optimizer: where the inner optimizer does something without gradients -- a hand-written
    one that decays every parameter or counts its steps in its param groups, the step hooks
    registered on ``optimizer.optim`` (``register_step_pre_hook`` / ``register_step_post_hook``), an
    LR scheduler built on it -- the run diverged from torch's. So the inner step runs here too, with
    every piece's gradient None (torch's optimizers skip such parameters, as they skip them in
    torch), and the groups take back what it wrote. The parameter all-gathers follow where the step
    may have changed the shards: always without a DDP model (another rank may hold gradients and
    gather: Note [gathers without gradients] below), and with one (every rank is here alike) unless
    the inner optimizer is one of torch's or fusedist's, which change nothing without gradients.
    A model frozen whole steps its inner optimizer too (it has no pieces): torch's local optimizer
    is stepped over the frozen parameters, so its step hooks run and an LR scheduler built on it
    finds its step; here both were skipped (a backbone frozen for its first steps: hooks counting
    fewer steps than torch's, the scheduler warning that it was stepped first, and the inner
    learning rate keeping the scheduler's writes that torch's step puts back from the groups).
    With ``offload="cpu"`` the host Adam changes nothing without gradients: the gathers alone.

Note [gathers without gradients]
    Without a DDP model the gradients are the caller's (e.g. torch's DDP), and another rank may
    hold some: it steps and all-gathers, and a rank returning at once left it waiting until the
    timeout (torch's ZeroRedundancyOptimizer broadcasts in every step too). With a DDP model every
    rank has the same gradients after a synchronized backward, so all of them agree. (With
    ``offload``: in the order the host step gathers, bucket by bucket as they are stepped, so that
    the ranks' all-gathers pair up.)
"""

from __future__ import annotations

from . import grad_agreement, group_sync

#: Packages whose optimizers change nothing where no parameter has a gradient.
_GRADIENT_DRIVEN = ("torch.", "fusedist.")


def step_without_grads(zero) -> None:
    """``zero.step()`` where no trainable parameter has a gradient (Note [a step without gradients])."""
    alone = zero.ddp is None and zero.world_size > 1  # (Note [gathers without gradients])
    if zero.offload:  # (set at construction; the host Adam itself is made at the first step)
        if alone:
            _gather(zero)
        return
    zero._ensure_state()
    _take_outside_writes(zero)
    group_sync.to_inner(zero.param_groups, zero.inner.param_groups)
    held = [(t, t.grad) for t in zero._pieces]
    for t, _ in held:
        t.grad = None  # the inner optimizer skips every piece, as torch skips grad=None
    try:
        zero._inner_step()
    finally:
        for t, grad in held:
            t.grad = grad
    group_sync.from_inner(zero.param_groups, zero.inner.param_groups)
    if alone or not _changes_nothing_without_grads(zero.inner):
        zero._gatherer.publish(zero._partition, zero._flat_params, zero._masters)
        zero._record_param_versions()
        grad_agreement.raise_carried(zero)


def _changes_nothing_without_grads(inner) -> bool:
    """Whether ``inner`` is one of torch's or fusedist's optimizers (not a subclass of one defined
    elsewhere): they skip every parameter without a gradient."""
    return type(inner).__module__.startswith(_GRADIENT_DRIVEN)


def _take_outside_writes(zero) -> None:
    """Parameters changed outside the optimizer go into the masters first (Note [parameters changed
    outside the optimizer] in shards.py)."""
    written = zero._params_written_outside()
    if written:
        zero._sync_masters_of(written)
    zero._sharded_state.unmatched.clear()  # Note [loaded masters that do not match the parameters]


def _gather(zero) -> None:
    """The parameter all-gathers alone, with this rank's slices as they are (Note [gathers without
    gradients])."""
    zero._ensure_state()
    _take_outside_writes(zero)
    if zero._offload is None:
        zero._gatherer.publish(zero._partition, zero._flat_params, zero._masters)
    else:
        for bs in zero._partition.bucket_shards:  # (HostShardOffload.step's order)
            zero._gatherer.gather(zero._flat_params, bs)
        if not zero.overlap_param_gather:
            zero.wait_for_params()
    zero._record_param_versions()
    grad_agreement.raise_carried(zero)  # (the fingerprints carried by these gathers)
