"""What a fused optimizer's step skipped by the scaler must not do: run the closure or the
optimizer's own step hooks.

# Note [a skipped step runs no step hooks]
torch's scaler skips an overflowed step of an unfused optimizer by not calling ``step`` at all,
so the hooks registered on that optimizer (``register_step_pre_hook`` /
``register_step_post_hook``: an EMA of the weights, a step counter, a log line) do not run for
it. A fused optimizer is called anyway and skips on the device (Note [scaler protocol] in
grad_scaler.py), so its hooks ran on every skipped step: an EMA took one more decay towards
unchanged weights, a counter counted steps that did not happen. When such an optimizer has hooks
of its own, the flag is read on the host (the one sync, as for a closure: Note [a skipped step
runs no closure]) and a skipped step runs with them set aside. As with the LR scheduler's flag
(Note [a skipped step and the LR scheduler] in fusedist/optim/_scaler_protocol.py), a param group
built with ``fused=True`` behaves as torch's fused optimizers, which the scaler calls anyway, and
so runs its hooks. torch's *global* step hooks (``register_optimizer_step_pre_hook``) still run
on a skipped fused step, as for torch's fused optimizers: fusedist installs such hooks itself,
and reading the flag for them would make every step wait for the device.

A ``step`` the program set on the optimizer object itself, wrapping the class's, is such code
too: accelerate's ``AcceleratedOptimizer`` sets one that notes the step was called, and reads a
step that was not as an overflow (``step_was_skipped``, which holds back its LR scheduler's
step). Under torch's scaler a skipped step never calls it; here, where the optimizer owns the
protocol itself (its class's ``step`` is then the fused step), a skipped step calls the class's
``step`` with the wrapper set aside (the flag read on the host, as for hooks). The ``step`` of an
optimizer handed over to another (Note [the protocol of a handed-over optimizer] in
fusedist/optim/_scaler_protocol.py) is its real step and stays. torch's LR scheduler's own
wrapper is not such code (Note [a skipped step and the LR scheduler]), nor is the plain bound
method a wrapper puts back after its step.
"""

from __future__ import annotations

import contextlib

_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")


def _own(optimizer) -> dict:
    """The attributes an object holds itself (a wrapper forwards the others to what it wraps)."""
    return getattr(optimizer, "__dict__", {})


def _own_hooks(optimizer) -> bool:
    return any(_own(optimizer).get(name) for name in _HOOKS)


def _own_step_wrapper(optimizer) -> bool:
    """Whether ``optimizer`` holds a ``step`` of its own that wraps the class's (Note [a skipped
    step runs no step hooks]): not torch's LR scheduler's, nor the class's bound method put back."""
    step = _own(optimizer).get("step")
    if step is None or getattr(step, "_wrapped_by_lr_sched", False):
        return False
    bound_plain = getattr(step, "__self__", None) is optimizer and \
        getattr(step, "__func__", None) is getattr(type(optimizer), "step", None)
    return not bound_plain


def has_own_step_hooks(optimizer, owner) -> bool:
    """Whether a skipped step of ``optimizer`` (whose protocol ``owner`` holds the groups) would
    run hooks or a step wrapper that torch's scaler does not run (Note [a skipped step runs no
    step hooks])."""
    own = _own_hooks(optimizer) or (owner is optimizer and _own_step_wrapper(optimizer))
    if not (own or (owner is not optimizer and _own_hooks(owner))):
        return False
    return not built_fused(owner)


def built_fused(owner) -> bool:
    """Whether a param group of ``owner`` was built with ``fused=True``: a skipped step then does
    what torch's fused optimizers do under torch's scaler (runs hooks and closure)."""
    return any(group.get("fused") for group in getattr(owner, "param_groups", ()))


@contextlib.contextmanager
def own_step_hooks_off(*optimizers):
    """Within the block, the step hooks registered on ``optimizers`` are set aside (kept, and put
    back after it: their removable handles stay valid), and so is a step wrapper of the one
    optimizer given when it owns the protocol (its class's ``step`` then is the fused step)."""
    kept = []
    if all(o is optimizers[0] for o in optimizers) and _own_step_wrapper(optimizers[0]):
        kept.append((optimizers[0], "step", _own(optimizers[0]).pop("step")))
    for optimizer in {id(o): o for o in optimizers}.values():
        for name in _HOOKS:
            hooks = _own(optimizer).get(name)
            if hooks:
                kept.append((optimizer, name, hooks))
                setattr(optimizer, name, type(hooks)())
    try:
        yield
    finally:
        for optimizer, name, hooks in kept:
            setattr(optimizer, name, hooks)
