"""Which backward a DDP model synchronizes.

Note [a backward no DDP forward prepared]
    As torch's DDP (its reducer's ``expect_autograd_hooks_``): a training forward through the
    wrapper prepares the next backward to synchronize (``Reducer.prepare_forward`` sets
    ``prepared``), and a backward nothing prepared -- through ``model.module`` after the step's
    own (a saliency map, a probe on one rank) -- accumulates local gradients, as under
    ``no_sync``, which the next synchronized backward reduces with its own
    (``Reducer._begin_backward`` reads the flag, ``_finish_backward`` clears it). Reducing it
    instead made its gradients averages, and a rank that ran one alone waited in a bucket
    collective that its peers, in their next forward, paired with nothing (a stall until the
    collective timeout).

    One difference from torch, kept on purpose: a backward that passes through the wrapper's
    output again -- the second of two losses of one forward, ``loss1.backward(
    retain_graph=True); loss2.backward()`` -- is prepared again by that output (a hook on its
    autograd node, :func:`arm_again_through`; the output's tensors found in lists, tuples,
    dicts and dataclasses, as torch's DDP finds them) and synchronizes too, so the step gets
    avg(g1) + avg(g2) on every rank. torch reduces only the first, and its ranks step with
    different gradients. Not under ``torch.compile`` of the wrapper, whose outputs are the
    compiled graph's: there, as in torch, the second is local (and the step refuses).

Note [the end of a backward with nested ones]
    The end-of-backward callback goes to the autograd graph task that is running when it is
    queued. Under reentrant activation checkpointing (``checkpoint(..., use_reentrant=True)``)
    each checkpoint's backward is a graph task of its own, nested in the one the loss started:
    queued by the first gradient hook, inside the first checkpoint's backward, the callback ran
    at that nested task's end -- before the gradients of the parameters of any checkpoint still
    to come. With chained checkpoints (``checkpoint(b, checkpoint(a, x))``) every backward then
    failed ("received no gradient: a.weight ..."), or, with static_graph, the step refused it as
    not synchronized; torch's DDP trains. So the wrapper's outputs queue it, from the hook on
    their autograd node, in the graph task that passes through them -- the outermost one, as
    torch's ``_DDPSink`` queues its static graph's first reduction -- and the callback finishes
    the backward only if a gradient hook began one (``torch.autograd.grad`` through the output
    accumulates no gradient and leaves the forward's preparation to the next backward).
"""

from __future__ import annotations

import dataclasses
import sys
import weakref

import torch

from .unused import note_unreached


def refuse_compiled_autograd(owner: str, alternative: str = "torch's DistributedDataParallel with "
                             "torch._dynamo.config.optimize_ddp='python_reducer'") -> None:
    """Raise under compiled autograd (``torch._dynamo.compiled_autograd``, torchtitan's
    ``enable_compiled_autograd``): it traces the gradient hooks into the compiled backward,
    communicator included, and never runs the end-of-backward callback, so no backward could
    synchronize; every rank stalled until the collective timeout with an error about a traced
    ``group.send``. Checked at each training forward, on every rank alike (the setting is the
    program's; not under dynamo's ``compiled_autograd`` setting: Note [compiled autograd enabled by
    a compiled frame] in compiled_autograd.py), and as a backward begins (enabled around the
    backward alone; the hooks then run inside the compiled backward's region); dynamo is not
    imported for it."""
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    # (a hook the compiled backward calls runs with the first flag off and the second on)
    if compiled_autograd is not None and (getattr(compiled_autograd, "compiled_autograd_enabled", False)
                                          or getattr(compiled_autograd, "in_compiled_autograd_region", False)):
        raise RuntimeError(
            f"fusedist {owner}: compiled autograd is enabled (torch._dynamo.compiled_autograd), which traces "
            "the gradient hooks and skips the end-of-backward callback the gradient synchronization needs. "
            "Run the backward without compiled autograd (torch.compile of the model still works; under "
            "torch._dynamo.config.compiled_autograd, call loss.backward() outside the compiled function), or use "
            f"{alternative}")


def _tensors(out):
    """The tensors in a forward's output: pytree's leaves, and inside dataclasses (which pytree
    leaves whole) their fields, as torch's DDP finds its outputs' tensors."""
    for leaf in torch.utils._pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor):
            yield leaf
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            for field in dataclasses.fields(leaf):
                yield from _tensors(getattr(leaf, field.name))


def output_nodes(out) -> list:
    """The autograd nodes of the tensors in a forward's output ``out``, each once."""
    return list({id(t.grad_fn): t.grad_fn for t in _tensors(out) if t.grad_fn is not None}.values())


def arm_again_through(reducer, out, sync: bool) -> None:
    """Hook the autograd nodes of a training forward's outputs ``out`` so that a backward
    passing through them later is prepared as that forward prepared its first (``sync``)."""
    if sync and reducer.config.find_unused_parameters and not reducer.in_backward:
        note_unreached(reducer, out)  # Note [unused parameters known after the forward] in unused.py
    nodes = output_nodes(out)
    if not nodes:
        return
    held = weakref.ref(reducer)

    def arm(grad_outputs):  # (only where nothing prepared it: a pipeline's schedule does)
        r = held()
        if r is not None and not r.in_backward:
            if not r.prepared:
                r.prepared, r.next_backward_sync = True, sync
            r.finish_with_this_graph_task()  # Note [the end of a backward with nested ones]

    for node in nodes:
        node.register_prehook(arm)
