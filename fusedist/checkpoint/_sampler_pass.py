"""What a resumable sampler's position counts: the trained samples of the current *pass*.

Shared by :class:`~fusedist.checkpoint.ElasticDistributedSampler` and
``ResumableDistributedSampler``: both report ``advance(n)`` from the training loop and save
the position reached in the epoch.

Note [a pass of the sampler]
    torch's ``DistributedSampler`` yields the whole epoch's share at every ``iter()``: a loop
    that never calls ``set_epoch`` (``shuffle=False``, or a script that does not care) walks
    the same order again and again. The position is therefore counted per pass, one pass
    being one ``iter(sampler)`` -- what one ``iter(DataLoader)`` makes, with or without
    workers, and after the loop's last ``advance`` of the previous pass. A pass begins at its
    iterator's first ``next()``, not at ``iter()``: ``DataLoader(batch_size=None,
    num_workers>0)`` calls ``iter(sampler)`` twice and drops the first iterator unused, and
    counting that one as a pass made the real one start the epoch over -- a resume retrained
    the part of the epoch it had restored past. The first pass after
    ``load_state_dict`` continues the saved epoch; every later ``iter()`` starts the epoch
    order from its beginning and the count from 0, as torch's would. Counting ``advance``
    across passes instead ran past the end of the epoch: the saved position could not be
    loaded ("outside the epoch"), and the elastic sampler's later passes repeated the resumed
    remainder instead of the whole epoch.

    ``advance`` past the end of this rank's share of the pass is refused: the position would
    name samples that do not exist (``advance(batch_size)`` for a shorter last batch, say).
    A pass that drew indices while ``advance`` was never called saves the start of the pass,
    and a resume from it repeats what was trained; ``state_dict`` warns about that, once (a
    resumed pass too: its position starts where the restored one was).

    ``len()`` is the length of the pass the loop is in, or of the next one once the current
    pass is over: advanced to its end. Only the resumed pass is shorter than the rank's
    share, so after its last ``advance`` ``len()`` is the whole share again, as torch's, for
    the next ``iter()`` (a ``tqdm(loader)`` or ``len(loader)`` before the next loop). It said
    the resumed remainder until the next pass drew its first index. Merely drawing every
    index does not end a pass: a DataLoader with workers draws the last batches before the
    loop has trained them, and ``len()`` in the loop must not change there. (So a loop whose
    DataLoader drops a last partial batch never ends its resumed pass: ``len()`` says the
    remainder until the next pass begins, or until ``set_epoch``.)

Note [set_epoch after a resume]
    The loop most scripts already have resumes with ``for epoch in range(start_epoch, E):
    sampler.set_epoch(epoch); for batch in loader: ...``, so the first thing after
    ``load_state_dict`` is ``set_epoch`` of the very epoch just restored. Starting that epoch
    from its beginning, as ``set_epoch`` otherwise does, silently trained its first part
    twice. So until the restored pass begins, ``set_epoch`` of the restored epoch keeps the
    restored position (torchdata's ``StatefulDistributedSampler`` survives ``set_epoch`` the
    same way); any other epoch starts from its beginning.
"""

from __future__ import annotations

import numbers
import warnings
from typing import Iterable, Iterator


class PassPosition:
    """Mixin for a ``DistributedSampler`` subclass: the pass bookkeeping of Note [a pass of
    the sampler]. The subclass supplies :meth:`_restart_epoch` (forget a resumed start) and
    :meth:`_advance_limit` (the largest ``offset`` this pass allows)."""

    offset: int

    def _reset_pass(self, restored: bool = False) -> None:
        """A new position (construction, ``set_epoch``, ``load_state_dict``: ``restored``):
        the next ``iter()`` is the pass it describes."""
        self._pass_open = False
        self._drawn = self._advanced = 0
        self._restored = restored

    def _keeps_restored_position(self, epoch: int) -> bool:
        """Whether ``set_epoch(epoch)`` leaves the position alone (Note [set_epoch after a
        resume])."""
        return getattr(self, "_restored", False) and epoch == self.epoch

    def _begin_pass(self) -> None:
        """Called by ``__iter__``, a generator, before it computes the indices: at the pass's
        first ``next()``."""
        if getattr(self, "_pass_open", False):  # a second iter() without set_epoch
            self.offset = 0
            self._restart_epoch()
        self._pass_open = True
        self._drawn = self._advanced = 0
        self._restored = False

    def _pass_over(self) -> bool:
        """Whether the current pass was advanced to its end, so that the next ``iter()`` starts
        the epoch from its beginning (Note [a pass of the sampler])."""
        return getattr(self, "_pass_open", False) and self.offset >= self._advance_limit()

    def _counted(self, indices: Iterable[int]) -> Iterator[int]:
        for index in indices:
            self._drawn += 1
            yield index

    def advance(self, samples: int) -> None:
        """Record that this rank trained on ``samples`` more samples of the current pass
        (``len(batch)``, after the step). A DataLoader prefetches, so only the loop knows."""
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise ValueError(f"{type(self).__name__}.advance: samples must be a non-negative int (the "
                             f"batch's length), got {samples!r}")
        limit = self._advance_limit()
        if self.offset + samples > limit:
            raise ValueError(
                f"{type(self).__name__} (rank {self.rank}): advance({samples}) after {self.offset} would pass the "
                f"end of this rank's share of epoch {self.epoch}, which ends at {limit}; advance by the samples "
                "actually trained (len(batch), the last batch may be shorter) and call set_epoch() for a new epoch"
            )
        self.offset += samples
        self._advanced += samples

    def _warn_if_never_advanced(self) -> None:
        if self._drawn and not self._advanced and not getattr(self, "_warned", False):
            self._warned = True
            warnings.warn(
                f"{type(self).__name__} (rank {self.rank}): {self._drawn} indices of epoch {self.epoch} were drawn but "
                "advance() was never called in this pass, so the saved position is the start of the pass and a "
                "resume repeats what was trained. Call sampler.advance(len(batch)) after each step (a save before "
                "the pass's first step may ignore this)", stacklevel=3)

    def _check_state_types(self, state: dict, ints: tuple, bools: tuple, label: str) -> None:
        """Refuse a saved state whose values are of the wrong kinds, naming the key, before
        anything changes: an epoch saved as a string or a float loaded silently and failed
        only at the next ``iter()``, with a TypeError far from the load. Keys absent from the
        state (of an earlier version) are the caller's to handle."""
        for key in (k for k in ints if k in state):
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{label}: the saved {key}={value!r} is not an int (a {type(value).__name__}); "
                                 f"the state is not this sampler's state_dict()")
        for key in (k for k in bools if k in state):
            if not isinstance(state[key], bool):
                raise ValueError(f"{label}: the saved {key}={state[key]!r} is not a bool (a "
                                 f"{type(state[key]).__name__}); the state is not this sampler's state_dict()")

    # -- supplied by the sampler
    def _restart_epoch(self) -> None:
        raise NotImplementedError

    def _advance_limit(self) -> int:
        raise NotImplementedError
