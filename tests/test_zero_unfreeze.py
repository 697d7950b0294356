"""ZeroRedundancyOptimizer with parameters that join after construction -- ``add_param_group``
and parameters frozen at construction and unfrozen later (progressive unfreezing; Note
[growing the partition] in fusedist/zero/grow.py) -- and parameters kept in their memory
format (channels_last convolution weights stay channels_last).

The oracle is unsharded torch.optim.AdamW / SGD in one process on the global batch with the
same unfreezing schedule (DDP averages per-rank mean losses over equal chunks: the global
mean loss). Tolerance 1e-5 (fp32; gradients differ in summation order only): lr 1e-2 with
weight decay moves every parameter by ~1e-2 per step, so a joined parameter that is not
stepped, stepped with the wrong group's hyperparameters, given another parameter's state or
a non-averaged gradient is caught, as is an old parameter whose state moved.
"""

import copy
import os

import pytest
import torch
from torch import nn

import models

from shared_rank_launch import launch_for_selected, results_of

GLOBAL_BATCH = 12  # divisible by 2 and 3
STEPS = 7
UNFREEZE_AT = 3
TOL = 1e-5


def _batch(step, rank=None, world_size=1, shape=(8,)):
    return models.rank_slice_of_global_batch(step, rank, world_size, seed=300, n=GLOBAL_BATCH, shape=shape)


_flat = models.flat_params


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = torch.tanh(self.conv2(torch.tanh(self.conv1(x))))
        return self.head(h.mean(dim=(2, 3)))


def _convnet():
    torch.manual_seed(0)
    return ConvNet().to(memory_format=torch.channels_last)


def _memory_format_worker(rank, world_size):
    """channels_last weights, ZeRO stages 1 and 2 over fusedist DDP, against torch AdamW."""
    import fusedist

    os.environ["FUSEDIST_KERNEL_BACKEND"] = "torch"
    out = {}
    ref = _convnet()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(4):
        x, y = _batch(step, shape=(3, 6, 6))
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x.to(memory_format=torch.channels_last)), y).backward()
        ref_opt.step()
    for stage in (1, 2):
        for inner in (torch.optim.AdamW, fusedist.optim.FusedAdamW):
            model = _convnet()
            ddp = fusedist.DistributedDataParallel(model, bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
            opt = fusedist.ZeroRedundancyOptimizer(ddp.parameters(), inner, stage=stage, lr=1e-2, weight_decay=0.1)
            for step in range(4):
                x, y = _batch(step, rank, world_size, shape=(3, 6, 6))
                opt.zero_grad()
                nn.functional.mse_loss(ddp(x.to(memory_format=torch.channels_last)), y).backward()
                opt.step()
            key = f"stage {stage} {inner.__name__}"
            out[key] = dict(
                channels_last=[model.conv1.weight.is_contiguous(memory_format=torch.channels_last),
                               model.conv2.weight.is_contiguous(memory_format=torch.channels_last)],
                diff=(_flat(model) - _flat(ref)).abs().max().item(),
            )
            full = opt.consolidate_state_dict()
            if rank == 0:  # the full state dict holds torch's values in the parameter's layout
                theirs = ref_opt.state_dict()["state"]
                out[key]["state_diff"] = max((full["state"][i][k].float() - v).abs().max().item()
                                             for i, st in theirs.items() for k, v in st.items() if k != "step")
    return out


def test_zero_keeps_channels_last_and_matches_adamw(launched2):
    for per_rank in results_of(launched2, "memory format"):
        for key, item in per_rank.items():
            assert item["channels_last"] == [True, True], (key, item)
            assert item["diff"] < TOL, (key, item)
            assert item.get("state_diff", 0.0) < TOL, (key, item)


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 2))
    model[0].requires_grad_(False)  # the layer unfrozen at step UNFREEZE_AT
    return model


