"""The zero-bubble passes of fusedist's pipeline stages: a backward split into an input pass
(the stage inputs' gradients, sent upstream at once) and a weight pass (the weights'
gradients, later), over the parameters the autograd graph holds, so that a sharded or DDP
stage reduces its gradients through its usual hooks (Note [pipeline stages of fully_shard
modules] in __init__.py).

Note [zero-bubble passes of fusedist stages]
    The input pass runs with gradient sync off and the parameters kept gathered, so the
    backward it ends is an accumulation of nothing. The weight pass first gathers any unit a
    forward of another micro-batch resharded meanwhile (``reshard_after_forward``: a weight
    gradient may read the parameter, e.g. in a custom autograd function), then computes the
    gradients with torch's weight pass over the gathered parameters (one ``autograd.grad`` per
    group of weights, from the intermediates where their paths meet the input's: one backward
    from all intermediates at once would recompute the input-gradient paths between them),
    and hands them to ``torch.autograd.backward`` on the parameters themselves: autograd
    accumulates them and runs the gradient hooks, and the unit reduces (or accumulates) as
    after any backward, once per weight pass. The units' backward pre-hooks are off while the
    gradients are computed: an intermediate may be the node that made a unit's output (a
    custom function's), whose hook would start a backward of the unit in each
    ``autograd.grad``, and its end would take the gradients written so far as the unit's.
    A weight pass with nothing to compute (a micro-batch that goes around the stage's
    weights) runs no backward; it ends the units' backward directly, as a backward that
    reached none of them would end (Note [accumulated units a synchronized backward does not
    reach] in fsdp/state.py): in the step's last pass the units reduce what they accumulated.
    A DDP stage's engine reduces when every bucket is ready, so there the pass accumulates a
    zero gradient into each weight instead (the step's last then all-reduces the sums).

Note [weight paths around the inputs]
    torch's input pass saves the gradients at the intermediates where the weights' paths meet
    the paths of the stage inputs that require a gradient, and its weight pass starts from
    those alone. A stage with several outputs, some of which no such input reaches (one made
    from an input that needs no gradient only: a frozen embedding's output passed along), has
    weights whose paths go around the inputs': a weight below only those outputs got no
    gradient, one below both kinds got only part of it -- silently, torch's own stage alike.
    Here the input pass also keeps the output edges (and their gradients) that no input path
    reaches; the weight pass first computes the weights' gradients from them (keeping the
    graph: torch's pass below may share their nodes), then torch's, and the sum is the weights'
    gradient: every path from an output to a weight either meets an input's path (below its
    lowest meeting point it is torch's) or reaches none of them (then it starts at one of
    these outputs), so nothing is counted twice. A plain stage module gets the same passes;
    torch's own FSDP and DDP modules are left to torch's stage, which switches their sync itself.
"""

from __future__ import annotations

import torch


def _weights(module) -> list:
    """The trainable parameters the autograd graph of ``module``'s forward holds: a
    ``fully_shard`` module's units' gathered parameters (each once: a tied weight is its
    owner's), a DDP module's own parameters."""
    from ..fsdp import FullyShardedModule

    if not isinstance(module, FullyShardedModule):
        return [p for p in module.parameters() if p.requires_grad]
    found = {}
    for st in module._fs_states():
        if st.unit is not None:
            found.update((id(u), u) for u in st.unit.unsharded if u.requires_grad)
    return list(found.values())


class _PassGroups(list):
    """torch's parameter groups of an input pass, and the output edges (with their gradients)
    whose paths reach weights around the inputs' (Note [weight paths around the inputs])."""

    def __init__(self, groups, around):
        super().__init__(groups)
        self.around = around


def _input_pass(module, bwd_kwargs: dict):
    """torch's input pass over the parameters the graph holds: the stage inputs' gradients, and
    the intermediates' gradients the weight pass starts from (Note [zero-bubble passes of
    fusedist stages]); also the stage outputs the inputs' paths do not reach (Note [weight paths
    around the inputs])."""
    from torch.distributed.pipelining._backward import stage_backward_input

    outputs, output_grads = bwd_kwargs["stage_output"], bwd_kwargs["output_grads"]
    edges = []  # taken before torch's pass detaches the outputs
    for i, out in enumerate(outputs):
        if isinstance(out, torch.Tensor) and (out.requires_grad or out.grad_fn is not None):
            grad = torch.ones_like(out) if output_grads is None else output_grads[i]
            if grad is not None:
                edges.append((torch.autograd.graph.get_gradient_edge(out), grad))
    grads, groups = stage_backward_input(outputs, output_grads, bwd_kwargs["input_values"], iter(_weights(module)))
    return grads, _PassGroups(groups, _around_the_inputs(edges, bwd_kwargs["input_values"]))


