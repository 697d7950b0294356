"""fully_shard units with frozen parameters (fine-tuning, LoRA): only the trainable section of a
unit is reduce-scattered and holds gradient storage (Note [trainable section] in
fusedist/fsdp/layout.py), with the numerics of torch's FSDP2 and of a single-process reference.

Tolerances: fp32 throughout (as tests/test_fully_shard.py): the same ops on the same values,
differing only in how the ranks' gradients are summed (exact at world size 2, a last-bit rounding
per step at 3, which AdamW can amplify to ~1e-6 relative over a few steps): ``rtol=1e-5,
atol=1e-6``. bf16 compute with an fp32 reduction runs the same bf16 ops as torch's, and the
fp32 sum of two bf16 gradients is exact: the same tolerance. Against the single-process
reference (the mean over the concatenated global batch instead of the mean of the ranks'
means) the difference is rounding too: ``rtol=1e-5, atol=1e-6``.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusedist
import models
from fusedist.testing import run_distributed

FP32 = dict(rtol=1e-5, atol=1e-6)


class LoRALinear(nn.Module):
    """A frozen base Linear plus a trainable low-rank update ``x A^T B^T`` (registered after
    the base, as LoRA libraries do: the adapters come last in the unit)."""

    def __init__(self, d_in: int, d_out: int, r: int = 4):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.lora_a = nn.Parameter(torch.randn(r, d_in) / d_in ** 0.5)
        self.lora_b = nn.Parameter(torch.randn(d_out, r) / r)  # nonzero: both adapters get gradients
        self.base.requires_grad_(False)

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


class LoRANet(nn.Module):
    def __init__(self, d: int = 32, n: int = 2):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(LoRALinear(d, d) for _ in range(n))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


class MixedBlock(nn.Module):
    """Trainable and frozen parameters alternating in registration order: the trainable ones
    are not contiguous in the unit (fc1.weight frozen, fc1.bias trainable, norm trainable,
    fc2.weight trainable, fc2.bias frozen, fc3 frozen, scale trainable)."""

    def __init__(self, d: int):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.norm = nn.LayerNorm(2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.fc3 = nn.Linear(d, d)
        self.scale = nn.Parameter(torch.full((d,), 0.5))
        for p in (self.fc1.weight, self.fc2.bias, self.fc3.weight, self.fc3.bias):
            p.requires_grad_(False)

    def forward(self, x):
        return x + self.scale * self.fc3(torch.tanh(self.fc2(self.norm(self.fc1(x)))))


class MixedNet(nn.Module):
    def __init__(self, d: int = 24, n: int = 2):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(MixedBlock(d) for _ in range(n))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _batch(rank: int, step: int, n: int = 6):
    return models.rank_step_batch(rank, step, n, seed=5000)


def _global_batch(ws: int, step: int):
    xs, ys = zip(*(_batch(r, step) for r in range(ws)))
    return torch.cat(xs), torch.cat(ys)


def _mesh(ws):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (ws,))


def _shard(model, mesh, blocks, impl=None, **kw):
    impl = impl or fusedist.fully_shard
    for b in blocks:
        impl(b, mesh=mesh, **kw)
    impl(model, mesh=mesh, **kw)
    return model


def _torch_fully_shard():
    from torch.distributed.fsdp import fully_shard

    return fully_shard


def _full_torch(model) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _train(model, opt, rank, steps, first=0, scaler=None, clip=None):
    losses = []
    for step in range(first, first + steps):
        x, y = _batch(rank, step)
        loss = F.mse_loss(model(x), y)
        if scaler is None:
            loss.backward()
            if clip is not None:
                clip(model.parameters(), 0.05)
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            clip(model.parameters(), 0.05)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _parity(rank, ws, mesh, make, steps=3, **kw):
    """``make()`` trained by torch's FSDP2 and by ours (same wrapping, AdamW): losses and the
    largest difference of the final whole parameters."""
    torch.manual_seed(0)
    ref = make()
    ours = copy.deepcopy(ref)
    _shard(ref, mesh, ref.blocks, _torch_fully_shard(), **kw)
    _shard(ours, mesh, ours.blocks, **kw)
    l_ref = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), rank, steps)
    l_ours = _train(ours, torch.optim.AdamW(ours.parameters(), lr=1e-2), rank, steps)
    return dict(losses=(l_ref, l_ours), weights=_max_diff(_full_torch(ref), fusedist.fsdp.full_state_dict(ours))), ours


def _numerics(rank, ws):
    from fusedist.fsdp import MixedPrecisionPolicy

    mesh = _mesh(ws)
    out = {}
    out["lora"], ours = _parity(rank, ws, mesh, LoRANet)
    frozen = [p for b in ours.blocks for p in b.base.parameters()]
    out["frozen_grads_none"] = all(p.grad is None for p in frozen)
    out["mixed"], ours = _parity(rank, ws, mesh, MixedNet)
    from fusedist.fsdp.state import state_of

    unit = state_of(ours.blocks[0]).unit
    out["mixed_sections"] = [(s.trainable, len(s.indices)) for s in unit.layout.sections]
    out["mp"], _ = _parity(rank, ws, mesh, LoRANet,
                           mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))

    # GradScaler + clip: fusedist's (global norm over the pieces) against torch's on DTensors
    torch.manual_seed(0)
    ref = LoRANet()
    ours, fused = copy.deepcopy(ref), copy.deepcopy(ref)
    _shard(ref, mesh, ref.blocks, _torch_fully_shard())
    _shard(ours, mesh, ours.blocks)
    _shard(fused, mesh, fused.blocks)
    kw = dict(init_scale=2.0 ** 10, growth_interval=2)
    l_ref = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), rank, 3,
                   scaler=torch.amp.GradScaler("cpu", **kw), clip=torch.nn.utils.clip_grad_norm_)
    l_ours = _train(ours, torch.optim.AdamW(ours.parameters(), lr=1e-2), rank, 3,
                    scaler=fusedist.amp.GradScaler("cpu", **kw), clip=fusedist.clip_grad_norm_)
    l_fused = _train(fused, fusedist.optim.FusedAdamW(fused.parameters(), lr=1e-2), rank, 3,
                     scaler=fusedist.amp.GradScaler("cpu", **kw), clip=fusedist.clip_grad_norm_)
    full = _full_torch(ref)
    out["scaler"] = dict(losses=(l_ref, l_ours, l_fused), w_ours=_max_diff(full, fusedist.fsdp.full_state_dict(ours)),
                         w_fused=_max_diff(full, fusedist.fsdp.full_state_dict(fused)))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_partly_frozen_units_match_torch_fsdp2(world_size):
    for rank, res in enumerate(run_distributed(_numerics, world_size, timeout=240)):
        for case in ("lora", "mixed", "mp"):
            l_ref, l_ours = res[case]["losses"]
            torch.testing.assert_close(l_ours, l_ref, **FP32, msg=lambda m, case=case: f"{case}: {m}")
            assert res[case]["weights"] < 1e-5, (case, res[case]["weights"])
        assert res["frozen_grads_none"]
        # MixedBlock: 5 trainable parameters (fc1.bias, norm.weight/bias, fc2.weight, scale), 4 frozen
        assert res["mixed_sections"] == [(True, 5), (False, 4)], res["mixed_sections"]
        s = res["scaler"]
        l_ref, l_ours, l_fused = s["losses"]
        torch.testing.assert_close(l_ours, l_ref, **FP32)
        torch.testing.assert_close(l_fused, l_ref, **FP32)
        assert s["w_ours"] < 1e-5 and s["w_fused"] < 1e-5, s


# ------------------------------------------------------------------ what is reduced and held
def _traffic(rank, ws):
    """One LoRA unit (64x256 frozen base, rank-4 adapters), one fully frozen unit, a trainable
    root: the reduce-scatters of one backward and the gradient memory."""
    mesh = _mesh(ws)
    torch.manual_seed(0)
    model = nn.Sequential(LoRALinear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))
    model[2].requires_grad_(False)
    ref = copy.deepcopy(model)
    fusedist.fully_shard(model[0], mesh=mesh)
    fusedist.fully_shard(model[2], mesh=mesh)
    fusedist.fully_shard(model, mesh=mesh)
    comm = fusedist.fsdp.state.state_of(model).unit.comm
    sizes = []
    launch = comm.reduce_scatter

    def counted(output, input, **kw):
        sizes.append((input.numel(), input.element_size()))
        return launch(output, input, **kw)

    comm.reduce_scatter = counted
    fusedist.fsdp.reset_peak_memory_stats()
    x, y = _batch(rank, 0)
    x = torch.cat([x] * 8, dim=1)  # 64 features
    F.mse_loss(model(x), y).backward()
    stats = model.memory_stats()
    comm.reduce_scatter = launch
    # the reference gradient: DDP's (mean over the ranks of each rank's loss), single process
    xs, ys = zip(*(_batch(r, 0) for r in range(ws)))
    F.mse_loss(ref(torch.cat([torch.cat([x_] * 8, dim=1) for x_ in xs])), torch.cat(ys)).backward()
    from fusedist.fsdp.state import state_of

    grad_err, compared = 0.0, 0
    for wrapped, plain in ((model[0], ref[0]), (model, ref)):  # (unit fqns are relative to its module)
        unit = state_of(wrapped).unit
        for i, fqn in enumerate(unit.fqns):
            sp = unit.sharded[i]
            whole = dict(plain.named_parameters())[fqn]
            if sp.grad is None:
                assert not whole.requires_grad, fqn
                continue
            a, b = unit.element_range(i)
            assert tuple(sp.grad.shape) == tuple(sp.shape), (fqn, sp.grad.shape, sp.shape)
            if b > a:
                compared += b - a
                grad_err = max(grad_err, (sp.grad.reshape(-1) - whole.grad.reshape(-1)[a:b]).abs().max().item())
    return dict(sizes=sizes, stats=stats, grad_err=grad_err, compared=compared,
                lora_unit=sum(p.numel() for p in ref[0].parameters()),
                lora_trainable=sum(p.numel() for p in ref[0].parameters() if p.requires_grad),
                root_trainable=sum(p.numel() for p in ref[4].parameters()))


@pytest.mark.parametrize("world_size", [2, 3])
def test_lora_unit_reduces_and_holds_only_its_adapters(world_size):
    for res in run_distributed(_traffic, world_size, timeout=120):
        # the reference gradient on each rank's piece (fp32: rounding of the sum order only)
        unit, adapters, root = res["lora_unit"], res["lora_trainable"], res["root_trainable"]
        assert res["grad_err"] < 1e-6 and res["compared"] > 0, res["grad_err"]
        assert (unit, adapters, root) == (16384 + 256 + 1280, 1280, 1028)
        # two reduce-scatters: the LoRA unit's adapters and the root; none for the frozen unit.
        # Padding: below one row (256 elements here) per shard boundary, and the equal shards.
        sizes = sorted(n for n, _ in res["sizes"])
        assert len(sizes) == 2, res["sizes"]
        slack = 256 * world_size + world_size
        assert root <= sizes[0] <= root + slack and adapters <= sizes[1] <= adapters + slack, (sizes, adapters)
        assert sizes[1] * 8 < unit  # the unit's reduce would be 14x the adapters
        # gradient memory: each rank's shard of the trainable elements, not of the unit
        s = res["stats"]
        held = s["sharded_grad_bytes"] / 4
        assert held <= (adapters + root + 2 * slack) / world_size, (held, s)
        # buffers on the way through the reduce-scatters: trainable-sized too
        assert s["peak_scratch_bytes"] / 4 <= 2 * (adapters + root + 2 * slack), s
        assert s["scratch_bytes"] == 0


# --------------------------------------------- changing the trainable set, accumulation, checkpoints
def _changes(rank, ws, directory):
    mesh = _mesh(ws)
    out = {}
    # Unfreeze a base weight (in the frozen section) and freeze an adapter (in the trainable
    # section) after two steps; the reference: one process on the global batch (DDP's numerics).
    torch.manual_seed(0)
    ref = LoRANet()
    ours = copy.deepcopy(ref)
    _shard(ours, mesh, ours.blocks)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    grads_none = []
    for step in range(5):
        if step == 2:
            for m in (ref, ours):
                m.blocks[0].base.weight.requires_grad_(True)
                m.blocks[1].lora_a.requires_grad_(False)
        x, y = _global_batch(ws, step)
        loss = F.mse_loss(ref(x), y)
        loss.backward()
        x, y = _batch(rank, step)
        loss = F.mse_loss(ours(x), y)
        loss.backward()
        grads_none.append((ours.blocks[0].base.weight.grad is None, ours.blocks[1].lora_a.grad is None))
        o_ref.step(), o_ours.step()
        o_ref.zero_grad(), o_ours.zero_grad()
    out["toggle"] = dict(weights=_max_diff({k: v.detach() for k, v in ref.state_dict().items()},
                                           fusedist.fsdp.full_state_dict(ours)),
                         grads_none=grads_none)

    # gradient accumulation without communication == the large batch, LoRA model
    torch.manual_seed(0)
    acc = LoRANet()
    big = copy.deepcopy(acc)
    _shard(acc, mesh, acc.blocks)
    _shard(big, mesh, big.blocks)
    xs, ys = zip(*(_batch(rank, s) for s in range(3)))
    acc.set_requires_gradient_sync(False)
    for i in range(3):
        if i == 2:
            acc.set_requires_gradient_sync(True)
        (F.mse_loss(acc(xs[i]), ys[i]) / 3).backward()
        if i == 0:
            out["no_sync_grads"] = sum(p.grad is not None for p in acc.parameters())
    F.mse_loss(big(torch.cat(xs)), torch.cat(ys)).backward()
    out["accumulation"] = max((a.grad - b.grad).abs().max().item() for a, b in zip(acc.parameters(), big.parameters())
                              if a.numel() and (a.grad is not None or b.grad is not None))
    out["accumulated_none"] = [a.grad is None and b.grad is None for a, b in zip(acc.parameters(), big.parameters())
                               if not a.requires_grad]

    # checkpoints: save a LoRA model and its optimizer, load into a fresh one; and the model of
    # an all-trainable save into a partly frozen one (another layout of the same parameters)
    torch.manual_seed(0)
    model = LoRANet()
    plain = copy.deepcopy(model)
    plain.requires_grad_(True)
    _shard(model, mesh, model.blocks)
    _shard(plain, mesh, plain.blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, rank, 2)
    _train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), rank, 2)
    base = os.path.join(directory, "ckpt")
    fusedist.checkpoint.save(base + "-lora", model, opt)
    fusedist.checkpoint.save(base + "-plain", plain)
    torch.manual_seed(1)
    again = LoRANet()
    _shard(again, mesh, again.blocks)
    again_opt = torch.optim.AdamW(again.parameters(), lr=1e-2)
    fusedist.checkpoint.load(base + "-lora", again, again_opt)
    torch.manual_seed(2)
    other = LoRANet()
    _shard(other, mesh, other.blocks)
    fusedist.checkpoint.load(base + "-plain", other)
    l_model = _train(model, opt, rank, 2, first=2)
    l_again = _train(again, again_opt, rank, 2, first=2)
    out["checkpoint"] = dict(losses=(l_model, l_again),
                             weights=_max_diff(fusedist.fsdp.full_state_dict(model),
                                               fusedist.fsdp.full_state_dict(again)),
                             cross=_max_diff(fusedist.fsdp.full_state_dict(plain),
                                             fusedist.fsdp.full_state_dict(other)))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_trainable_set_changes_accumulation_and_checkpoints(world_size, tmp_path):
    for res in run_distributed(_changes, world_size, str(tmp_path), timeout=240):
        t = res["toggle"]
        assert t["weights"] < 1e-5, t["weights"]
        # the unfrozen base weight gets a gradient from step 2 on, the frozen adapter none
        assert [g[0] for g in t["grads_none"]] == [True, True, False, False, False]
        assert [g[1] for g in t["grads_none"]] == [False, False, True, True, True]
        assert res["no_sync_grads"] == 0
        assert res["accumulation"] < 1e-6, res["accumulation"]
        assert res["accumulated_none"] and all(res["accumulated_none"])
        c = res["checkpoint"]
        torch.testing.assert_close(c["losses"][1], c["losses"][0], rtol=0, atol=0)
        assert c["weights"] == 0.0 and c["cross"] == 0.0, c