def _base_groups(model, all_params):
    """Weights decay, biases do not; with ``all_params`` the frozen layer is in them too (a
    fine-tuning script passing model.parameters())."""
    named = [(n, p) for n, p in model.named_parameters() if all_params or p.requires_grad]
    return [dict(params=[p for n, p in named if n.endswith("weight")], weight_decay=0.1),
            dict(params=[p for n, p in named if n.endswith("bias")], weight_decay=0.0, lr=5e-3)]


def _unfrozen_group(model):
    return dict(params=list(model[0].parameters()), lr=2e-2, weight_decay=0.05)


def _reference(how, inner_kind):
    """Unsharded torch optimizer on the global batch, the same unfreezing schedule."""
    model = _mlp()
    opt = _torch_opt(inner_kind, _base_groups(model, how == "frozen at construction"))
    for step in range(STEPS):
        if step == UNFREEZE_AT:
            model[0].requires_grad_(True)
            if how == "add_param_group":
                opt.add_param_group(_unfrozen_group(model))
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


def _torch_opt(kind, groups):
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=1e-2, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)


def _zero_run(rank, world_size, how, inner_kind, stage, ddp, overlap=False):
    import torch.distributed as dist

    import fusedist

    module = _mlp()
    model = fusedist.DistributedDataParallel(module, bucket_cap_mb=0.002, first_bucket_cap_mb=0.001) if ddp else module
    inner = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW, "fused": fusedist.optim.FusedAdamW}[inner_kind]
    hyper = dict(lr=1e-2, momentum=0.9, weight_decay=0.01) if inner_kind == "sgd" else dict(lr=1e-2, weight_decay=0.1)
    opt = fusedist.ZeroRedundancyOptimizer(_base_groups(module, how == "frozen at construction"), inner, stage=stage,
                                           overlap_param_gather=overlap, bucket_cap_mb=0.002, **hyper)
    for step in range(STEPS):
        if step == UNFREEZE_AT:
            module[0].requires_grad_(True)
            if how == "add_param_group":
                opt.add_param_group(_unfrozen_group(module))
        x, y = _batch(step, rank, world_size)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if not ddp:
            for p in module.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad.div_(world_size)
        opt.step()
    opt.wait_for_params()
    return module, opt


def _grow_worker(rank, world_size):
    os.environ["FUSEDIST_KERNEL_BACKEND"] = "torch"  # FusedAdamW's PyTorch path (kernels tested elsewhere)
    configs = []
    for how in ("add_param_group", "frozen at construction"):
        for stage in (1, 2):
            configs.append(dict(how=how, inner_kind="fused", stage=stage, ddp=True))
        configs.append(dict(how=how, inner_kind="adamw", stage=1, ddp=False))
    configs += [dict(how="add_param_group", inner_kind="sgd", stage=2, ddp=True),
                dict(how="add_param_group", inner_kind="adamw", stage=2, ddp=True, overlap=True)]
    refs = {}
    out = []
    for cfg in configs:
        key = (cfg["how"], "sgd" if cfg["inner_kind"] == "sgd" else "adamw")
        if key not in refs:
            refs[key] = _reference(*key)
        ref_model, ref_opt = refs[key]
        module, opt = _zero_run(rank, world_size, **cfg)
        item = dict(cfg=cfg, diff=(_flat(module) - _flat(ref_model)).abs().max().item())
        full = opt.consolidate_state_dict()
        if rank == 0:
            theirs = ref_opt.state_dict()
            item["groups"] = [len(g["params"]) for g in full["param_groups"]] == [
                len(g["params"]) for g in theirs["param_groups"]]
            item["state_keys"] = sorted(full["state"]) == sorted(theirs["state"])
            item["state_diff"] = max(
                (full["state"][i][k].float() - v.float()).abs().max().item() if k != "step"
                else abs(float(full["state"][i][k]) - float(v))
                for i, st in theirs["state"].items() for k, v in st.items() if k in full["state"].get(i, {}))
        out.append(item)
    return out


