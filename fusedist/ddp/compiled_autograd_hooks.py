"""Global registration hooks that dynamo must not compile as frames of their own.

Note [registration hooks called outside a trace]
    fusedist installs torch's process-global module and Parameter registration hooks (wrapped
    modules followed, torch's DDP over a fusedist wrapper noticed). Called while dynamo's frame hook
    is active but outside any trace, dynamo compiled each hook as a frame of its own. Compiled
    autograd does exactly that inside a ``torch.compile``d training step under
    ``torch._dynamo.config.compiled_autograd``: it compiles the captured backward with
    ``torch.compile``, whose ``OptimizedModule`` registers its child ``_orig_mod`` while half built,
    and dynamo, building the hook's arguments, failed on it ("InternalTorchDynamoError: KeyError:
    _orig_mod"). Once any fusedist wrapper had installed the hooks, every such backward in the
    process failed so, torch's DDP and FSDP2 included. So such a call runs the hook (and what it
    calls) as plain Python, as without dynamo; where dynamo traces a registration (inside a compiled
    function) it still inlines the hook (Note [registrations while dynamo traces] in trainable.py).
"""

from __future__ import annotations


def run_as_python_outside_traces(hook):
    """``hook`` (returned) runs without dynamo when called outside a trace (Note [registration hooks
    called outside a trace]); a dynamo without frame strategies leaves it as it is."""
    try:  # (private API: any other torch leaves the hook as it is)
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

        set_code_exec_strategy(hook.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    except Exception:  # noqa: BLE001
        pass
    return hook
