"""Whether a training forward refuses compiled autograd at once or leaves it to the backward.

Note [compiled autograd enabled by a compiled frame]
    ``torch._dynamo.config.compiled_autograd = True`` enables compiled autograd only while a
    ``torch.compile``'d function runs (dynamo enters ``compiled_autograd._enable`` as the compiled
    frame starts and leaves it as the frame returns). A forward through ``torch.compile(model)``
    sees it enabled, yet a ``loss.backward()`` outside the compiled function runs the plain
    autograd engine: gradient hooks and the end-of-backward callback run as without it, and
    torch's DDP (Python reducer) and FSDP2 train there as in eager. The forward refused it
    nonetheless, turning a working program away. So under that setting the forward leaves the
    decision to the backward, whose first gradient hook refuses when the backward itself runs
    compiled (a whole training step compiled, ``loss.backward()`` inside it; on every rank alike,
    before any collective). Enabled any other way (``compiled_autograd._enable``, torchtitan's
    ``enable_compiled_autograd``) the backward that follows runs under it too, and the forward
    refuses at once, as before.
"""

from __future__ import annotations

import sys

from .prepared import refuse_compiled_autograd

_DDP_ALTERNATIVE = "torch's DistributedDataParallel with torch._dynamo.config.optimize_ddp='python_reducer'"


def enabled_by_compiled_frames() -> bool:
    """True under ``torch._dynamo.config.compiled_autograd``: compiled autograd is on inside
    compiled functions only (dynamo is not imported for it)."""
    config = sys.modules.get("torch._dynamo.config")
    return bool(config is not None and getattr(config, "compiled_autograd", False))


def refuse_compiled_autograd_at_forward(owner: str, alternative: str = _DDP_ALTERNATIVE) -> None:
    """At a training forward: raise under compiled autograd unless it may end with the compiled
    frame the forward runs in (Note [compiled autograd enabled by a compiled frame])."""
    if not enabled_by_compiled_frames():
        refuse_compiled_autograd(owner, alternative)
