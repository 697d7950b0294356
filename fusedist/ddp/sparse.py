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

Note [sparse weights frozen at wrapping]
    The wrapper keeps every such weight, also one with ``requires_grad=False`` when wrapped:
    unfrozen later (fine-tuning that thaws the embeddings after some steps), it gets sparse
    gradients, which the buckets cannot hold -- left to them, every backward failed, saying
    the weight was not built with ``sparse=True``. Kept here, its gradients are averaged from
    the first backward that produces one (torch's DDP leaves a weight frozen at wrapping out of
    its reducer for good: its replicas then drift apart). While every such weight is frozen, a
    forward hooks nothing and no collective runs (nor are ``join()`` and ``torch.compile`` of
    the wrapper refused, as for a model without them); the ranks freeze and thaw them alike, as
    any parameter.

Note [sparse gradients through the communicator]
    The averaging runs on fusedist's communicator, as the buckets do, not on
    ``torch.distributed.all_reduce``: so it has the collective deadline (FUSEDIST_TIMEOUT_S)
    and the stall report, and a rank that skips it (a backward under ``no_sync`` on one rank
    only) is an error naming the collective and the rank, not a hang or gloo's bare timeout.
    The communicator carries flat tensors, so a sparse all-reduce is done as gloo's is: one
    all-gather of every weight's (kind, entry count) on every rank, then, per weight, its
    indices and values padded to the largest count and all-gathered, and the pieces added up
    locally (coalesced) and divided by the world size. The size exchange also says what every
    rank holds, so every rank takes the same path: no rank has a gradient -- it stays None,
    no more collectives; some rank's gradient is dense (a weight also used densely, e.g.
    tied to an output layer) -- every rank all-reduces it dense, where a sparse and a dense
    all-reduce would not pair; else the sparse gather, whose result every rank gets, also
    one that had none (an empty sparse gradient where no rank had an entry). A complex weight
    (its rows taken by ``torch.gather(..., sparse_grad=True)``: ``F.embedding`` has no complex
    backward) is averaged the same way, its values carried as real pairs; torch's DDP fails
    there on gloo ("Invalid scalar type").
"""

from __future__ import annotations

import weakref
import zlib

import torch
from torch import nn
from torch.autograd import Variable

from .prepared import _tensors


def sparse_parameter_ids(module: nn.Module) -> set:
    """The ids of the weights torch's DDP expects sparse gradients from: those of
    ``nn.Embedding`` / ``nn.EmbeddingBag`` modules built with ``sparse=True`` (by identity, so a
    weight tied to another module's and listed under that module's name is found too)."""
    return {id(m.weight) for m in module.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and isinstance(m.weight, torch.Tensor)}


_NONE, _SPARSE, _DENSE = 0, 1, 2  # what a rank holds for a weight, as the size exchange tells


def _local_gradient(p):
    """``p``'s gradient as this rank sends it: coalesced when sparse (None: no gradient)."""
    grad = p.grad
    return grad.coalesce() if grad is not None and grad.is_sparse else grad


def _size_of(grad) -> tuple:
    """(kind, entries) of a local gradient, for the size exchange."""
    if grad is None:
        return _NONE, 0
    return (_SPARSE, grad._nnz()) if grad.is_sparse else (_DENSE, grad.numel())


def _shape_of(p) -> tuple:
    """(elements, dtype code) of a weight, for the size exchange: what a dense all-reduce of its
    gradient sends (a gradient has its weight's shape and dtype)."""
    return p.numel(), _dtype_code(p.dtype)


def _dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode()) & 0x7FFFFFFF


def _refuse_different_weights(name: str, shapes: list) -> None:
    """Raise on every rank (each has every rank's entry) where the ranks' copies of a weight
    differ in size or dtype: a dense all-reduce of them would not pair (gloo ends the processes)."""
    if len(set(shapes)) == 1:
        return
    dtypes = {_dtype_code(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
    by_shape: dict = {}
    for r, shape in enumerate(shapes):
        by_shape.setdefault(shape, []).append(r)
    listed = "; ".join(f"ranks {ranks}: {numel} x {dtypes.get(code, 'an unknown dtype')}"
                       for (numel, code), ranks in by_shape.items())
    raise RuntimeError(
        f"fusedist.DistributedDataParallel: parameter '{name}' (sparse gradients, averaged dense this step) differs "
        f"across ranks ({listed}): it was replaced or converted on some ranks after wrapping, so the ranks cannot "
        "average its gradient. Change parameters on every rank alike (or before wrapping)")


def _empty_sparse(p) -> torch.Tensor:
    """A sparse gradient of ``p`` with no entries (coalesced)."""
    return torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long, device=p.device),
                                   torch.zeros((0,) + tuple(p.shape[1:]), dtype=p.dtype, device=p.device),
                                   p.shape, check_invariants=False).coalesce()


