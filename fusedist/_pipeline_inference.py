"""The shape inference torch's schedules run through a pipeline stage, kept from leaving a trace.

Note [shape inference leaves the stage as it was]
    torch's schedules learn the shapes a stage sends and receives by running its module once
    before the first step (and again when a schedule turns from training steps to ``eval``
    steps or back): the first stage on micro-batch 0, every later stage on uninitialized
    tensors (``torch.empty`` of the shapes received). Whatever that forward updated in place
    stayed: a BatchNorm's running statistics took micro-batch 0 once more on the first stage
    and garbage (inf or nan) on the others, and counted one batch more -- silently, torch's
    own stage alike: an ``eval()`` of the model then normalized by inf. (torch forks the random
    generators around the inference itself.) Here the inference runs over copies of the
    module's buffers (a transient copy, once per schedule switch), the module's own put back
    after it, so training starts from the statistics the user left.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def over_copied_buffers(module: torch.nn.Module):
    """Run the block over copies of the module's buffers (Note [shape inference leaves the
    stage as it was]). The originals are put back untouched: the inference's graph, which
    torch's backward inference runs later, holds the copies (a BatchNorm saves its running
    statistics for its backward)."""
    saved = [(owner, name, buf) for owner in module.modules() for name, buf in owner._buffers.items()
             if buf is not None]
    try:
        for owner, name, buf in saved:
            owner._buffers[name] = buf.detach().clone()
        yield
    finally:
        for owner, name, buf in saved:
            owner._buffers[name] = buf
