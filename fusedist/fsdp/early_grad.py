"""A gradient reaching a unit's gathered parameter before its root's first forward: refused,
naming the parameter (Note [a gradient before the first forward]).

Note [a gradient before the first forward]
    ``block.unshard()`` before any forward puts the gathered parameters on the modules; a
    parameter used directly under grad then (``block.fc.weight.sum().backward()``, not through a
    call of its module) reaches the unit's gradient hook while no root exists yet: which units
    share an iteration, where its gradients go and when a backward ends are all set at the root's
    first forward. It failed with ``AttributeError: 'NoneType' object has no attribute
    'ensure_final_callback'``. torch's FSDP2 leaves such a gradient on its gathered parameter,
    where the next backward of the unit adds it, unannounced, to that backward's reduction.
    fusedist refuses it instead, naming the parameter and unit, and drops the gradient so the
    next step sees none of it. After the first forward a direct use is a backward like any: the
    end-of-backward callback reduces what it reached.
"""

from __future__ import annotations

__all__ = ["refuse_grad_before_forward"]


def refuse_grad_before_forward(unit, index: int) -> None:
    from .tree_names import unit_named

    for u in unit.unsharded:  # (what this backward left on them would join the next reduction)
        u.grad = None
    raise RuntimeError(
        f"fusedist.fully_shard: parameter '{unit.names[index]}' of {unit_named(unit)} got a gradient before the "
        "model's first forward: it was used directly (not through a call of its module) after unshard(). "
        "The gradient reduction of fully_shard is set up by the root's first forward; run a forward of the "
        "root first (one under torch.no_grad() is enough), or use the parameter inside its module's forward. "
        "The gradient was dropped.")
