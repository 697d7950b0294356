"""The modules' train/eval flags at a training forward, compared by the per-step check.

Note [train and eval modes in the step check]
    A rank that ran a validation pass and forgot ``model.train()`` (``if rank == 0: model.eval();
    evaluate(...)``) trains on with dropout off and batch norm normalizing by its running
    statistics, while the other ranks train in train mode. Every rank still runs the same
    forwards, backwards, collectives and optimizer steps, and the averaged gradients keep the
    replicas equal, so neither torch's DDP nor any other field of the check notices: the model
    silently trains on a mix of two different losses. (With SyncBatchNorm the ranks' collectives
    stop pairing instead, which the divergence probe names after a few seconds.)

    So each training forward reads the ``training`` flag of the model's modules (DDP: every module
    of the wrapped tree; fully_shard: every module under the root, Note [every module's mode under a
    fully_shard root] in sharded_watch.py) into a CRC, the check's ``modes`` field (Note [step
    check] in step_check.py): one more integer in the check's vector and in each rank's row of the
    tail the last bucket carries (four more elements per rank), so an error's label says what
    differs. The read is C-level (``map`` of an attribute getter over a list the wrapper keeps, then
    one ``crc32`` over the bytes): a few microseconds for a thousand modules, and no collective of
    its own. Ranks whose modes differ raise :class:`RankMismatchError` on every rank at the next
    forward, naming the modules and the ranks in each mode (two small all-gathers, on the error path
    only). Training in eval mode on every rank alike (frozen batch-norm statistics) is not a
    divergence and is not flagged.
"""

from __future__ import annotations

import zlib
from operator import attrgetter

import torch

__all__ = ["EXPLAIN", "modes_crc", "describe_modes"]

_TRAINING = attrgetter("training")

#: What a difference in the modules' modes means (the step check's words).
EXPLAIN = ("modules were in train mode on some ranks and in eval mode on others at the same training forward "
           "(model.eval() for a validation pass on some ranks, without model.train() after it): modules that "
           "read self.training (dropout, batch norm) computed differently per rank, so the averaged gradients "
           "mix two different losses; call model.train() / model.eval() on every rank alike")

#: Modules named in an error at most (the rest counted).
SHOWN = 8


def modes_crc(modules: list) -> int:
    """A rank-independent 31-bit digest of the modules' ``training`` flags, in list order."""
    return zlib.crc32(bytes(map(_TRAINING, modules))) & 0x7FFFFFFF


def describe_modes(comm, named: list) -> list[str]:
    """Lines naming the modules whose mode differs across ranks, and the ranks in each mode.

    ``named``: (path, module) in the order :func:`modes_crc` read them. A collective (two
    all-gathers): every rank calls it on the same verdict."""
    world = comm.world_size
    count = torch.tensor([len(named)], dtype=torch.int64, device=comm.device)
    counts = torch.empty(world, dtype=torch.int64, device=comm.device)
    comm.all_gather(counts, count, tag="step check modes: module counts")
    longest = int(counts.max().item())
    mine = torch.zeros(max(longest, 1), dtype=torch.uint8, device=comm.device)
    if named:
        mine[:len(named)] = torch.tensor([m.training for _, m in named], dtype=torch.uint8)
    everyone = torch.empty(world * mine.numel(), dtype=torch.uint8, device=comm.device)
    comm.all_gather(everyone, mine, tag="step check modes: flags")
    if len(set(counts.tolist())) > 1:
        return [f"  modules read per rank: {counts.tolist()} (the ranks' module trees differ)"]
    table = everyone.view(world, -1).tolist()
    differing = []  # (path, module, ranks in train mode, ranks in eval mode)
    for i, (path, module) in enumerate(named):
        column = [row[i] for row in table]
        if len(set(column)) > 1:
            differing.append((path or "<root>", module, [r for r, v in enumerate(column) if v],
                              [r for r, v in enumerate(column) if not v]))
    if len(differing) == len(named) > 1 and len({(tuple(t), tuple(e)) for _, _, t, e in differing}) == 1:
        _, _, train, evaluate = differing[0]  # the whole model switched: model.eval() / model.train()
        return [f"  all {len(named)} modules read: train mode on ranks {train}, eval mode on ranks {evaluate}"]
    lines = [f"  module '{path}' ({type(module).__name__}): train mode on ranks {train}, eval mode on ranks "
             f"{evaluate}" for path, module, train, evaluate in differing]
    if len(lines) > SHOWN:
        lines = lines[:SHOWN] + [f"  ... and {len(lines) - SHOWN} more modules in different modes"]
    return lines