class SparseGradients:
    """Averages the gradients of ``params`` (named ``names``) over ``comm`` after each
    synchronized backward (Note [sparse gradients])."""

    def __init__(self, params: list, names: list, comm):
        self.params, self.names = params, names
        self.reducer = None  # the wrapper's reducer, when it has no dense parameter to begin backwards with
        self.comm, self.world_size = comm, comm.world_size
        self._queued = False  # the backward in progress has queued its reduction

    def __bool__(self) -> bool:
        return bool(self.params)

    def trainable(self) -> bool:
        """Whether any of the weights trains now (Note [sparse weights frozen at wrapping])."""
        return any(p.requires_grad for p in self.params)

    def arm(self, out) -> None:
        """Hook the autograd nodes of a synchronized training forward's outputs ``out`` (none
        while every weight is frozen: nothing to average, no collective)."""
        if not self.trainable():
            return
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
        """Average every sparse gradient over the ranks, in registration order (Note [sparse
        gradients through the communicator])."""
        self._queued = False
        if self.world_size == 1 or not self.params:
            return
        local = [_local_gradient(p) for p in self.params]
        sizes = torch.tensor([_size_of(g) + _shape_of(p) for p, g in zip(self.params, local)], dtype=torch.long,
                             device=self.comm.device).view(-1)
        gathered = torch.empty(self.world_size * sizes.numel(), dtype=torch.long, device=self.comm.device)
        self.comm.all_gather(gathered, sizes, tag="ddp sparse gradient sizes")
        every = gathered.view(self.world_size, len(self.params), 4).tolist()
        for i, (p, name, grad) in enumerate(zip(self.params, self.names, local)):
            kinds, nnz = [r[i][0] for r in every], [r[i][1] for r in every]
            if max(kinds) == _NONE:
                continue  # no rank had a gradient: it stays None
            if max(kinds) == _DENSE:  # (a dense gradient somewhere: every rank reduces it dense)
                _refuse_different_weights(name, [tuple(r[i][2:]) for r in every])
                dense = (torch.zeros_like(p, memory_format=torch.contiguous_format) if grad is None
                         else grad.to_dense() if grad.is_sparse else grad.clone(memory_format=torch.contiguous_format))
                # Every rank's weight has this size and dtype (just compared): no fingerprints (Note
                # [parts a caller checked] in fusedist/comm/base.py).
                self.comm.all_reduce(dense, tag=f"ddp sparse gradient {name} (dense)", parts_checked=True)
                p.grad = dense.div_(self.world_size)
            else:
                p.grad = self._gather_sparse(p, name, grad, nnz).div_(self.world_size)

    def _gather_sparse(self, p, name: str, grad, nnz: list) -> torch.Tensor:
        """The sum of every rank's sparse gradient of ``p`` (``nnz``: each rank's count of
        entries), coalesced: each rank's indices and values, padded to the largest count and
        gathered, then added up here, as gloo's sparse all-reduce does."""
        most, world, device = max(nnz), self.world_size, self.comm.device
        if most == 0:
            return _empty_sparse(p)
        grad = _empty_sparse(p) if grad is None else grad
        sparse_dim, row = grad.sparse_dim(), tuple(grad.shape[grad.sparse_dim():])
        indices = torch.zeros(sparse_dim, most, dtype=torch.long, device=device)
        indices[:, :grad._nnz()] = grad._indices()
        values = torch.zeros((most,) + row, dtype=p.dtype, device=device)
        values[:grad._nnz()] = grad._values()
        all_indices = torch.empty((world, sparse_dim, most), dtype=torch.long, device=device)
        all_values = torch.empty((world, most) + row, dtype=p.dtype, device=device)
        self.comm.all_gather(all_indices.view(-1), indices.view(-1), tag=f"ddp sparse gradient {name} (indices)")
        self.comm.all_gather(all_values.view(-1), values.view(-1), tag=f"ddp sparse gradient {name} (values)")
        total = torch.sparse_coo_tensor(
            torch.cat([all_indices[r, :, :n] for r, n in enumerate(nnz)], dim=1),
            torch.cat([all_values[r, :n] for r, n in enumerate(nnz)]), p.shape,
            check_invariants=False)  # (the ranks' own gradients' indices)
        return total.coalesce()

    def refuse_compiled(self, rank: int) -> None:
        """Under ``torch.compile`` of the wrapper the forward's outputs are the compiled graph's
        and are not hooked: the sparse gradients would stay local, so it raises."""
        if self.trainable():
            raise RuntimeError(
                f"fusedist.DistributedDataParallel (rank {rank}): torch.compile of the wrapper is not supported "
                f"with sparse gradients (parameters {self.names}, from nn.Embedding/EmbeddingBag(sparse=True)): "
                "compile the module inside it instead (DistributedDataParallel(torch.compile(module))), or use "
                "sparse=False")

    def refuse_join(self, rank: int) -> None:
        if self.trainable():
            raise RuntimeError(
                f"fusedist.DistributedDataParallel (rank {rank}): join() is not supported with sparse "
                f"gradients (parameters {self.names}, from nn.Embedding/EmbeddingBag(sparse=True)): "
                "give every rank the same number of batches, or use sparse=False")
