"""``full_tensor()`` of a sharded state-dict entry: the whole parameter, as FSDP2's DTensor gives it.

Note [whole entries]
    FSDP2's ``model.state_dict()`` holds DTensors, and the export recipe users copy is
    ``{k: v.full_tensor() for k, v in model.state_dict().items()}`` (torch's FSDP2 tutorial,
    conversion scripts to other formats). fusedist's entries are ShardedPieces (Note [pieces in
    torch's distributed checkpoint] in dcp.py): without ``full_tensor`` that recipe stopped with
    an AttributeError, or -- where the caller fell back to the value itself -- exported this
    rank's piece as if it were the parameter.

    ``full_tensor()`` gathers the *entry's* values, not the parameter's current ones (an entry
    cloned before an optimizer step gives the values it was cloned with, as a DTensor's does):
    each rank of the unit's shard group sends its region of the parameter (a range of the
    flattened parameter, or a box of a parameter sharded on another dim) and its values; every
    rank writes each region into a tensor of the parameter's shape. HSDP replicas hold the same
    pieces, so the shard group is enough. A tensor-parallel parameter's regions are of this
    rank's local tensor: the local tensor is made whole this way, then the global parameter
    from the tensor-parallel group, as ``full_state_dict`` does. Two all-gathers (the regions'
    description, then the values padded to the largest piece) per entry, over the shard group:
    a collective, every rank calls it for the same entries in the same order.
"""

from __future__ import annotations

import torch

from .._dtypes import real_pairs

__all__ = ["full_tensor_of"]

_MAX_DIMS = 8
_HEADER = 3 + 2 * _MAX_DIMS  # kind, numel, ndim or lo/hi, then a box's offsets and sizes


def full_tensor_of(entry) -> torch.Tensor:
    """The whole parameter of ``entry`` (a ShardedPiece) from every rank's entry (Note [whole entries])."""
    from .dcp import Ranges

    owner = entry._fs_owner
    unit = owner[0]() if owner is not None else None
    if isinstance(entry._fs_range, Ranges):
        raise NotImplementedError(
            "fusedist: full_tensor() of quantized storage (bytes of a packed weight) is not supported; "
            "use fusedist.fsdp.full_state_dict(model), which gives the whole weights.")
    if unit is None:
        raise RuntimeError(
            "fusedist: this state-dict entry no longer knows the fully_shard unit it came from (the model was "
            "dropped, or the entry was not made by state_dict()), so full_tensor() cannot gather it; take the "
            "state dict of the live model, or use fusedist.fsdp.full_state_dict(model).")
    index = owner[1]
    local_shape = entry._fs_local if entry._fs_local is not None else tuple(entry._fs_size)
    if len(local_shape) > _MAX_DIMS:
        raise NotImplementedError(f"fusedist: full_tensor() of a parameter of more than {_MAX_DIMS} dims")
    piece = entry.local().contiguous().reshape(-1).to(unit.device)
    comm, tag = unit.comm, f"fully_shard full_tensor {unit.fqns[index]}"
    header = torch.zeros(_HEADER, dtype=torch.int64, device=unit.device)
    header[:2] = torch.tensor([1 if _box(entry._fs_range) else 0, piece.numel()])
    if _box(entry._fs_range):
        offsets, sizes = entry._fs_range
        header[2] = len(offsets)
        header[3:3 + len(offsets)] = torch.tensor(offsets, dtype=torch.int64)
        header[3 + _MAX_DIMS:3 + _MAX_DIMS + len(sizes)] = torch.tensor(sizes, dtype=torch.int64)
    else:
        header[2:4] = torch.tensor(entry._fs_range, dtype=torch.int64)
    headers = torch.empty(_HEADER * comm.world_size, dtype=torch.int64, device=unit.device)
    comm.all_gather(headers, header, tag=tag + " regions").wait()
    headers = headers.view(comm.world_size, _HEADER).tolist()
    most = max(h[1] for h in headers)
    padded = torch.zeros(most, dtype=piece.dtype, device=unit.device)
    padded[:piece.numel()] = piece
    values = torch.empty(most * comm.world_size, dtype=piece.dtype, device=unit.device)
    if most:
        comm.all_gather(real_pairs(values), real_pairs(padded), tag=tag).wait()
    whole = torch.zeros(local_shape, dtype=piece.dtype, device=unit.device)
    for r, h in enumerate(headers):
        got = values[r * most:r * most + h[1]]
        if h[0] == 0:
            whole.view(-1)[h[2]:h[3]].copy_(got)
            continue
        ndim = h[2]
        offsets, sizes = h[3:3 + ndim], h[3 + _MAX_DIMS:3 + _MAX_DIMS + ndim]
        region = whole
        for dim, (start, size) in enumerate(zip(offsets, sizes)):
            region = region.narrow(dim, start, size)
        region.copy_(got.view(sizes))
    spec = unit.tp[index]
    if spec is not None:  # the global parameter (a collective over the tensor-parallel group)
        whole = spec.full(whole)
    return whole.to(entry.device)


def _box(region) -> bool:
    from .dcp import _is_box

    return _is_box(region)
