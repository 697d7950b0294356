"""A DistributedSampler whose saved position survives a change of world size.

``ResumableDistributedSampler`` (``resume.py``) records how far *this rank* got through its
share, which means nothing once the ranks are re-split. Here the position is global: the
number of samples of the epoch's permutation already consumed by all ranks together. Rank
``r`` of ``W`` takes ``indices[r::W]``, so after every rank consumed ``k`` samples exactly
the first ``k * W`` entries of the (padded) permutation are done, whatever ``W`` was. A
resumed run at any world size continues with the rest of the same permutation, re-split
over its own ranks; at the same world size that is exactly the uninterrupted sequence, so
resume stays bitwise.

Positions past the end of the permutation are padding (``drop_last=False``): every rank has
finished its share, whatever the world size that padded it, so they are all the end of the
epoch and the position is saved as ``len(dataset)`` at most. A position saved by a smaller
world size after a larger one padded further (a resume at the very end of an epoch, saved
again before the next epoch began) otherwise failed to load as "outside the epoch".

What ``advance`` counts, a second ``iter()`` without ``set_epoch``, and ``set_epoch`` right
after a restore: Note [a pass of the sampler] and Note [set_epoch after a resume] in
``_sampler_pass.py``.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch.utils.data import DistributedSampler

from ._sampler_pass import PassPosition

_KEYS = ("epoch", "consumed", "seed", "shuffle", "drop_last", "dataset_len", "num_replicas")


class ElasticDistributedSampler(PassPosition, DistributedSampler):
    """``torch.utils.data.DistributedSampler`` that resumes mid-epoch at any world size.

    Same indices as torch's sampler for the same ``(seed, epoch, num_replicas, rank)`` from
    the start of an epoch. The training loop reports what it trained on with :meth:`advance`
    (a DataLoader prefetches, so the sampler cannot know); :meth:`state_dict` records the
    epoch and the global number of samples consumed, and :meth:`load_state_dict` -- at any
    world size -- makes the next ``__iter__`` yield this rank's share of the remainder.
    ``set_epoch`` starts a new epoch from its beginning, and so does a later ``__iter__``
    without it, as torch's sampler does (Note [a pass of the sampler]); ``set_epoch`` of the
    epoch just restored keeps the restored position (Note [set_epoch after a resume]).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.offset = 0  # samples of this rank's share of the current pass consumed
        self._start = 0  # position in the epoch's padded permutation where this pass starts
        self._reset_pass()

    def set_epoch(self, epoch: int) -> None:
        if self._keeps_restored_position(epoch):  # Note [set_epoch after a resume]
            return
        super().set_epoch(epoch)
        self.offset = self._start = 0
        self._reset_pass()

    def _restart_epoch(self) -> None:
        self._start = 0

    def _advance_limit(self) -> int:
        return self._pass_length()

    @property
    def consumed(self) -> int:
        """Samples of the epoch consumed by all ranks together (every rank advances alike);
        padding past the end counts as the end (``len(dataset)``)."""
        return min(self._start + self.offset * self.num_replicas, len(self.dataset))

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
        self._begin_pass()  # a generator: at the first next() (Note [a pass of the sampler])
        rest = self._remaining()
        yield from self._counted(rest[self.rank::self.num_replicas])

    def __len__(self) -> int:
        """This rank's share of the current pass: of the rest of the epoch after a resume, and
        the whole share once that pass is over (Note [a pass of the sampler])."""
        return self.num_samples if self._pass_over() else self._pass_length()

    def _pass_length(self) -> int:
        """What the current pass yields on this rank (torch's ``num_samples`` from the start)."""
        rest = max(len(self.dataset) - self._start, 0)
        if self.drop_last:
            return rest // self.num_replicas
        return math.ceil(rest / self.num_replicas)

    def state_dict(self) -> dict:
        """The position, independent of the world size (the same on every rank)."""
        self._warn_if_never_advanced()
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "dataset_len": len(self.dataset), "num_replicas": self.num_replicas}

    def load_state_dict(self, state: dict) -> None:
        """Continue the saved epoch where all ranks together stopped, at this world size."""
        missing = [key for key in _KEYS if key not in state] if isinstance(state, dict) else list(_KEYS)
        if missing:
            hint = " (a ResumableDistributedSampler's state?)" if isinstance(state, dict) and "offset" in state else ""
            raise ValueError(f"ElasticDistributedSampler (rank {self.rank}): the state to load lacks {missing}; it is "
                             f"not an ElasticDistributedSampler.state_dict(){hint}")
        self._check_state_types(state, ("epoch", "seed", "dataset_len", "num_replicas"),  # consumed: below
                                ("shuffle", "drop_last"), f"ElasticDistributedSampler (rank {self.rank})")
        for key, mine in (("seed", self.seed), ("shuffle", self.shuffle), ("drop_last", self.drop_last),
                          ("dataset_len", len(self.dataset))):
            if state[key] != mine:
                raise ValueError(
                    f"ElasticDistributedSampler (rank {self.rank}): the saved {key}={state[key]!r} differs from "
                    f"this sampler's {mine!r}; the saved position belongs to a different epoch order"
                )
        consumed = state["consumed"]
        if isinstance(consumed, bool) or not isinstance(consumed, int) or consumed < 0:
            raise ValueError(f"ElasticDistributedSampler (rank {self.rank}): saved position consumed={consumed!r} is "
                             f"not a number of samples of the epoch of {len(self.dataset)}")
        super().set_epoch(int(state["epoch"]))
        self._start, self.offset = min(int(consumed), len(self.dataset)), 0  # past the end: padding, the epoch is done
        self._reset_pass(restored=True)
