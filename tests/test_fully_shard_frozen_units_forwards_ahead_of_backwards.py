"""fully_shard units holding frozen parameters (LoRA) when forwards and backwards do not alternate:
two or three forwards before their backwards, in either order, forwards whose backward never runs,
and reentrant activation checkpointing -- against torch's FSDP2 on the same inputs (Note [frozen
parameters in backward] in fusedist/fsdp/state.py), and through reentrant checkpointing and a
repeated backward.

Tolerances: fp32, the same ops on the same values as FSDP2 at world size 2 (exact sums of two
ranks): ``rtol=1e-5, atol=1e-6`` as tests/test_fully_shard_frozen.py.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fusedist
from fusedist.testing import run_distributed
from test_fully_shard_frozen import LoRANet, _batch, _full_torch, _max_diff, _mesh, _shard, _torch_fully_shard

TOL = 1e-5


class ProbedLoRANet(LoRANet):
    """LoRANet whose blocks may run under reentrant checkpointing, and whose first activation's
    gradient hook (run once every block's backward is over) records which blocks are gathered."""

    reentrant = False
    probe = None

    def forward(self, x):
        x = self.inp(x)
        if self.probe is not None:
            x.register_hook(self.probe)
        for b in self.blocks:
            x = torch.tanh(checkpoint(b, x, use_reentrant=True) if self.reentrant else b(x))
        return self.head(x)


def _pair(mesh, reentrant=False, **kw):
    torch.manual_seed(0)
    ref = ProbedLoRANet()
    ref.reentrant = reentrant
    ours = copy.deepcopy(ref)
    _shard(ref, mesh, ref.blocks, _torch_fully_shard(), **kw)
    _shard(ours, mesh, ours.blocks, **kw)
    return ref, ours


def _gathered(model) -> list:
    from fusedist.fsdp.state import state_of

    return [state_of(b).unit.is_unsharded for b in model.blocks]


def _run_order(model, opt, rank, step, order):
    """``order`` like ["f0", "f1", "b0", "b1"]: forwards and backwards of micro-batches, one step."""
    losses = {}
    for op in order:
        i = int(op[1:])
        if op[0] == "f":
            x, y = _batch(rank, 10 * step + i)
            losses[i] = F.mse_loss(model(x), y)
        else:
            losses[i].backward()
    opt.step()
    opt.zero_grad()


def _normal_step(model, opt, rank, step) -> list:
    """One forward/backward/step; for fusedist's model, which blocks were gathered once every
    block's backward was over."""
    seen = []
    if not isinstance(model.blocks[0].base.weight, torch.distributed.tensor.DTensor):
        model.probe = lambda g: seen.append(_gathered(model))
    _run_order(model, opt, rank, step, ["f0", "b0"])
    model.probe = None
    return seen


def _orders(rank, ws):
    mesh = _mesh(ws)
    out = {}
    for name, order, raf in [("f0f1b0b1", ["f0", "f1", "b0", "b1"], True),
                             ("f0f1b1b0", ["f0", "f1", "b1", "b0"], False),
                             ("f0f1f2b0b1", ["f0", "f1", "f2", "b0", "b1"], True)]:
        ref, ours = _pair(mesh, reshard_after_forward=raf)
        seen = {}
        for m in (ref, ours):
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
            for step in range(2):
                _run_order(m, opt, rank, step, order)
            seen[m is ours] = _normal_step(m, opt, rank, 5)
        out[name] = dict(diff=_max_diff(_full_torch(ref), fusedist.fsdp.full_state_dict(ours)),
                         during=seen[True], after=_gathered(ours))
    return out


def test_forwards_before_their_backwards_with_frozen_parameters_match_fsdp2():
    """Two forwards, then their backwards, through LoRA units: the second backward crashed
    ("setStorage: ... storage of size 0") where FSDP2 trains; and a later step still reshards
    each unit as soon as its backward is over."""
    for rank_out in run_distributed(_orders, 2, timeout=120):
        for name, r in rank_out.items():
            assert r["diff"] <= TOL, (name, r)
            assert r["during"] == [[False, False]], (name, r)
            assert r["after"] == [False, False], (name, r)


def _unfinished(rank, ws):
    mesh = _mesh(ws)
    ref, ours = _pair(mesh)
    out = {}
    for m in (ref, ours):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        _run_order(m, opt, rank, 0, ["f0", "b0"])
        x, y = _batch(rank, 1)
        val = F.mse_loss(m(x), y).item()  # a validation loss computed with gradients, no backward
        try:
            loss = F.mse_loss(m(x), y)
            if loss.item() != val + 1.0:
                raise ValueError("skipped batch")  # an exception between forward and backward
            loss.backward()
        except ValueError:
            pass
        del loss
        with torch.no_grad():
            m(x)
        seen = _normal_step(m, opt, rank, 2)
    out["during"], out["after"] = seen, _gathered(ours)
    out["diff"] = _max_diff(_full_torch(ref), fusedist.fsdp.full_state_dict(ours))
    return out


def test_forwards_without_backward_do_not_keep_frozen_units_gathered():
    """Forwards whose backward never runs (a validation loss with gradients, a forward an
    exception ended): the next backward still reshards each LoRA unit once its backward is over
    (it used to wait for those calls' input gradients and keep the unit gathered to the end)."""
    for r in run_distributed(_unfinished, 2, timeout=120):
        assert r["diff"] <= TOL, r
        assert r["during"] == [[False, False]], r
        assert r["after"] == [False, False], r


def _repeated(model, opt, rank, step):
    """``loss.backward(retain_graph=True)`` then a second backward through the same forward."""
    x, y = _batch(rank, step)
    loss = F.mse_loss(model(x), y)
    loss.backward(retain_graph=True)
    (2 * loss).backward()
    opt.step()
    opt.zero_grad()


def _checkpointed_and_repeated(rank, ws):
    mesh = _mesh(ws)
    out = {}
    for name, reentrant, order in [("reentrant", True, ["f0", "b0"]), ("reentrant_two", True, ["f0", "f1", "b0", "b1"]),
                                   ("repeated", False, None)]:
        ref, ours = _pair(mesh, reentrant=reentrant)
        for m in (ref, ours):
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
            for step in range(2):
                if order:
                    _run_order(m, opt, rank, step, order)
                else:
                    _repeated(m, opt, rank, step)
            seen = _normal_step(m, opt, rank, 5)
        out[name] = dict(diff=_max_diff(_full_torch(ref), fusedist.fsdp.full_state_dict(ours)), during=seen)
    return out


def test_reentrant_checkpointing_and_repeated_backward_of_frozen_units_match_fsdp2():
    """A LoRA unit's backward reading its frozen weight for the input's gradient after the adapters'
    gradients are in, in a backward the unit's forward call did not open: the recompute of reentrant
    activation checkpointing (the original forward ran without gradients), and a second backward
    through one forward (``retain_graph=True``). The unit resharded before it and the backward
    crashed where FSDP2 trains."""
    for rank_out in run_distributed(_checkpointed_and_repeated, 2, timeout=120):
        for name, r in rank_out.items():
            assert r["diff"] <= TOL, (name, r)
            assert r["during"] == [[False, False]], (name, r)
