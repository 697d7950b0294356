"""Adam's per-group ``decoupled_weight_decay`` and clips over some of a stage-2 optimizer's
parameters, against torch.

* torch's Adam and AdamW read ``decoupled_weight_decay`` per param group: a group added to an
  AdamW with False takes L2 decay, a group of an Adam with True takes AdamW's; AdamW's loader
  sets every loaded group to True, Adam's fills a missing key with False.
* ``torch.nn.utils.clip_grad_norm_`` over some of the parameters (timm's clip that leaves the
  head out) under ZeroRedundancyOptimizer(stage=2) clips those gradients by their global norm,
  as torch DDP + torch's optimizer does (2 gloo ranks; norms 2, 3 and inf; with and without a
  GradScaler; torch's clip, fusedist's, and torchtitan's ``get_total_norm`` +
  ``clip_grads_with_norm_``), and is refused under ``join()``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fusedist
from fusedist.optim import FusedAdam, FusedAdamW
from shared_rank_launch import launch_for_selected, results_of

import models


def _adam_run(cls, groups, **kw):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    opt = cls(groups(params), lr=0.1, weight_decay=0.3, **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach() for p in params], opt


def _first_apart(flag):
    return lambda params: [{"params": params[:1], "decoupled_weight_decay": flag}, {"params": params[1:]}]


@pytest.mark.parametrize("ours,theirs,groups,kw", [
    (FusedAdamW, torch.optim.AdamW, _first_apart(False), {}),
    (FusedAdam, torch.optim.Adam, _first_apart(True), {}),
    (FusedAdam, torch.optim.Adam, _first_apart(False), {"decoupled_weight_decay": True}),
], ids=["adamw-group-l2", "adam-group-decoupled", "adam-decoupled-group-l2"])
def test_decoupled_weight_decay_is_read_per_group_as_torch(ours, theirs, groups, kw):
    want, ref = _adam_run(theirs, groups, **kw)
    got, opt = _adam_run(ours, groups, **kw)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a)
    flags = [g["decoupled_weight_decay"] for g in opt.state_dict()["param_groups"]]
    assert flags == [g["decoupled_weight_decay"] for g in ref.state_dict()["param_groups"]]


def test_loaded_groups_take_torch_decoupled_weight_decay():
    params = [nn.Parameter(torch.randn(4))]
    for ours, theirs in ((FusedAdamW, torch.optim.AdamW), (FusedAdam, torch.optim.Adam)):
        for built in ({}, {"decoupled_weight_decay": True} if ours is FusedAdam else {}):
            for saved in (False, True, None):  # None: a state dict from before torch had the key
                got = []
                for cls in (theirs, ours):
                    opt = cls(params, **built)
                    sd = opt.state_dict()
                    if saved is None:
                        del sd["param_groups"][0]["decoupled_weight_decay"]
                    else:
                        sd["param_groups"][0]["decoupled_weight_decay"] = saved
                    opt.load_state_dict(sd)
                    got.append(opt.param_groups[0]["decoupled_weight_decay"])
                assert got[1] == got[0], (ours.__name__, built, saved, got)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.ModuleList(models.ResidualBlock(6) for _ in range(2))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        for block in self.body:
            x = block(x)
        return self.head(x)


def _titan(params, max_norm, norm_type):
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


_CLIPS = {
    "torch": lambda ps, m, nt: torch.nn.utils.clip_grad_norm_(ps, m, nt),
    "fusedist": lambda ps, m, nt: fusedist.clip_grad_norm_(ps, m, nt),
    "two calls": _titan,
}


def _some_params_worker(rank, ws):
    out = []
    for form, clip in _CLIPS.items():
        for norm_type, scaled in ((2.0, False), (2.0, True), (float("inf"), True), (3.0, False)):
            torch.manual_seed(0)
            base = _Net()
            theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
            ours = fusedist.DistributedDataParallel(copy.deepcopy(base))
            ref = torch.optim.AdamW(theirs.parameters(), lr=0.05)
            opt = fusedist.ZeroRedundancyOptimizer(ours.parameters(), torch.optim.AdamW, stage=2, lr=0.05)
            scale = 2.0 ** 6
            scalers = ((torch.amp.GradScaler("cpu", init_scale=scale), fusedist.amp.GradScaler("cpu", init_scale=scale))
                       if scaled else (None, None))
            norms = []
            for step in range(3):
                x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
                pair = []
                for model, o, sc in ((theirs, ref, scalers[0]), (ours, opt, scalers[1])):
                    o.zero_grad()
                    loss = model(x).square().sum() * 4
                    (sc.scale(loss) if sc else loss).backward()
                    if sc:
                        sc.unscale_(o)
                    # all but the head, as timm's exclude_head; the torch side always clips with torch's
                    some = list(model.parameters())[:-2]
                    pair.append(float((clip if o is opt else _CLIPS["torch"])(some, 0.2, norm_type)))
                    if sc:
                        sc.step(o)
                        sc.update()
                    else:
                        o.step()
                norms.append(pair)
            assert all(a > 0.2 for a, _ in norms), norms  # every step clipped
            weights = max((p - q).abs().max().item() for p, q in zip(ours.parameters(), theirs.parameters()))
            out.append((form, norm_type, scaled, norms, weights))
    return out


def test_zero2_clip_of_some_parameters_matches_torch_ddp(launched):
    for rank_out in results_of(launched, "some parameters"):
        for form, norm_type, scaled, norms, weights in rank_out:
            case = f"{form}, norm {norm_type}, scaled {scaled}"
            for want, got in norms:
                assert got == pytest.approx(want, rel=1e-5), (case, norms)
            assert weights < 1e-5, (case, weights)


def _join_worker(rank, ws):
    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(_Net())
    zero = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=0.05)
    with fusedist.Join([model, zero]):
        model(torch.randn(4, 6)).square().sum().backward()
        try:
            torch.nn.utils.clip_grad_norm_(list(model.parameters())[:-2], 0.2)
        except NotImplementedError as exc:
            message = str(exc)
        else:
            message = None
        zero.clip_grad_norm_(0.2)
        zero.step()
    return message


def test_zero2_clip_of_some_parameters_is_refused_under_join(launched):
    for message in results_of(launched, "join"):
        assert message is not None and "under join()" in message and "optimizer.clip_grad_norm_" in message


def _offload_worker(rank, ws):
    torch.manual_seed(0)
    base = _Net()
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base))

    def groups(model):  # the head's group takes L2 decay
        params = list(model.parameters())
        return [{"params": params[:-2]}, {"params": params[-2:], "decoupled_weight_decay": False}]

    ref = torch.optim.AdamW(groups(theirs), lr=0.05, weight_decay=0.5)
    opt = fusedist.ZeroRedundancyOptimizer(groups(ours), FusedAdamW, stage=2, offload="cpu", lr=0.05,
                                           weight_decay=0.5)
    norms = []
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        for model, o in ((theirs, ref), (ours, opt)):
            o.zero_grad()
            (model(x).square().sum() * 4).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(model.parameters())[:-2], 0.2)))
            o.step()
    return norms, max((p - q).abs().max().item() for p, q in zip(ours.parameters(), theirs.parameters()))


def test_zero2_host_offload_takes_group_decay_and_clips_some_parameters_as_torch(launched):
    for norms, weights in results_of(launched, "offload"):
        assert norms[1::2] == pytest.approx(norms[0::2], rel=1e-5)
        assert weights < 1e-5, weights


@pytest.fixture(scope="module")
def launched(request):
    """The file's two-rank scenarios in one launch."""
    return launch_for_selected(request, {
        "test_zero2_clip_of_some_parameters_matches_torch_ddp": {"some parameters": (_some_params_worker, ())},
        "test_zero2_clip_of_some_parameters_is_refused_under_join": {"join": (_join_worker, ())},
        "test_zero2_host_offload_takes_group_decay_and_clips_some_parameters_as_torch": {
            "offload": (_offload_worker, ())},
    }, 2, timeout=300)
