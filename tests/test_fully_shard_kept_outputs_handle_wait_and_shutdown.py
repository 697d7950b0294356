"""Lifetimes of what a ``fully_shard`` unit holds, against torch's FSDP2 on gloo.

* A grad-enabled forward whose backward never runs (a validation loss kept for logging without
  ``.item()``) used to keep every unit with frozen parameters gathered through each later
  backward, until that backward's end, where FSDP2 reshards each unit after its own
  post-backward (Note [calls a backward does not reach] in fusedist/fsdp/state.py).
* A reduction collected at interpreter shutdown, or one whose construction did not finish, is
  silent (Note [reductions collected at shutdown] in fusedist/fsdp/grads.py).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import fusedist
import models
from fusedist.testing import run_distributed

BLOCKS = 3


def _model(shard, mesh, freeze: str):
    torch.manual_seed(0)
    model = models.BlockStack(d=8, blocks=BLOCKS)
    for i, b in enumerate(model.blocks):
        if freeze == "part":  # LoRA-like: a frozen base weight in every unit
            b.fc1.requires_grad_(False)
        elif freeze == "whole" and i in (0, 1):  # whole frozen units
            b.requires_grad_(False)
    for b in model.blocks:
        shard(b, mesh=mesh)
    shard(model, mesh=mesh)
    return model


def _gathered_blocks(model, who) -> int:
    if who == "torch":
        return sum(bool(b._get_fsdp_state()._fsdp_param_group.is_unsharded) for b in model.blocks)
    return sum(b._fs_state().unit.is_unsharded for b in model.blocks)


def _kept_validation_output(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for freeze in ("part", "whole"):
        for who, shard in (("torch", fully_shard), ("fusedist", fusedist.fully_shard)):
            model = _model(shard, mesh, freeze)
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
            seen = []
            # when the gradient of the input projection's output is computed, every block's backward is over
            model.inp.register_forward_hook(
                lambda m, a, o: o.register_hook(lambda g: seen.append(_gathered_blocks(model, who))) and None)
            g = torch.Generator().manual_seed(10 + rank)
            kept, losses = [], []
            for _ in range(2):
                x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
                loss = F.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                xv, yv = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
                kept.append(F.mse_loss(model(xv), yv))  # kept with its graph, never backwarded
            if who == "torch":
                weights = {k: v.full_tensor() for k, v in model.state_dict().items()}
            else:
                weights = fusedist.fsdp.full_state_dict(model)
            out[(freeze, who)] = (seen, losses, weights)
    return out


def test_kept_grad_enabled_output_does_not_keep_frozen_units_gathered():
    for res in run_distributed(_kept_validation_output, 2, timeout=120):
        for freeze in ("part", "whole"):
            t_seen, t_losses, t_w = res[(freeze, "torch")]
            f_seen, f_losses, f_w = res[(freeze, "fusedist")]
            # torch: every block resharded by its own post-backward; fusedist held the frozen ones
            assert f_seen == t_seen == [0, 0], (freeze, t_seen, f_seen)
            torch.testing.assert_close(torch.tensor(f_losses), torch.tensor(t_losses), rtol=1e-5, atol=1e-6)
            for k in t_w:
                torch.testing.assert_close(f_w[k], t_w[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{freeze} {k}: {m}")


def test_reduction_collected_half_built_or_at_shutdown_is_silent(monkeypatch):
    from fusedist.fsdp import grads

    raised = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: raised.append(u.exc_value))
    half = grads.PendingReduce.__new__(grads.PendingReduce)  # __init__ never ran
    del half
    buffers = grads.PendingReduce.__new__(grads.PendingReduce)
    buffers.input, buffers.output = torch.zeros(4), torch.zeros(2)
    monkeypatch.setattr(grads, "COUNTERS", None)  # module globals cleared at interpreter shutdown
    del buffers
    assert raised == []


def _handle_after_forward(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
    out = {}
    for who, shard in (("torch", fully_shard), ("fusedist", fusedist.fully_shard)):
        model = _model(shard, mesh, "none")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        handle = model.blocks[1].unshard(async_op=True)
        loss = F.mse_loss(model(x), y)  # the block's forward waits for the gather and reshards after it
        handle.wait()
        after_wait = _gathered_blocks(model, who)
        loss.backward()
        opt.step()
        handle = model.blocks[0].unshard(async_op=True)
        handle.wait()
        handle.wait()
        held = _gathered_blocks(model, who)
        model.blocks[0].reshard()
        weights = {k: v.full_tensor() for k, v in model.state_dict().items()} if who == "torch" \
            else fusedist.fsdp.full_state_dict(model)
        out[who] = (after_wait, held, loss.item(), weights)
    return out


def test_unshard_handle_waited_after_the_forward_gathers_nothing():
    for res in run_distributed(_handle_after_forward, 2, timeout=120):
        t, f = res["torch"], res["fusedist"]
        assert (f[0], f[1]) == (t[0], t[1]) == (0, 1), (t[:2], f[:2])  # fusedist gathered the block again
        assert abs(f[2] - t[2]) < 1e-6
        for k in t[3]:
            torch.testing.assert_close(f[3][k], t[3][k], rtol=1e-5, atol=1e-6)
