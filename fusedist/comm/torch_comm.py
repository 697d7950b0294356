"""Communicator implemented on ``torch.distributed`` (gloo on CPU, torch's NCCL on GPU)."""

from __future__ import annotations

import datetime
from typing import Optional

import torch
import torch.distributed as dist

from .base import Communicator

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
# torch >= 2.12 renamed the flat-tensor collectives; older releases only have the old names.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchCommunicator(Communicator):
    name = "torch"

    def __init__(self, process_group=None, timeout: Optional[datetime.timedelta] = None):
        if not dist.is_initialized():
            raise RuntimeError(
                "fusedist: torch.distributed is not initialized; call fusedist.init_distributed() "
                "(under torchrun) or torch.distributed.init_process_group() first"
            )
        self.group = process_group
        super().__init__(dist.get_rank(process_group), dist.get_world_size(process_group), timeout)
        self.backend = dist.get_backend(process_group)

    @property
    def device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _all_reduce(self, tensor, op):
        return dist.all_reduce(tensor, op=_OPS[op], group=self.group, async_op=True)

    def _reduce_scatter(self, output, input, op):
        if self.backend == "gloo":
            return _GlooReduceScatter(output, input, _OPS[op], self.group, self.rank, self.world_size)
        return _reduce_scatter_flat(output, input, op=_OPS[op], group=self.group, async_op=True)

    def _all_gather(self, output, input):
        return _all_gather_flat(output, input, group=self.group, async_op=True)

    def _broadcast(self, tensor, src):
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        return dist.broadcast(tensor, src=global_src, group=self.group, async_op=True)

    def _wait_work(self, work, timeout: datetime.timedelta) -> None:
        # gloo honours the timeout here; for NCCL, wait() orders the current stream after the
        # collective and torch's watchdog enforces the process-group timeout.
        work.wait(timeout=timeout)


class _GlooReduceScatter:
    """gloo's flat reduce-scatter is an all-reduce of a copy of the input whose chunk is copied
    out in ``wait()``; its work never reports completion (``is_completed()`` stays False), so
    DDP could not finish such buckets during backward (Note [finishing buckets during
    backward] in ``fusedist/ddp/reducer.py``). The same two steps here, with a truthful
    ``is_completed`` (and the reduce op honoured)."""

    def __init__(self, output, input, op, group, rank: int, world_size: int):
        self.output, self.rank, self.world_size = output, rank, world_size
        self.buffer = input.clone()  # the input stays unchanged, as reduce-scatter promises
        self.work = dist.all_reduce(self.buffer, op=op, group=group, async_op=True)

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, timeout=None) -> None:
        self.work.wait(timeout=timeout)
        self.output.copy_(self.buffer.chunk(self.world_size)[self.rank])
        self.buffer = None
