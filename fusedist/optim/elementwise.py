"""Which optimizers can step slices of parameters (ZeRO's flat shards, fully_shard's pieces).

Note [elementwise optimizers only]
    ZeroRedundancyOptimizer hands its inner optimizer flat 1-D slices of the rank's shard (Note
    [flat partition] in fusedist/zero/partition.py), and an optimizer over a ``fully_shard``
    model steps each parameter's piece on this rank (Note [sharded parameters] in
    fusedist/fsdp/unit.py): a parameter is cut between ranks. An update that reads only the
    element's own gradient and state (SGD, Adam, AdamW, Adagrad, RMSprop, Lion, ...) is the
    same on a slice as on the whole tensor. One that reads a whole tensor -- LAMB's and LARS's
    per-tensor trust ratio, Adafactor's factored moments, Muon's and Shampoo's matrix shapes --
    would silently compute it per slice (measured: ZeRO with FusedLAMB 2.4e-3 off plain
    FusedLAMB after three steps, at one rank). DeepSpeed's ZeRO refuses LAMB for the same
    reason. So: the optimizers known to be elementwise are taken, those known not to be are
    refused with the reason, and any other class is taken with a warning naming the condition,
    once per class (custom elementwise optimizers are common). A class settles it by declaring
    ``_fusedist_elementwise = True`` (or ``False``, with ``_fusedist_not_elementwise_because``).
"""

from __future__ import annotations

import warnings

_TORCH_ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop",
                      "Rprop", "ASGD")
_TORCH_WHOLE_TENSOR = {"LBFGS": "it steps all parameters as one vector, with line searches over closures",
                       "SparseAdam": "it needs sparse gradients",
                       "Adafactor": "it keeps factored second moments, the row and column means of each whole "
                                    "matrix",
                       "Muon": "it orthogonalizes each whole 2-D update (Newton-Schulz iterations)"}
_warned: set = set()


def check_elementwise(optimizer_class, consumer: str, holds: str) -> None:
    """Refuse an optimizer that reads whole tensors; warn once about one of unknown kind (Note
    [elementwise optimizers only]). ``consumer`` names the caller in messages, ``holds`` what
    the optimizer is given (e.g. "flat slices of each rank's shard")."""
    name = getattr(optimizer_class, "__qualname__", repr(optimizer_class))
    declared = getattr(optimizer_class, "_fusedist_elementwise", None)
    reason = None
    if declared is False:
        reason = getattr(optimizer_class, "_fusedist_not_elementwise_because", "its update reads whole tensors")
    elif declared is None and (getattr(optimizer_class, "__module__", "") or "").startswith("torch.optim"):
        if optimizer_class.__name__ in _TORCH_ELEMENTWISE:
            return
        reason = _TORCH_WHOLE_TENSOR.get(optimizer_class.__name__)
    if reason is not None:
        raise ValueError(
            f"{consumer}: {name} cannot step {holds}: {reason}, and a parameter is cut between the ranks. "
            f"Use an elementwise optimizer (e.g. FusedAdamW), or {name} without sharding "
            "(fusedist.DistributedDataParallel)"
        )
    if declared is True or optimizer_class in _warned:
        return
    _warned.add(optimizer_class)
    warnings.warn(
        f"{consumer}: {name} steps {holds} (a parameter is cut between the ranks), which gives its own "
        "result only if its update is elementwise. An optimizer that reads whole tensors (per-tensor norms "
        "as in LAMB or LARS, shapes as in Adafactor, Muon or Shampoo) would be silently wrong; set "
        f"{name}._fusedist_elementwise = True to confirm it is elementwise (and silence this warning)",
        stacklevel=4,
    )
