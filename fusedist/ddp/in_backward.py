"""torch's optimizer in backward (``torch.distributed.optim._apply_optimizer_in_backward``) under DDP.

Note [optimizers applied in backward]
    ``_apply_optimizer_in_backward(cls, params, kwargs)`` gives each parameter its own optimizer
    (``p._in_backward_optimizers``) and a hook on its AccumulateGrad node that steps it and sets
    ``p.grad = None`` -- on the gradient just accumulated, this rank's own. torch's DDP takes those
    parameters over at its first forward: it removes the hooks and steps the optimizers once a
    bucket's average has landed (a communication hook), then sets their gradients to None at the
    end of the synchronized backward. Here the hooks ran as registered, right after the reducer's
    own hook and before the average: each rank would step with its local gradient, and the step
    guard stopped the first backward ("step() was called from inside a backward pass ... call
    optimizer.step() after loss.backward() returns"), where torch trains.

    So the reducer takes the parameters over the same way, at its first training forward: the
    hooks are removed, and a synchronized backward, once every bucket is averaged, steps each
    taken parameter's optimizers and sets its gradient to None. Each optimizer holds one
    parameter, so stepping after the last bucket rather than bucket by bucket gives torch's
    values; ``no_sync`` backwards accumulate and step nothing, as under torch's DDP.

    With ``find_unused_parameters=True`` the step is that of ``optimizer.step()`` after
    ``backward()`` and ``zero_grad()``: a parameter no rank used has no gradient and is not
    stepped. torch's hook differs there (measured with its stream calls stubbed on CPU, 2 ranks):
    without gradient views it steps such a parameter with a zero gradient (weight decay and
    momentum move it); with ``gradient_as_bucket_view=True`` a rank that did not use a parameter
    another rank used skips its step while the other steps, and the ranks' weights diverge.
"""

from __future__ import annotations


def take_in_backward_optimizers(params) -> list:
    """The parameters of ``params`` given optimizers by ``_apply_optimizer_in_backward``, with the
    hooks that would step them on the local gradient removed (Note [optimizers applied in backward])."""
    taken = [p for p in params if getattr(p, "_in_backward_optimizers", None)]
    if not taken:
        return taken
    from torch.distributed.optim.apply_optimizer_in_backward import param_to_optim_hook_handle_map

    for p in taken:
        for handle in param_to_optim_hook_handle_map.get(p, []):
            handle.remove()
    return taken


def step_in_backward_optimizers(params: list) -> None:
    """Step the optimizers of ``params`` on their averaged gradients, then drop the gradients, as
    torch's DDP does after a synchronized backward (Note [optimizers applied in backward])."""
    for p in params:
        for optimizer in p._in_backward_optimizers:
            optimizer.step()
    for p in params:
        p.grad = None
