"""Exact resume: the per-rank state outside model, optimizer and scaler.

Training N steps, saving, restarting the processes and training N more must give the same
bits as 2N uninterrupted steps. Model, optimizer (master weights included) and GradScaler
are in the checkpoint proper; what else decides the next step's numbers is per rank:

* the random number generators (dropout masks, noise, data augmentation): torch's CPU
  generator, every CUDA device's generator when CUDA is initialized, Python's ``random``
  and NumPy's global generator;
* the data position: the sampler's epoch and how many samples of this rank's share of the
  epoch were already consumed (:class:`ResumableDistributedSampler`).

One trap: every ``iter(DataLoader)`` draws a base seed from the DataLoader's generator,
which is the *global* torch generator unless one is given -- and a resumed run creates an
iterator where the uninterrupted run did not. Give the DataLoader its own generator
(``DataLoader(..., generator=torch.Generator())``) for bitwise resume.

``save(..., per_rank=resume_state(sampler))`` stores it in each rank's own file and
``restore(load_per_rank(directory), sampler)`` puts it back. The per-rank state belongs to
a rank *at the world size that saved it*: at a different world size (a resharded ZeRO
resume) there is no exact continuation -- each rank's data partition changes -- and
:func:`load_per_rank` returns None, so the caller starts a fresh epoch position.
"""

from __future__ import annotations

import random
import warnings
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import DistributedSampler

from ._sampler_pass import PassPosition

_KEYS = ("epoch", "offset", "seed", "num_replicas", "shuffle")  # the keys every saved state has

try:  # numpy is optional for fusedist users; its generator is saved when it is importable
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None