def _around_the_inputs(edges: list, input_values) -> list:
    """The output edges none of whose paths down the graph reaches a stage input that requires a
    gradient: torch's input pass saved nothing for the weights below them."""
    from torch.distributed.pipelining._backward import (
        _get_grad_fn_or_grad_acc, construct_reverse_graph, reverse_closure)

    if not edges:
        return []
    inputs = [_get_grad_fn_or_grad_acc(v) for v in input_values if isinstance(v, torch.Tensor)]
    reverse = construct_reverse_graph([edge.node for edge, _ in edges])
    reached, _ = reverse_closure([node for node in inputs if node is not None], set(), reverse)
    return [(edge, grad) for edge, grad in edges if edge.node not in reached]


def _grads_around_the_inputs(groups, weights: list) -> list:
    """The weights' gradients along the paths from the outputs the inputs' do not reach (Note
    [weight paths around the inputs]), None where there are none. The graph is kept: torch's
    weight pass runs after, and its paths may share nodes with these."""
    around = getattr(groups, "around", None)
    if not around or not weights:
        return [None] * len(weights)
    groups.around = None  # (the graph goes when the pass ends)
    return list(torch.autograd.grad([edge for edge, _ in around], weights, grad_outputs=[g for _, g in around],
                                    retain_graph=True, allow_unused=True))


def _plain_weight_pass(module, param_groups) -> None:
    """torch's weight pass for a stage module no data parallelism wraps, with the gradients of the
    paths around the inputs added (Note [weight paths around the inputs])."""
    from torch.distributed.pipelining._backward import stage_backward_weight

    weights = [p for p in module.parameters() if p.requires_grad]
    around = _grads_around_the_inputs(param_groups, weights)
    stage_backward_weight(iter(weights), param_groups)
    for w, grad in zip(weights, around):
        if grad is not None:
            w.grad = grad if w.grad is None else w.grad + grad


def _weight_pass(module, param_groups) -> None:
    """The weights' gradients of one micro-batch, from the intermediates its input pass saved,
    then handed to autograd to accumulate so the gradient hooks run (Note [zero-bubble passes
    of fusedist stages])."""
    from torch.distributed.pipelining._backward import stage_backward_weight

    from ..fsdp import FullyShardedModule

    if param_groups is None:
        raise RuntimeError("fusedist.pipelining.PipelineStage: a weight pass without the input pass before it")
    contexts = []
    if isinstance(module, FullyShardedModule):  # a forward since may have resharded a unit
        for st in module._fs_states():
            if st.unit is not None:
                st.unit.unshard(async_op=False)
        contexts = list({id(st.ctx): st.ctx for st in module._fs_states() if st.ctx is not None}.values())
    weights = _weights(module)
    held = [w.grad for w in weights]  # (a DDP stage's accumulated gradients: put back below)
    for w in weights:
        w.grad = None
    for ctx in contexts:
        ctx.backward_hooks_off = True
    try:
        around = _grads_around_the_inputs(param_groups, weights)
        stage_backward_weight(iter(weights), param_groups)  # writes .grad, outside the hooks
        computed = [(w, _sum(w.grad, extra)) for w, extra in zip(weights, around)
                    if w.grad is not None or extra is not None]
    finally:
        for ctx in contexts:
            ctx.backward_hooks_off = False
        for w, grad in zip(weights, held):
            w.grad = grad
    if computed:
        torch.autograd.backward([w for w, _ in computed], grad_tensors=[g for _, g in computed])
    elif contexts:  # no backward to end: end the units' anyway, so a step's last pass still reduces the sums
        for ctx in contexts:
            ctx.finish_backward()
    elif weights:  # a DDP stage's buckets are ready when every weight's gradient is: add zeros to each
        torch.autograd.backward(weights, grad_tensors=[torch.zeros_like(w) for w in weights])


def _sum(a, b):
    return b if a is None else a if b is None else a + b


def _check_root_sharded(module, stage_index: int) -> None:
    """A zero-bubble pass over a plain stage module holding ``fully_shard`` units would be
    torch's, over the units' pieces the graph never saw (Note [pipeline stages of fully_shard
    modules]): it failed inside torch with a KeyError of an ``AccumulateGrad`` node. Refuse it
    naming the fix instead."""
    from ..fsdp import FullyShardedModule

    inner = next((name for name, m in module.named_modules() if isinstance(m, FullyShardedModule)), None)
    if inner is not None:
        raise RuntimeError(
            f"fusedist.pipelining.PipelineStage: stage {stage_index}'s module is not a fully_shard module itself, "
            f"but holds one ('{inner}'); zero-bubble schedules split its backward over the gathered parameters of "
            "a fully_shard stage only: shard the stage module too, fully_shard(stage_module, mesh=...) after its "
            "blocks (or use a schedule without weight passes)")


def _as_full(bwd_kwargs: dict) -> dict:
    """An input pass's arguments as a full pass's: torch wraps the last stage's loss in a tuple
    for the input pass, and a full pass skips a tuple without output gradients."""
    output = bwd_kwargs["stage_output"]
    if bwd_kwargs["output_grads"] is None and isinstance(output, tuple) and len(output) == 1:
        return {**bwd_kwargs, "stage_output": output[0]}
    return bwd_kwargs
