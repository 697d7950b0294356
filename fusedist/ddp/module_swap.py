"""``model.module = ...`` on a wrapper that is already built.

Note [the wrapped module replaced]
    The gradient hooks, the buckets, the step check and the assignment tracking (Note [parameters
    replaced after wrapping] in trainable.py) follow the Parameters the module held when it was
    wrapped. Assigning another module to the wrapper's ``module`` attribute registers it into the
    wrapper, which no tracker follows: the forward then ran the new module, whose Parameters had no
    hook, and each rank trained on its own gradients, the ranks drifting apart without an error
    (torch's DDP trains so too). A module holding the same Parameters -- ``torch.compile(model.module)``,
    or a thin module around the old one -- changes nothing the engine follows and is taken: the tree
    is then read as a changed one (Note [submodules written without the registration hook] in
    module_tree.py), so a buffer the new module brings is broadcast with the others, an assignment
    into it is followed and the parameters take their new paths. Any other is refused at the
    assignment, naming the parameters that differ.
"""

from __future__ import annotations

from torch import nn

from .._rank import this_rank

__all__ = ["swap_module"]


def swap_module(wrapper, new, assign) -> None:
    """``assign("module", new)`` unless ``new`` holds other Parameters than the module it replaces
    (Note [the wrapped module replaced]); then the tree the wrapper follows is read again."""
    old = wrapper._modules.get("module")
    old_named = dict((id(p), n) for n, p in old.named_parameters()) if old is not None else {}
    new_named = (dict((id(p), n) for n, p in new.named_parameters()) if isinstance(new, nn.Module) else {})
    added = [n for i, n in new_named.items() if i not in old_named]
    gone = [n for i, n in old_named.items() if i not in new_named]
    if not isinstance(new, nn.Module) or added or gone:
        what = [f"{len(added)} parameter(s) the wrapper was not built with: {added[:5]}" if added else "",
                f"{len(gone)} of the wrapped parameters missing: {gone[:5]}" if gone else ""]
        raise ValueError(
            f"fusedist.DistributedDataParallel (rank {this_rank()}): model.module was replaced after wrapping "
            f"by a {type(new).__name__} that does not hold the wrapped module's parameters "
            f"({'; '.join(w for w in what if w) or 'not a module'}). The gradient hooks and buckets follow the "
            "Parameters the module held when it was wrapped: the new ones would train on this rank's gradients "
            "alone. Wrap the new module instead (model = fusedist.DistributedDataParallel(new_module, ...)); a "
            "module holding the same parameters, such as torch.compile(model.module), may replace it"
        )
    assign("module", new)
    wrapper.reducer.tracker.tree_replaced()
