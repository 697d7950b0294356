"""Whole saved values loaded into a model whose parameters are DTensors (torch's ``fully_shard``,
tensor parallelism by ``parallelize_module``).

Note [a load into DTensor parameters]
    A load reads every parameter whole, on every rank. torch's ``load_state_dict`` copies a
    whole tensor into a DTensor parameter by failing ("got mixed torch.Tensor and DTensor"),
    after copying the plain entries before it: the model was left half loaded, and the
    optimizer's plain state could not step the DTensor parameters. Each such entry, and each of
    the optimizer's state tensors of a parameter's shape, is made a DTensor of the parameter's
    mesh and placements from the whole value this rank holds (``src_data_rank=None``: every rank
    cuts its own slice, no communication), as torch's ``set_state_dict`` of a full state dict
    does; the other state (``step``) stays plain, as torch's.
"""

from __future__ import annotations

import torch


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # (a build without distributed)
        return None
    return DTensor


def _placed(value: torch.Tensor, like) -> torch.Tensor:
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def model_state(target: torch.nn.Module, state: dict) -> dict:
    """``state`` (keys of ``target``'s ``state_dict``) with the whole values of its DTensor
    entries placed as those entries are."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return state
    current = target.state_dict(keep_vars=True)
    if not any(isinstance(v, dtensor) for v in current.values()):
        return state
    return type(state)((k, _placed(v, current[k]) if isinstance(current.get(k), dtensor)
                        and isinstance(v, torch.Tensor) and not isinstance(v, dtensor) else v)
                       for k, v in state.items())


def place_optimizer_state(optimizer) -> None:
    """The loaded state of each DTensor parameter of ``optimizer`` placed as the parameter."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, dtensor) or p not in optimizer.state:
                continue
            state = optimizer.state[p]
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and not isinstance(value, dtensor) and value.shape == p.shape:
                    state[key] = _placed(value, p)