@pytest.mark.parametrize("world_size", [2, 3], ids=lambda w: f"world{w}")
def test_parameters_joining_after_construction_match_unsharded(world_size, request):
    for per_rank in results_of(request.getfixturevalue(f"launched{world_size}"), "grow"):
        for item in per_rank:
            assert item["diff"] < TOL, item
            if "groups" in item:
                assert item["groups"] and item["state_keys"], item
                assert item["state_diff"] < TOL, item


def _gradients_apart_worker(rank, world_size):
    """Without a DDP model, 3 ranks, parameters cut by the shard boundaries (63 elements, 21 a rank): rank 2
    alone backward-s another batch; the same batch everywhere but rank 1 without the last bias's gradient;
    rank 0 alone with an inf. Each first step is refused on every rank (Note [gradients nobody averaged] in
    fusedist/zero/grad_agreement.py); then the same gradients everywhere step as torch's AdamW on them."""
    import fusedist

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3))
    ref = copy.deepcopy(model)
    opt = fusedist.ZeroRedundancyOptimizer(model.named_parameters(), torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def backward(m, seed):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
        m.zero_grad()
        m(x).square().mean().backward()

    errors = {}
    for case in ("rank 2 apart", "rank 1 without a gradient", "rank 0 with an inf"):
        backward(model, 1 if case == "rank 2 apart" and rank == 2 else 0)
        if case == "rank 1 without a gradient" and rank == 1:
            model[2].bias.grad = None
        if case == "rank 0 with an inf" and rank == 0:
            model[0].bias.grad[1] = float("inf")
        errors[case] = models.raised_timed(opt.step)[0]
    backward(model, 0)
    backward(ref, 0)
    opt.step()
    ref_opt.step()
    return {"errors": errors, "diff": (_flat(model) - _flat(ref)).abs().max().item()}


def test_gradients_apart_on_one_of_three_ranks_are_refused(launched3):
    """The error names the first parameter whose gradients differ and two ranks that differ there."""
    expected = {
        "rank 2 apart": "parameter 0 ('0.weight', shape (5, 8)) (other values: rank 0 has a gradient of norm ",
        "rank 1 without a gradient": "parameter 3 ('2.bias', shape (3,)) (a gradient on some ranks only: rank 0 "
                                     "has a gradient of norm ",
        "rank 0 with an inf": "parameter 1 ('0.bias', shape (5,)) (inf/nan on some ranks only: rank 0 has a "
                              "gradient holding inf/nan, rank 1 a gradient of norm ",
    }
    for rank, result in enumerate(results_of(launched3, "gradients apart")):
        for case, text in expected.items():
            error = result["errors"][case]
            assert error is not None and error.startswith(
                f"RuntimeError: ZeroRedundancyOptimizer (rank {rank}): gradients differ across ranks at {text}"), error
        assert ", rank 2 a gradient of norm " in result["errors"]["rank 2 apart"]
        assert ", rank 1 no gradient)" in result["errors"]["rank 1 without a gradient"]
        assert result["diff"] < TOL, result["diff"]


# The 2-rank cases share one launch (both workers select the torch kernel backend and build
# their own models); the 3-rank one has its own.
@pytest.fixture(scope="module")
def launched2(request):
    return launch_for_selected(request, {
        "test_zero_keeps_channels_last_and_matches_adamw": {"memory format": (_memory_format_worker, ())},
        "test_parameters_joining_after_construction_match_unsharded": {"grow": (_grow_worker, ())},
    }, 2, timeout=600)


@pytest.fixture(scope="module")
def launched3(request):
    return launch_for_selected(request, {
        "test_parameters_joining_after_construction_match_unsharded": {"grow": (_grow_worker, ())},
        "test_gradients_apart_on_one_of_three_ranks_are_refused": {"gradients apart": (_gradients_apart_worker, ())},
    }, 3, timeout=400)
