"""A DistributedSampler whose saved position survives a change of world size.

``ResumableDistributedSampler`` (``resume.py``) records how far *this rank* got through its
share, which means nothing once the ranks are re-split. Here the position is global: the
number of samples of the epoch's permutation already consumed by all ranks together. Rank
``r`` of ``W`` takes ``indices[r::W]``, so after every rank consumed ``k`` samples exactly
the first ``k * W`` entries of the (padded) permutation are done, whatever ``W`` was. A
resumed run at any world size continues with the rest of the same permutation, re-split
over its own ranks; at the same world size that is exactly the uninterrupted sequence, so
resume stays bitwise.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch.utils.data import DistributedSampler


class ElasticDistributedSampler(DistributedSampler):
    """``torch.utils.data.DistributedSampler`` that resumes mid-epoch at any world size.

    Same indices as torch's sampler for the same ``(seed, epoch, num_replicas, rank)`` from
    the start of an epoch. The training loop reports what it trained on with :meth:`advance`
    (a DataLoader prefetches, so the sampler cannot know); :meth:`state_dict` records the
    epoch and the global number of samples consumed, and :meth:`load_state_dict` -- at any
    world size -- makes the next ``__iter__`` yield this rank's share of the remainder.
    ``set_epoch`` starts a new epoch from its beginning.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.offset = 0  # samples of this rank's share of the current epoch consumed
        self._start = 0  # position in the epoch's padded permutation where this pass starts

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.offset = self._start = 0

    def advance(self, samples: int) -> None:
        """Record that this rank trained on ``samples`` more samples of the epoch."""
        self.offset += samples

    @property
    def consumed(self) -> int:
        """Samples of the epoch consumed by all ranks together (every rank advances alike)."""
        return self._start + self.offset * self.num_replicas

    def _permutation(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(len(self.dataset), generator=g).tolist()
        return list(range(len(self.dataset)))

    def _remaining(self) -> list[int]:
        """The epoch's permutation from ``_start`` on, padded or cut to a multiple of the
        world size as torch does (padding repeats the permutation's first entries)."""
        order = self._permutation()
        n = len(order)
        if self.drop_last:
            rest = order[self._start:]
            return rest[:len(rest) - len(rest) % self.num_replicas]
        rest = order[self._start:] if self._start < n else []
        pad = (-len(rest)) % self.num_replicas
        if pad:
            rest = rest + (order * math.ceil(pad / n))[:pad]
        return rest

    def __iter__(self) -> Iterator[int]:
        rest = self._remaining()
        return iter(rest[self.rank::self.num_replicas])

    def __len__(self) -> int:
        return len(self._remaining()) // self.num_replicas

    def state_dict(self) -> dict:
        """The position, independent of the world size (the same on every rank)."""
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "dataset_len": len(self.dataset), "num_replicas": self.num_replicas}

    def load_state_dict(self, state: dict) -> None:
        """Continue the saved epoch where all ranks together stopped, at this world size."""
        for key, mine in (("seed", self.seed), ("shuffle", self.shuffle), ("drop_last", self.drop_last),
                          ("dataset_len", len(self.dataset))):
            if state[key] != mine:
                raise ValueError(
                    f"ElasticDistributedSampler (rank {self.rank}): the saved {key}={state[key]!r} differs from "
                    f"this sampler's {mine!r}; the saved position belongs to a different epoch order"
                )
        consumed = state["consumed"]
        if not 0 <= consumed <= len(self.dataset) + state["num_replicas"]:
            raise ValueError(f"ElasticDistributedSampler (rank {self.rank}): saved position {consumed} is outside "
                             f"the epoch of {len(self.dataset)} samples")
        super().set_epoch(state["epoch"])
        self._start, self.offset = consumed, 0
