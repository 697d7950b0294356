"""``to_local()`` and ``full_tensor()`` of a quantized-storage state-dict entry, as FSDP2's
DTensor entry of the same weight answers them.

Note [quantized-storage entries read as DTensors]
    FSDP2's ``model.state_dict()`` holds an NF4 weight as a DTensor over torchao's ``NF4Tensor``:
    ``to_local()`` is this rank's chunk (the subclass, ``rows / world`` rows) and ``full_tensor()``
    the whole weight (the subclass: its codes and scales gathered), a collective. fusedist's entry
    is the rank's byte ranges of the weight's canonical bytes (Note [quantized storage] in
    packed.py), which hold all the chunk has: its part of each cut inner tensor and the shared
    ones. So ``to_local()`` rebuilds the chunk from the entry alone (no collective, as FSDP2's;
    fresh storage: the entry is already a copy of the piece's bytes), and ``full_tensor()``
    all-gathers every rank's chunk bytes over the shard group and joins them as the unit's own
    gather does. Both use a copy of the unit's layout of the weight, kept without the module, so
    an entry kept after ``del model`` still answers (Note [entries read as DTensors] in
    dtensor_view.py).
"""

from __future__ import annotations

import copy

import torch

__all__ = ["detached_spec", "packed_local", "packed_whole"]


def detached_spec(spec):
    """``spec`` (a PackedSpec) without its module: what an entry keeps to rebuild its weight."""
    out = copy.copy(spec)
    out.module = None
    return out


def _row(entry, view, what: str) -> torch.Tensor:
    """This rank's chunk bytes (one row of the unit's table) from ``entry``'s canonical byte ranges."""
    spec = view.packed_spec
    held = sum(hi - lo for lo, hi in spec.held_ranges())
    if entry.numel() != held:
        raise RuntimeError(
            f"fusedist: {what} of '{view.fqn}' (quantized storage): the entry holds {entry.numel()} bytes, the "
            f"rank's ranges of the weight's canonical bytes are {held}; the entry was changed in shape after "
            "state_dict(). Take it again from the model's state_dict().")
    return spec.row_of_entry(entry.local().reshape(-1))


def packed_local(entry, view) -> torch.Tensor:
    """This rank's chunk of the quantized weight, as torchao's class (FSDP2's ``to_local()``)."""
    return view.packed_spec.wrap(_row(entry, view, "to_local()"))


def packed_whole(entry, view) -> torch.Tensor:
    """The whole quantized weight from every rank's entry (FSDP2's ``full_tensor()``): a
    collective over the shard group, every rank calls it for the same entry."""
    spec, comm = view.packed_spec, view.comm
    row = _row(entry, view, "full_tensor()").to(view.device).reshape(-1)
    table = torch.empty(comm.world_size * row.numel(), dtype=torch.uint8, device=view.device)
    comm.all_gather(table, row, tag=f"fully_shard full_tensor() {view.fqn}").wait()
    whole = spec.whole_of_table(table.view(comm.world_size, -1))
    return whole if whole.device == entry.device else whole.to(entry.device)
