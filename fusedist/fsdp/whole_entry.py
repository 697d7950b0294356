"""``full_tensor()`` and ``to_local()`` of a sharded state-dict entry: the whole parameter and this
rank's FSDP2 shard of it, as FSDP2's DTensor gives them.

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
    a collective, every rank calls it for the same entries in the same order. The group and the
    tensor-parallel spec come with the entry (Note [entries read as DTensors] in
    dtensor_view.py), not from the unit: an entry kept after ``del model`` gathers as a
    DTensor does. ``to_local()`` gathers the same way where this rank's piece is not its FSDP2
    chunk, and copies the chunk out.
"""

from __future__ import annotations

import torch

from .._dtypes import real_pairs

__all__ = ["full_tensor_of", "to_local_of"]

_MAX_DIMS = 8
_HEADER = 3 + 2 * _MAX_DIMS  # kind, numel, ndim or lo/hi, then a box's offsets and sizes


def full_tensor_of(entry) -> torch.Tensor:
    """The whole parameter of ``entry`` (a ShardedPiece) from every rank's entry (Note [whole entries])."""
    view = _view_of(entry, "full_tensor()")
    if view.packed:  # Note [quantized-storage entries read as DTensors] in packed_entry.py
        from .packed_entry import packed_whole

        return packed_whole(entry, view)
    whole, _ = _local_whole(entry, "full_tensor()")
    if view.tp is not None:  # the global parameter (a collective over the tensor-parallel group)
        whole = view.tp.full(whole)
    return whole.to(entry.device)


def to_local_of(entry) -> torch.Tensor:
    """This rank's FSDP2 shard of ``entry``'s parameter (Note [entries read as DTensors] in
    dtensor_view.py): the entry's own storage where its piece is that shard, else a collective."""
    view = _view_of(entry, "to_local()")
    if view.packed:  # Note [quantized-storage entries read as DTensors] in packed_entry.py
        from .packed_entry import packed_local

        return packed_local(entry, view)
    if view.aligned:
        return entry.local().view(view.chunk_shape())
    whole, _ = _local_whole(entry, "to_local()")
    return view.chunk_of(whole).to(entry.device)


def _view_of(entry, what: str):
    from .dcp import Ranges, describe_region

    if entry._fs_view is None:
        if isinstance(entry._fs_range, Ranges):
            raise RuntimeError(
                f"fusedist: {what} of quantized storage ({describe_region(entry._fs_range)} of the canonical bytes "
                f"of a weight of {tuple(entry._fs_size)} bytes): the entry was not made by a fully_shard model's "
                "state_dict(), so its weight's layout is unknown. Take the entries from the model's state_dict(), "
                "or use fusedist.fsdp.full_state_dict(model).")
        raise RuntimeError(
            f"fusedist: {what} of a piece holding {describe_region(entry._fs_range)} of a parameter of shape "
            f"{tuple(entry._fs_size)}: the piece was not made by a fully_shard model's state_dict() (or "
            "get_optimizer_state_dict), so which ranks hold the rest of it is unknown. Take the entries from the "
            "model's state_dict(), or use fusedist.fsdp.full_state_dict(model).")
    return entry._fs_view


def _local_whole(entry, what: str) -> tuple:
    """``(the whole local parameter, the entry's view)`` from every rank's ``entry`` -- the
    tensor-parallel local tensor for a tensor-parallel parameter (a collective over the shard
    group, which needs neither the unit nor the model: Note [entries read as DTensors])."""
    view = _view_of(entry, what)
    device = view.device
    local_shape = entry._fs_local if entry._fs_local is not None else tuple(entry._fs_size)
    if len(local_shape) > _MAX_DIMS:
        raise NotImplementedError(f"fusedist: {what} of a parameter of more than {_MAX_DIMS} dims")
    piece = entry.local().contiguous().reshape(-1).to(device)
    comm, tag = view.comm, f"fully_shard {what} {view.fqn}"
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    header[:2] = torch.tensor([1 if _box(entry._fs_range) else 0, piece.numel()])
    if _box(entry._fs_range):
        offsets, sizes = entry._fs_range
        header[2] = len(offsets)
        header[3:3 + len(offsets)] = torch.tensor(offsets, dtype=torch.int64)
        header[3 + _MAX_DIMS:3 + _MAX_DIMS + len(sizes)] = torch.tensor(sizes, dtype=torch.int64)
    else:
        header[2:4] = torch.tensor(entry._fs_range, dtype=torch.int64)
    headers = torch.empty(_HEADER * comm.world_size, dtype=torch.int64, device=device)
    comm.all_gather(headers, header, tag=tag + " regions").wait()
    headers = headers.view(comm.world_size, _HEADER).tolist()
    most = max(h[1] for h in headers)
    padded = torch.zeros(most, dtype=piece.dtype, device=device)
    padded[:piece.numel()] = piece
    values = torch.empty(most * comm.world_size, dtype=piece.dtype, device=device)
    if most:
        comm.all_gather(real_pairs(values), real_pairs(padded), tag=tag).wait()
    whole = torch.zeros(local_shape, dtype=piece.dtype, device=device)
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
    return whole, view


def _box(region) -> bool:
    from .dcp import _is_box

    return _is_box(region)
