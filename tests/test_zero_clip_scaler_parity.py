"""ZeroRedundancyOptimizer with fusedist's GradScaler and clip where a user departs from the
plain loop, against torch DDP + torch's optimizer, GradScaler and clip on the same data (2 gloo
ranks, one launch for all; fp32, within 1e-6; loss scales are powers of two, so unscaling is exact):

* gradients replaced after the clip (stage 1): torch's clip scaled the old tensors only;
* gradients accumulated after the clip (a second backward; an in-place write in stage 1):
  torch's result needs values that are gone, so the step refuses before anything changes;
* a step with no backward since the last one: torch's GradScaler raises "No inf checks were
  recorded for this optimizer.";
* FusedSGD (momentum, dampening) as the inner optimizer after an overflowed first step: the
  consolidated state holds no momentum buffer (torch's SGD has none then), so torch's SGD
  loading it continues as fusedist does.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shared_rank_launch import launch_for_selected, results_of

TOL = 1e-6


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 6, generator=g), torch.randn(5, 6, generator=g)


def _pair(stage, inner=torch.optim.AdamW, **kw):
    import fusedist

    base = _net()
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base))
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    opt = fusedist.ZeroRedundancyOptimizer(ours.parameters(), inner, stage=stage, lr=0.05, **kw)
    ref = (torch.optim.SGD if inner.__name__.endswith("SGD") else torch.optim.AdamW)(theirs.parameters(), lr=0.05, **kw)
    return (ours, theirs, opt, ref, fusedist.amp.GradScaler("cpu", init_scale=2.0 ** 8),
            torch.amp.GradScaler("cpu", init_scale=2.0 ** 8))


def _diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _replaced_after_clip_worker(rank, ws):
    import fusedist

    ours, theirs, opt, ref, sc, ref_sc = _pair(1)
    for step in range(3):
        x, _ = _batch(rank, step)
        for m, o, s in ((ours, opt, sc), (theirs, ref, ref_sc)):
            o.zero_grad()
            s.scale(m(x).square().sum()).backward()
            s.unscale_(o)
            (fusedist.clip_grad_norm_ if o is opt else nn.utils.clip_grad_norm_)(m.parameters(), 0.05)
            last = list(m.parameters())[-1]
            last.grad = torch.full_like(last, 0.25)  # replaced: not clipped in torch
            s.step(o)
            s.update()
    return _diff(ours, theirs)


def test_stage1_gradient_replaced_after_the_clip_steps_unclipped_as_torch(launched):
    for diff in results_of(launched, "replaced"):
        assert diff < TOL, diff


def _accumulated_after_clip_worker(rank, ws, stage, scaled):
    ours, _, opt, _, sc, _ = _pair(stage)
    x, x2 = _batch(rank, 0)
    scale = sc.scale if scaled else (lambda loss: loss)
    scale(ours(x).square().sum()).backward()
    if scaled:
        sc.unscale_(opt)
    opt.clip_grad_norm_(0.05)
    if stage == 1:
        list(ours.parameters())[0].grad.add_(1.0)  # written in place after the clip
    else:
        scale(ours(x2).square().sum()).backward()  # a second backward adds to the shards
    before = [p.detach().clone() for p in ours.parameters()]
    try:
        sc.step(opt) if scaled else opt.step()
        return None
    except RuntimeError as exc:
        unchanged = all(torch.equal(a, p) for a, p in zip(before, ours.parameters()))
        return str(exc), unchanged


ACCUMULATED = [(1, True, "after fusedist.clip_grad_norm_"),
               (2, False, "a backward accumulated gradients after the clip"),
               (2, True, "changed after GradScaler.unscale_ (a backward")]


@pytest.mark.parametrize("stage,scaled,says", ACCUMULATED)
def test_gradients_accumulated_after_the_clip_are_refused_before_any_change(stage, scaled, says, launched):
    for out in results_of(launched, f"accumulated {stage} {scaled}"):
        assert out is not None, "the step used the clip coefficient on gradients written after the clip"
        message, unchanged = out
        assert says in message, message
        assert unchanged


def _no_backward_worker(rank, ws, stage):
    out = {}
    for who in ("ours", "torch"):
        ours, theirs, opt, ref, sc, ref_sc = _pair(stage)
        m, o, s = (ours, opt, sc) if who == "ours" else (theirs, ref, ref_sc)
        x, _ = _batch(rank, 0)
        s.scale(m(x).square().sum()).backward()
        s.step(o)
        s.update()
        o.zero_grad()
        try:
            s.step(o)  # no backward since the last step
            out[who] = None
        except AssertionError as exc:
            out[who] = str(exc)
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_a_step_without_a_backward_raises_as_torch(stage, launched):
    for out in results_of(launched, f"no backward {stage}"):
        assert out["torch"] == "No inf checks were recorded for this optimizer."
        assert out["ours"] == out["torch"], out


def _sgd_overflow_worker(rank, ws, stage):
    import fusedist

    kw = dict(momentum=0.9, dampening=0.3, weight_decay=0.01)
    ours, theirs, opt, ref, sc, ref_sc = _pair(stage, fusedist.optim.FusedSGD, **kw)
    for step in range(3):
        x, _ = _batch(rank, step)
        for m, o, s in ((ours, opt, sc), (theirs, ref, ref_sc)):
            o.zero_grad()
            loss = m(x).square().sum() * (float("inf") if step == 0 else 1.0)  # the first step overflows
            s.scale(loss).backward()
            s.step(o)
            s.update()
        if step == 0:
            opt.consolidate_state_dict(to=0)
            consolidated = opt.state_dict()["state"] if rank == 0 else None
            torch_state = ref.state_dict()["state"]
    return _diff(ours, theirs), consolidated, torch_state


@pytest.mark.parametrize("stage", [1, 2])
def test_fused_sgd_inside_zero_after_an_overflowed_first_step(stage, launched):
    results = results_of(launched, f"sgd overflow {stage}")
    for diff, _, _ in results:
        assert diff < TOL, diff
    consolidated, torch_state = results[0][1], results[0][2]
    # torch's SGD has no state after a skipped first step; a zero momentum buffer would be
    # decayed by the SGD loading it (with dampening, (1 - dampening) * grad instead of grad).
    assert torch_state == {}
    assert consolidated == {}, {k: sorted(v) for k, v in consolidated.items()}


def _clip_before_unscale_worker(rank, ws, kind):
    import fusedist
    from fusedist.optim import FusedAdamW

    if kind == "FusedAdamW":
        base = _net()
        ours = fusedist.DistributedDataParallel(copy.deepcopy(base))
        theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
        opt, ref = FusedAdamW(ours.parameters(), lr=0.05), torch.optim.AdamW(theirs.parameters(), lr=0.05)
        sc, ref_sc = (fusedist.amp.GradScaler("cpu", init_scale=2.0 ** 8),
                      torch.amp.GradScaler("cpu", init_scale=2.0 ** 8))
        clip = fusedist.clip_grad_norm_
    else:
        ours, theirs, opt, ref, sc, ref_sc = _pair(int(kind[-1]))
        clip = None
    norms = []
    for step in range(3):
        x, _ = _batch(rank, step)
        for m, o, s in ((ours, opt, sc), (theirs, ref, ref_sc)):
            o.zero_grad()
            s.scale(m(x).square().sum()).backward()
            # Clipped while still scaled (torch clips the scaled values: max_norm / scale in
            # true units), then unscaled.
            if o is ref:
                norms.append(nn.utils.clip_grad_norm_(m.parameters(), 2.0).item())
            else:
                norms.append((clip(m.parameters(), 2.0) if clip else o.clip_grad_norm_(2.0)).item())
            s.unscale_(o)
            s.step(o)
            s.update()
    return _diff(ours, theirs), norms


CLIP_KINDS = ["FusedAdamW", "stage 1", "stage 2"]


@pytest.mark.parametrize("kind", CLIP_KINDS)
def test_a_clip_before_unscale_clips_the_scaled_gradients_as_torch(kind, launched):
    for diff, norms in results_of(launched, f"clip before unscale {kind}"):
        ours, theirs = norms[0::2], norms[1::2]
        assert all(t > 2.0 for t in theirs), theirs  # the clip is active at every step
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=0)
        assert diff < TOL, (kind, diff)


@pytest.fixture(scope="module")
def launched(request):
    """Every selected test's scenarios in one launch of 2 ranks: each builds its own models,
    optimizers and scalers, so the scenarios are independent of their order."""
    return launch_for_selected(request, {
        "test_stage1_gradient_replaced_after_the_clip_steps_unclipped_as_torch": {
            "replaced": (_replaced_after_clip_worker, ())},
        "test_gradients_accumulated_after_the_clip_are_refused_before_any_change": {
            f"accumulated {stage} {scaled}": (_accumulated_after_clip_worker, (stage, scaled))
            for stage, scaled, _ in ACCUMULATED},
        "test_a_step_without_a_backward_raises_as_torch": {
            f"no backward {stage}": (_no_backward_worker, (stage,)) for stage in (1, 2)},
        "test_fused_sgd_inside_zero_after_an_overflowed_first_step": {
            f"sgd overflow {stage}": (_sgd_overflow_worker, (stage,)) for stage in (1, 2)},
        "test_a_clip_before_unscale_clips_the_scaled_gradients_as_torch": {
            f"clip before unscale {kind}": (_clip_before_unscale_worker, (kind,)) for kind in CLIP_KINDS},
    }, 2, timeout=300)
