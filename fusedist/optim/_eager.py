"""The fused optimizers' steps, the functional API and the clips under ``torch.compile``: run
eagerly, and say why.

Note [a fused step under fullgraph=True]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The steps and the functional API run eagerly inside compiled code (Note [the functional API
under torch.compile] in functional.py): their multi-tensor launches are already the fused form
of the update, and the launches cannot be traced; so do the clips, which look up gradient
holders and may all-reduce (torch_clip.py). Compiled without ``fullgraph`` that is a graph
break, invisible to the program. With ``fullgraph=True`` (or ``torch.export``), where torch's
own optimizers are captured, dynamo refuses the break, and without a reason its error said only
"Skip calling `torch.compiler.disable()`d function ... (reason: None) Hint: Remove the
`torch.compiler.disable` call" -- naming neither the fused optimizer nor a way out. The reason
given here is what that error shows instead. (An older torch takes no reason.)
"""

from __future__ import annotations

import functools
import inspect

import torch

STEP_REASON = (
    "a fusedist fused optimizer's step() runs eagerly under torch.compile (its multi-tensor kernel "
    "launches are already the fused step and cannot be traced), so fullgraph=True and torch.export "
    "cannot capture it; call optimizer.step() outside the compiled function, or compile without "
    "fullgraph=True (a graph break at the step)"
)
FUNCTIONAL_REASON = (
    "fusedist.optim.functional's multi-tensor updates run eagerly under torch.compile (their kernel "
    "launches cannot be traced), so fullgraph=True and torch.export cannot capture them; call them "
    "outside the compiled function, or compile without fullgraph=True (a graph break at the call)"
)
CLIP_REASON = (
    "fusedist.optim.clip_grad_norm_ runs eagerly under torch.compile (it looks up each parameter's "
    "gradient holder and may all-reduce the norm across ranks), so fullgraph=True and torch.export "
    "cannot capture it; clip outside the compiled function, or compile without fullgraph=True"
)
TORCH_CLIP_REASON = (
    "torch.nn.utils' gradient clipping is replaced by fusedist once a fully_shard unit or a stage-2 "
    "ZeroRedundancyOptimizer exists (so that it clips their sharded gradients by the global norm); over "
    "parameters they shard, or gradients given without their parameters (get_total_norm), the replacement "
    "runs eagerly under torch.compile (it looks up each parameter's gradient holder and may all-reduce), so "
    "fullgraph=True and torch.export cannot capture it; clip outside the compiled function, or compile "
    "without fullgraph=True (torch.nn.utils.clip_grad_norm_ / clip_grad_value_ over parameters nothing "
    "shards are torch's, captured whole)"
)

_TAKES_REASON = "reason" in inspect.signature(torch.compiler.disable).parameters


def eager_under_compile(reason: str):
    """``torch.compiler.disable`` carrying ``reason`` into dynamo's graph-break error (Note [a
    fused step under fullgraph=True])."""
    if _TAKES_REASON:
        return functools.partial(torch.compiler.disable, reason=reason)
    return torch.compiler.disable
