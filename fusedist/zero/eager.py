"""Why ZeroRedundancyOptimizer's step and clip run eagerly under ``torch.compile``: the reasons
dynamo shows where ``fullgraph=True`` or ``torch.export`` meets them (Note [a compiled step runs
eagerly] in optimizer.py; Note [a fused step under fullgraph=True] in ``fusedist/optim/_eager.py``).
Without a reason dynamo's error said only "wrapped with `torch.compiler.disable` (reason: None)
Hint: Remove the `torch.compiler.disable` call", naming neither the optimizer nor a way out."""

from __future__ import annotations

from ..optim._eager import eager_under_compile

STEP_REASON = (
    "fusedist.ZeroRedundancyOptimizer.step() runs eagerly under torch.compile (its collectives, the "
    "parameter all-gathers among them, go through fusedist's communicator, which cannot be traced), so "
    "fullgraph=True and torch.export cannot capture it (nor torch's ZeroRedundancyOptimizer.step, which "
    "breaks the graph too); call optimizer.step() outside the compiled function, or compile without "
    "fullgraph=True (a graph break at the step)"
)
CLIP_REASON = (
    "fusedist.ZeroRedundancyOptimizer.clip_grad_norm_ runs eagerly under torch.compile (it all-reduces "
    "the norm of every rank's gradient shard through fusedist's communicator, which cannot be traced), so "
    "fullgraph=True and torch.export cannot capture it; clip outside the compiled function, or compile "
    "without fullgraph=True (a graph break at the clip)"
)

eager_step = eager_under_compile(STEP_REASON)
eager_clip = eager_under_compile(CLIP_REASON)
