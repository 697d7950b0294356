"""The host side shared by the multi-tensor launchers: the chunk table and the launch configuration.

One launch covers a whole list of tensors that share a dtype combination. The host builds a
*chunk table* (like apex's ``multi_tensor_apply``): every program owns one chunk of
``BLOCK * ITERS`` elements of one tensor and finds its tensor's addresses in a pointer table.

Table layout (one int64 device tensor per launch, see :class:`ChunkTable`)::

    ptrs[role, t]   data_ptr of tensor t for each role (grad, param, master, exp_avg, ...)
    numels[t]       element count of tensor t
    chunk_t[c]      tensor index of chunk c
    chunk_start[c]  first element of chunk c inside its tensor
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import triton.language as tl

from ..backend import triton_interpreting

_TORCH_TO_TL = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
}


def launch_config() -> tuple[int, int, int]:
    """(BLOCK, ITERS, num_warps) for the elementwise kernels.

    Under the interpreter every program costs ~1 ms of Python, so chunks are made large
    there; on a GPU a 4096-element chunk (4 x 1024) keeps enough programs in flight for small
    tensors while amortizing the table lookups for large ones.
    """
    if triton_interpreting():
        return 65536, 1, 1
    return 1024, 4, 4


def tl_dtype(dtype: torch.dtype):
    try:
        return _TORCH_TO_TL[dtype]
    except KeyError:
        raise TypeError(f"fusedist multi-tensor kernels support float32/float16/bfloat16, got {dtype}") from None


class ChunkTable:
    """Pointer + chunk table of one launch, uploaded to the device in a single copy.

    ``roles`` is a list of tensor lists (all the same length); a role entry may be a list of
    tensors whose ``data_ptr`` is taken, or None to fill the row with zeros (unused role).
    """

    def __init__(self, roles: list, numels: list[int], chunk: int, device: torch.device):
        n = len(numels)
        chunk_t: list[int] = []
        chunk_start: list[int] = []
        for t, numel in enumerate(numels):
            for start in range(0, numel, chunk):
                chunk_t.append(t)
                chunk_start.append(start)
        rows: list[int] = []
        for role in roles:
            rows.extend([0] * n if role is None else [x.data_ptr() for x in role])
        # Every address 16-byte aligned: the kernels may then promise it to the compiler,
        # which turns full chunks into 128-bit vector loads and stores.
        self.aligned = all(ptr % 16 == 0 for ptr in rows)
        host = torch.tensor(rows + list(numels) + chunk_t + chunk_start, dtype=torch.int64)
        if device.type == "cuda":
            # Pinned + non_blocking: the upload is queued on the stream, no host sync.
            host = host.pin_memory()
            table = host.to(device, non_blocking=True)
        else:
            table = host
        self._host = host  # keeps the pinned source alive until the copy has run
        self.table = table
        self.n_tensors = n
        self.n_roles = len(roles)
        self.n_chunks = len(chunk_t)
        self.ptrs = table[: self.n_roles * n]
        self.numels = table[self.n_roles * n : (self.n_roles + 1) * n]
        base = (self.n_roles + 1) * n
        self.chunk_t = table[base : base + self.n_chunks]
        self.chunk_start = table[base + self.n_chunks :]


_data_ptr = torch.Tensor.data_ptr  # (mapped over each role: the key is built at every launch)
_TABLE_CACHE: "OrderedDict[tuple, ChunkTable]" = OrderedDict()
_TABLE_CACHE_SIZE = 64


def chunk_table(roles: list, numels: list[int], chunk: int, device: torch.device) -> ChunkTable:
    """Cached :class:`ChunkTable`: an optimizer steps the same tensors every iteration, so
    after the first step a launch costs no table upload. The key is the addresses and sizes
    themselves, so a hit is correct even if the tensors behind an address changed."""
    key = (device, chunk, tuple(numels)) + tuple(
        None if role is None else tuple(map(_data_ptr, role)) for role in roles
    )
    table = _TABLE_CACHE.get(key)
    if table is None:
        table = ChunkTable(roles, numels, chunk, device)
        _TABLE_CACHE[key] = table
        if len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
            _TABLE_CACHE.popitem(last=False)
    else:
        _TABLE_CACHE.move_to_end(key)
    return table
