"""Trainable parameters with no elements, which own no slice of any shard.

Note [parameters with no elements]
    torch's optimizers step a parameter with no elements like any other (a zero-width LoRA
    factor, an embedding of an empty vocabulary): its state holds a step count and empty
    moments, and its index is in the state dict. Here such a parameter lies in no rank's
    shard, so the inner optimizer never saw it, and the consolidated state dict lacked its
    entry (a torch optimizer's state loaded here lost it too). :class:`EmptyParams` keeps an
    optimizer of the inner class over stand-ins of those parameters (empty tensors of their
    shape, in the masters' dtype), on every rank alike: each step steps it with the others --
    a parameter with a gradient gets an empty one, a parameter without none, as the pieces
    are skipped -- so its state is the state torch's optimizer would hold. The shards carry it
    as one fragment ``(0, 0)`` on every rank (Note [fragments] in ``state.py``), so it is in
    the consolidated state dict, and a load gives it back.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.optim import Optimizer

from . import state as zstate
from .owner_ref import HeldByOptimizer


class EmptyParams(HeldByOptimizer):
    """The state of one ZeroRedundancyOptimizer's (``zero``) trainable parameters with no
    elements (Note [parameters with no elements])."""

    def __init__(self, zero):
        self._hold(zero)  # weakly (owner_ref.py)
        self.indices: list[int] = []  # what ``inner`` was built over
        self._trainable_seen: Optional[list] = None  # the zero's list of trainable indices looked at last
        self.stand_ins: dict[int, torch.Tensor] = {}
        self.inner: Optional[Optimizer] = None

    def _ensure(self) -> bool:
        """Build (or, after parameters joined, rebuild keeping the states) the stand-ins'
        optimizer; False when there are no such parameters. The zero replaces its list of
        trainable indices whenever it changes (``grow.py``), so an unchanged list is not looked
        through again at every step."""
        z = self.zero
        if z._trainable is self._trainable_seen:
            return self.inner is not None
        self._trainable_seen = z._trainable
        indices = [i for i in z._trainable if z._params[i].numel() == 0]
        if indices == self.indices and (self.inner is not None or not indices):
            return bool(indices)
        old = self.states()
        self.indices = indices
        self.stand_ins = {i: torch.zeros(z._params[i].shape, dtype=z._master_dtype(z._params[i].dtype),
                                         device=z._params[i].device, requires_grad=True) for i in indices}
        self.inner = None
        if not indices:
            return False
        self.inner = z._optimizer_factory(self._groups(), **z._inner_defaults)
        self._load(old)
        return True

    def _groups(self) -> list[dict]:
        """The zero's groups holding such parameters, with its current hyperparameters."""
        z = self.zero
        out = []
        for gi, group in enumerate(z.param_groups):
            params = [self.stand_ins[i] for i in self.indices if z._group_of[i] == gi]
            if params:
                out.append(dict(zstate.hyperparameters(group), params=params))
        return out

    @torch.no_grad()
    def step(self, without_grad) -> None:
        """Step the stand-ins with the zero's step: those of ``without_grad`` (the parameters
        this step skips) get no gradient; nothing is stepped when the scaler found an inf/nan,
        as the pieces are not."""
        if not self._ensure():
            return
        z = self.zero
        found = z.found_inf
        if found is not None and bool(found.reshape(-1)[0].item()):
            return
        skipped = set(without_grad)
        for i, t in self.stand_ins.items():
            t.grad = None if i in skipped else torch.zeros_like(t)
        for inner_group, group in zip(self.inner.param_groups, self._groups()):
            inner_group.update(zstate.hyperparameters(group))
        try:
            self.inner.step()
        finally:
            for t in self.stand_ins.values():
                t.grad = None

    def states(self) -> dict[int, dict]:
        """Parameter index -> its optimizer state (flat tensors, as fragments hold them)."""
        if self.inner is None:
            return {}
        out = {}
        for i, t in self.stand_ins.items():
            st = self.inner.state.get(t)
            if st:
                out[i] = {k: v.detach().reshape(-1).clone() if isinstance(v, torch.Tensor) and v.dim() > 0
                          else (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
        return out

    def fragments(self) -> dict[int, list]:
        """This rank's fragments of them (every rank holds the same): one ``(0, 0)`` each."""
        return {i: [{"range": (0, 0), "master": None, "state": st}] for i, st in self.states().items()}

    def load(self, assembled: dict) -> None:
        """Take the states of an assembled load (those without one start afresh)."""
        if not self._ensure():
            return
        self._load({i: assembled[i]["state"] for i in self.indices if i in assembled})

    def _load(self, states: dict[int, dict]) -> None:
        ids = {i: k for k, i in enumerate(i for g in self._groups() for i in self._indices_of(g))}
        groups = [dict(zstate.hyperparameters(g), params=[ids[i] for i in self._indices_of(g)])
                  for g in self._groups()]
        self.inner.state.clear()
        self.inner.load_state_dict({
            "state": {ids[i]: {k: v.reshape(self.stand_ins[i].shape) if isinstance(v, torch.Tensor) and v.dim() > 0
                               else v for k, v in st.items()}
                      for i, st in states.items() if st and i in ids},
            "param_groups": groups})
        zstate.keep_loaded_strings(self.inner.state, {self.stand_ins[i]: st for i, st in states.items()
                                                      if st and i in ids})

    def _indices_of(self, group: dict) -> list[int]:
        index_of = {id(t): i for i, t in self.stand_ins.items()}
        return [index_of[id(t)] for t in group["params"]]