def capture_rng_state() -> dict:
    """Every global generator's state (copies; safe to pickle)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if _np is not None:
        # As plain values and a tensor, not NumPy objects: checkpoints load with torch's
        # restricted (weights-only) unpickler, which refuses NumPy arrays.
        name, keys, pos, has_gauss, cached = _np.random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.astype(_np.int64)), int(pos), int(has_gauss), float(cached))
    return state


def restore_rng_state(state: dict) -> None:
    """Put back what :func:`capture_rng_state` returned; refused before any generator is set
    when it holds CUDA states and CUDA is not available (drop ``state["cuda"]`` to restore the
    others). On a machine with fewer CUDA devices than the save, the states of the devices it
    has are restored, with a warning."""
    _refuse_cuda_states_without_cuda(state)
    cuda = _cuda_states_here(state)
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    if "numpy" in state and _np is not None:
        name, keys, pos, has_gauss, cached = state["numpy"]
        if isinstance(keys, torch.Tensor):
            keys = keys.numpy().astype(_np.uint32)
        _np.random.set_state((name, keys, pos, has_gauss, cached))


def _cuda_states_here(state: dict) -> Optional[list]:
    """The saved CUDA generator states of the devices this machine has (device ``i``'s into
    device ``i``), with a warning when some are left out: setting them all failed on the first
    missing device, after the other generators had been set."""
    if "cuda" not in state:
        return None
    count = torch.cuda.device_count()
    if len(state["cuda"]) > count:
        warnings.warn(f"fusedist.checkpoint.resume: the checkpoint holds the CUDA generator states of "
                      f"{len(state['cuda'])} devices, this machine has {count}: those of devices {count}.."
                      f"{len(state['cuda']) - 1} are not restored", stacklevel=3)
    return list(state["cuda"])[:count]


def _refuse_cuda_states_without_cuda(state: dict) -> None:
    """Raise before anything is set: the generators set first stayed changed behind the error."""
    if "cuda" in state and not torch.cuda.is_available():
        raise RuntimeError(
            "fusedist.checkpoint.resume: the checkpoint holds CUDA generator states but CUDA is not "
            "available here; an exact resume needs the same kind of devices (no generator was set; "
            "restore the others without state['cuda'])"
        )


class ResumableDistributedSampler(PassPosition, DistributedSampler):
    """``torch.utils.data.DistributedSampler`` that can start an epoch part-way through.

    Same indices as torch's sampler for the same ``(seed, epoch, num_replicas, rank)``. The
    training loop reports what it consumed with :meth:`advance` (a DataLoader prefetches, so
    the sampler cannot know what was actually trained on); :meth:`state_dict` then records
    ``(epoch, offset)`` and :meth:`load_state_dict` makes the next ``__iter__`` skip the
    ``offset`` samples already trained on. ``set_epoch`` starts a new epoch at offset 0, and
    so does a later ``__iter__`` without it (Note [a pass of the sampler] in
    ``_sampler_pass.py``), except ``set_epoch`` of the epoch just restored (Note [set_epoch
    after a resume]).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.offset = 0  # samples of this rank's share of the current pass already consumed
        self._resume_offset = 0
        self._reset_pass()

    def set_epoch(self, epoch: int) -> None:
        if self._keeps_restored_position(epoch):  # Note [set_epoch after a resume]
            return
        super().set_epoch(epoch)
        self.offset = 0
        self._resume_offset = 0
        self._reset_pass()

    def _restart_epoch(self) -> None:
        self._resume_offset = 0

    def _advance_limit(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        self._begin_pass()  # a generator: at the first next() (Note [a pass of the sampler])
        indices = list(super().__iter__())
        yield from self._counted(indices[self._resume_offset:])

    def __len__(self) -> int:
        """This rank's share of the current pass: of the rest of the epoch after a resume (the
        next pass, after the loop's last ``advance`` of this one, is the whole share)."""
        return self.num_samples if self._pass_over() else self.num_samples - self._resume_offset

    def state_dict(self) -> dict:
        self._warn_if_never_advanced()
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "num_replicas": self.num_replicas,
                "shuffle": self.shuffle, "drop_last": self.drop_last, "dataset_len": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        missing = [key for key in _KEYS if key not in state] if isinstance(state, dict) else list(_KEYS)
        if missing:
            hint = " (an ElasticDistributedSampler's state?)" if isinstance(state, dict) and "consumed" in state else ""
            raise ValueError(f"ResumableDistributedSampler: the state to load lacks {missing}; it is not a "
                             f"ResumableDistributedSampler.state_dict(){hint}")
        self._check_state_types(state, ("epoch", "offset", "seed", "num_replicas", "dataset_len"),
                                ("shuffle", "drop_last"), "ResumableDistributedSampler")
        mine = {"seed": self.seed, "num_replicas": self.num_replicas, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "dataset_len": len(self.dataset)}
        for key, value in mine.items():
            # drop_last and dataset_len: absent from the states of earlier versions.
            if state.get(key, value) != value:
                raise ValueError(
                    f"ResumableDistributedSampler: the saved {key}={state[key]!r} differs from this sampler's "
                    f"{value!r}; an exact resume needs the same sampler settings, dataset and world size"
                )
        if not 0 <= state["offset"] <= self.num_samples:
            raise ValueError(f"ResumableDistributedSampler: saved offset {state['offset']} is outside "
                             f"[0, {self.num_samples}]")
        super().set_epoch(int(state["epoch"]))
        self.offset = self._resume_offset = int(state["offset"])
        self._reset_pass(restored=True)


def resume_state(sampler: Optional[ResumableDistributedSampler] = None) -> dict:
    """This rank's resume state: generators and (optionally) the sampler position."""
    return {"rng": capture_rng_state(), "sampler": sampler.state_dict() if sampler is not None else None}


def restore(state: Optional[dict], sampler: Optional[ResumableDistributedSampler] = None) -> bool:
    """Apply :func:`resume_state`'s result; False (nothing changed) when ``state`` is None."""
    if state is None:
        return False
    _refuse_cuda_states_without_cuda(state["rng"])  # (before the sampler is changed)
    if sampler is not None:
        if state.get("sampler") is None:
            raise ValueError("fusedist.checkpoint.resume: the checkpoint holds no sampler position")
        sampler.load_state_dict(state["sampler"])
    restore_rng_state(state["rng"])
    return True
