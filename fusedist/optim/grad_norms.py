"""Per-tensor norms of gradients that are spread over the ranks.

A logger's per-parameter gradient norms (Lightning's ``grad_norm``) over sharded gradients --
``fully_shard`` pieces, a ZeRO stage-2 optimizer's slices -- are each a reduction over the
ranks' parts. One all-reduce of one number per tensor gives them all; the gradient holders
that know which part is whose call this with their own communicator.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

__all__ = ["per_tensor_global_norms"]


@torch.no_grad()
def per_tensor_global_norms(parts: Sequence[Optional[torch.Tensor]], norm_type: float, device: torch.device,
                            all_reduce: Callable[[torch.Tensor, str], None]) -> torch.Tensor:
    """One float64 norm per entry of ``parts`` (on ``device``) over every rank's part of it:
    ``parts[i]`` is this rank's part of tensor ``i`` (None or empty where it holds none). Each
    rank takes the sum of ``|x|^p`` of its parts (the max of ``|x|`` for ``p = inf``) and
    ``all_reduce(t, op)`` combines them in place. A collective: every rank passes the same
    entries in the same order."""
    inf = norm_type == float("inf")
    partial = torch.zeros(len(parts), dtype=torch.float64, device=device)
    at = [i for i, t in enumerate(parts) if t is not None and t.numel()]  # (an empty part has no inf-norm)
    if at:
        local = torch._foreach_norm([parts[i] for i in at], norm_type)
        local = torch.stack([n.double() for n in local]).to(device)
        partial[torch.tensor(at, device=device)] = local if inf else local.pow(norm_type)
    all_reduce(partial, "max" if inf else "sum")
    return partial if inf else partial.pow(1.0 / norm_type)
