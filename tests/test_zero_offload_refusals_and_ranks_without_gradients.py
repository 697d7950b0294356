"""``ZeroRedundancyOptimizer(offload="cpu")``: a hyperparameter the host Adam cannot run is
refused by every rank before anything is updated, and the step can then be retried; and a rank
without gradients, without a DDP model, still joins the others' all-gathers.

The host step updates and all-gathers bucket by bucket. When the kernel's own check was the
only one, a bad value in one param group (a schedule that made the learning rate NaN, betas
edited to 1.0) raised on the ranks whose shard held a piece of that group -- after earlier
buckets had been stepped -- while the other ranks stepped on into an all-gather the failing
rank never joined: parameters and step counts diverged across ranks, and the job hung.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shared_rank_launch import launch_for_selected, results_of


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def _groups(model):
    """Group 1 is only the last bias: its two elements lie in one rank's shard."""
    ps = list(model.parameters())
    return [dict(params=ps[:-1]), dict(params=ps[-1:], weight_decay=0.0)]


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _refused_then_retried(rank, world_size, key, bad):
    import fusedist

    model = _model()
    ref = _model()
    ddp = fusedist.DistributedDataParallel(model, bucket_cap_mb=0.0005, first_bucket_cap_mb=0.0002)
    ref_ddp = nn.parallel.DistributedDataParallel(ref)
    opt = fusedist.ZeroRedundancyOptimizer(_groups(model), torch.optim.AdamW, offload="cpu", lr=1e-2)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2)
    gen = torch.Generator().manual_seed(10 + rank)
    out = {}
    for step in range(3):
        x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 2, generator=gen)
        for m, o in ((ddp, opt), (ref_ddp, ref_opt)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
        ref_opt.step()
        if step == 1:
            good = opt.param_groups[1][key]
            before = _flat(model)
            opt.param_groups[1][key] = bad
            try:
                opt.step()
                out["error"] = None
            except ValueError as e:
                out["error"] = str(e)
            out["changed"] = int((_flat(model) != before).sum())
            out["steps"] = sorted({float(s["step"]) for s in opt.inner.state.values()})
            dist.barrier()  # every rank is here: none is left in a parameter all-gather
            opt.param_groups[1][key] = good
        opt.step()  # the refused step again, with the gradients it kept
    opt.wait_for_params()
    out["diff"] = (_flat(model) - _flat(ref)).abs().max().item()
    return out


BAD = {"betas": (0.9, 1.0), "lr": float("nan")}


@pytest.mark.parametrize("key,message", [
    ("betas", r"betas must lie in \[0, 1\)"),
    ("lr", "lr and weight_decay must be finite"),
], ids=["betas", "lr"])
def test_a_bad_hyperparameter_is_refused_on_every_rank_before_any_update(key, message, launched):
    import re

    bad = BAD[key]
    for rank, out in enumerate(results_of(launched, f"refused {key}")):
        assert out["error"] is not None, f"rank {rank} stepped with {key}={bad}"
        assert "param group 1" in out["error"] and re.search(message, out["error"]), out["error"]
        assert out["changed"] == 0, f"rank {rank}: {out['changed']} parameter elements changed by a refused step"
        assert out["steps"] == [1.0], f"rank {rank}: step counts {out['steps']} after a refused step"
        assert out["diff"] < 1e-6, f"rank {rank}: after the retried step, max |fusedist - torch| = {out['diff']}"


def _rank_without_gradients(rank, world_size, offload):
    import fusedist

    model = _model()
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, stage=1,
                                           offload=offload, lr=1e-2)
    errors = []
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        if not (rank == 1 and step == 1):  # (no DDP model: rank 1 alone has no gradients in step 1)
            # (the same batch on every rank: the first step refuses gradients that differ across ranks,
            # Note [gradients nobody averaged] in fusedist/zero/grad_agreement.py)
            g = torch.Generator().manual_seed(10 * step)
            model(torch.randn(4, 16, generator=g)).square().mean().backward()
        try:  # (alike at the first step, so unlike in this one: every rank raises at its end,
            opt.step()  # Note [gradients compared at every step] in fusedist/zero/carried_agreement.py)
        except RuntimeError as exc:
            errors.append(f"step {step}: {exc}")
    return _flat(model), errors


def test_a_rank_without_gradients_joins_the_offloaded_gathers(launched):
    """Without a DDP model a rank with no gradient returned from step() at once under offload,
    and the rank that stepped waited in its all-gather until the timeout; without offload it
    all-gathers its slices as they are. Both now agree (the host Adam within fp32 rounding of
    torch's AdamW), and every rank ends with the same parameters -- and, the gradients having been alike
    at the first step, every rank says at the end of that step that they differed."""
    offloaded = results_of(launched, "without gradients, offloaded")
    on_device = results_of(launched, "without gradients, on device")
    assert torch.equal(offloaded[0][0], offloaded[1][0])
    torch.testing.assert_close(offloaded[0][0], on_device[0][0], rtol=1e-5, atol=1e-6)
    for rank, (_, errors) in enumerate(offloaded + on_device):  # the gradients differed: said on every rank
        assert len(errors) == 1 and errors[0].startswith(f"step 1: ZeroRedundancyOptimizer (rank {rank % 2}): at "
                                                         "step 2 the gradients differ across ranks"), errors
        assert "a gradient on some ranks only: rank 0 has a gradient of norm" in errors[0], errors


@pytest.fixture(scope="module")
def launched(request):
    """The scenarios of the tests above in one launch of 2 ranks (each launch costs a process
    group and the imports of torch in every rank). A rank left waiting in an all-gather the
    other never joins fails after FUSEDIST_TIMEOUT_S, not at the launch's limit."""
    return launch_for_selected(request, {
        "test_a_bad_hyperparameter_is_refused_on_every_rank_before_any_update": {
            f"refused {key}": (_refused_then_retried, (key, bad)) for key, bad in BAD.items()},
        "test_a_rank_without_gradients_joins_the_offloaded_gathers": {
            "without gradients, offloaded": (_rank_without_gradients, ("cpu",)),
            "without gradients, on device": (_rank_without_gradients, (None,))},
    }, 2, timeout=300, env={"FUSEDIST_TIMEOUT_S": "20"})
