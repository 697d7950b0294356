"""Sparse gradients (``nn.Embedding(sparse=True)``), averaged outside the buckets.

Note [sparse gradients]
    torch's DDP trains an ``nn.Embedding`` or ``nn.EmbeddingBag`` built with ``sparse=True``
    (on gloo): it expects a sparse gradient from such a module's weight, gives it a bucket of
    its own and all-reduces the sparse tensor. The flat dense buckets here cannot hold one
    (a sparse gradient's size changes from step to step), so the wrapper keeps these weights
    out of the reducer -- as it keeps parameters torch is told to ignore -- and averages their
    gradients itself, once per synchronized backward, after the reducer has finished: each
    training forward outside ``no_sync`` hooks its outputs' autograd nodes, and the backward
    that passes through them queues a callback that queues one more, which autograd runs after
    the reducer's own end-of-backward callback (queued later, by the first dense gradient).
    So every rank sends the buckets first and then the sparse gradients, in the order the
    weights are registered, whatever order its gradients were produced in; a rank whose
    weight got no gradient sends an empty one (the weight keeps ``grad=None`` only if no rank
    had one). A model whose every trainable weight is such has no dense gradient to begin
    the reducer's (empty) backward with, so the hook on the outputs begins it, and the step is
    counted and checked as any other. What accumulated under ``no_sync`` is in ``p.grad`` and
    is averaged with it, as torch does. A backward through ``model.module`` alone stays local (Note [a backward no
    DDP forward prepared] in prepared.py). Not supported with ``join()``, whose joined ranks
    would have to shadow these collectives too, nor under ``torch.compile`` of the wrapper,
    whose outputs are the compiled graph's: both raise.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from .prepared import _tensors


def sparse_parameter_ids(module: nn.Module) -> set:
    """The ids of the weights torch's DDP expects sparse gradients from: those of
    ``nn.Embedding`` / ``nn.EmbeddingBag`` modules built with ``sparse=True`` (by identity, so a
    weight tied to another module's and listed under that module's name is found too)."""
    return {id(m.weight) for m in module.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and isinstance(m.weight, torch.Tensor)}


class SparseGradients:
    """Averages the gradients of ``params`` (named ``names``) over ``process_group`` after each
    synchronized backward (Note [sparse gradients])."""

    def __init__(self, params: list, names: list, process_group, world_size: int):
        self.params, self.names = params, names
        self.reducer = None  # the wrapper's reducer, when it has no dense parameter to begin backwards with
        self.process_group, self.world_size = process_group, world_size
        self._queued = False  # the backward in progress has queued its reduction

    def __bool__(self) -> bool:
        return bool(self.params)

    def arm(self, out) -> None:
        """Hook the autograd nodes of a synchronized training forward's outputs ``out``."""
        nodes = {id(t.grad_fn): t.grad_fn for t in _tensors(out) if t.grad_fn is not None}
        if torch._C._current_graph_task_id() == -1:
            self._queued = False  # (outside any backward: one an exception interrupted queued nothing more)
        held = weakref.ref(self)

        def queue(grad_outputs):
            me = held()
            if me is not None and not me._queued:
                me._queued = True
                Variable._execution_engine.queue_callback(me._queue_after_reducer)
                reducer = me.reducer
                if reducer is not None and not reducer.in_backward:
                    reducer._begin_backward()  # its end-of-backward counts the backward, as any

        for node in nodes.values():
            node.register_prehook(queue)

    def _queue_after_reducer(self) -> None:
        # queued now, it runs after every callback queued during the backward (the reducer's)
        Variable._execution_engine.queue_callback(self.reduce)

    def reduce(self) -> None:
        """All-reduce and average every sparse gradient, in registration order."""
        self._queued = False
        if self.world_size == 1:
            return
        for p in self.params:
            grad = p.grad
            local = grad if grad is not None else torch.sparse_coo_tensor(
                torch.zeros(1, 0, dtype=torch.long, device=p.device),
                torch.zeros((0,) + tuple(p.shape[1:]), dtype=p.dtype, device=p.device), p.shape)
            local = local.coalesce() if local.is_sparse else local.clone()
            dist.all_reduce(local, group=self.process_group)
            if grad is None and local.is_sparse and local._nnz() == 0:
                continue  # no rank had a gradient: it stays None
            p.grad = local.coalesce().div_(self.world_size) if local.is_sparse else local.div_(self.world_size)

    def refuse_compiled(self, rank: int) -> None:
        """Under ``torch.compile`` of the wrapper the forward's outputs are the compiled graph's
        and are not hooked: the sparse gradients would stay local, so it raises."""
        if self.params:
            raise RuntimeError(
                f"fusedist.DistributedDataParallel (rank {rank}): torch.compile of the wrapper is not supported "
                f"with sparse gradients (parameters {self.names}, from nn.Embedding/EmbeddingBag(sparse=True)): "
                "compile the module inside it instead (DistributedDataParallel(torch.compile(module))), or use "
                "sparse=False")

    def refuse_join(self, rank: int) -> None:
        if self.params:
            raise RuntimeError(
                f"fusedist.DistributedDataParallel (rank {rank}): join() is not supported with sparse "
                f"gradients (parameters {self.names}, from nn.Embedding/EmbeddingBag(sparse=True)): "
                "give every rank the same number of batches, or use sparse=False")
