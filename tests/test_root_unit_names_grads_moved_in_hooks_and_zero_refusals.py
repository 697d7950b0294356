"""Small follow-ups, each against torch where torch answers:

* ``fully_shard`` units named alike everywhere: the root's own unit is "the root module (Net)" in
  collective tags (timeouts, stall reports), in the meta-device and mixed-conversion refusals, and in
  ``clip_grad_norm_``'s refusal of mixed holders (was "<root> (Net)", "fully_shard(Net)", "root").
* DDP: ``p.grad.data = t`` in a post-accumulate-grad hook of the user's, during the backward: ``p.grad``
  keeps ``t``'s memory and ``t`` receives the average, as under torch's DDP (was: ``p.grad`` replaced by
  the bucket's slot after ``zero_grad()``, or ``t`` left with this rank's own values when the gradient
  was kept across steps -- the ranks stepped apart).
* ZeroRedundancyOptimizer's rank-local refusals name the rank; a host lacking the default optimizer
  class refuses after the ranks' comparison, so every rank fails at once naming it.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fusedist.fsdp.pieces import PieceMixin
from fusedist.fsdp.unit import ShardedUnit
from shared_rank_launch import launch_for_selected, results_of


class _Unit:
    """What the naming reads of a unit: its class, its path under the root once the root named it
    (None before, "" for the root's own unit) and its parameters' names in it."""

    label = ShardedUnit.label
    check_materialized = ShardedUnit.check_materialized
    mixed_conversion = PieceMixin.mixed_conversion
    is_meta = True

    def __init__(self, name, path, names, data=()):
        self.name, self.path, self.names, self.member_paths = name, path, names, None
        self.sharded, self._data = list(data), list(data)
        self.layout = SimpleNamespace(mixed=False)

    def piece_data(self, i):
        return self._data[i]


def test_the_root_unit_is_the_root_module_in_tags_and_refusals():
    root, block = _Unit("Net", "", ["head.weight"]), _Unit("Block", "blocks.0", ["fc.weight"])
    assert root.label == "the root module (Net)" and block.label == "blocks.0 (Block)"
    assert _Unit("Net", None, []).label == "Net"  # (before the root's first forward)
    with pytest.raises(RuntimeError) as err:
        root.check_materialized()
    assert str(err.value).startswith("fusedist.fully_shard: the parameters (head.weight) of the root module (Net) "
                                     "are still on the meta device"), str(err.value)
    with pytest.raises(RuntimeError, match=r"\(blocks\.0\.fc\.weight\) of fully_shard\(Block\)"):
        block.check_materialized()
    mixed = _Unit("Net", "", ["a.weight", "b.weight"], [torch.zeros(2), torch.zeros(2, dtype=torch.float64)])
    text = mixed.mixed_conversion()
    assert text.startswith("fusedist.fully_shard: a conversion changed the dtype of some parameters of the root "
                           "module (Net) and not others ('a.weight' torch.float32, 'b.weight' torch.float64)"), text


def test_a_changed_bucket_layout_is_refused_naming_the_rank_and_the_bucket():
    from fusedist.zero.grow import on_layout_change

    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
    built = SimpleNamespace(dtype=torch.float32, start=0, end=5, offsets=[0, 2], params=[a, b], names=["a", "b"])
    other = SimpleNamespace(dtype=torch.float32, start=0, end=5, offsets=[0, 3], params=[b, a], names=["b", "a"])
    zero = SimpleNamespace(rank=1, _partition=SimpleNamespace(buckets=[built]))
    with pytest.raises(RuntimeError) as err:
        on_layout_change(zero, SimpleNamespace(buckets=[other]))
    said = str(err.value)
    assert said.startswith("ZeroRedundancyOptimizer (rank 1): the DDP bucket layout changed after the shards "
                           "were built (bucket 0: parameter offsets [0, 2] before, [0, 3] now)"), said
    moved = SimpleNamespace(dtype=torch.float32, start=0, end=5, offsets=[0, 2], params=[b, a], names=["b", "a"])
    with pytest.raises(RuntimeError, match=r"\(bucket 0: other parameters now \(b, a\)\)"):
        on_layout_change(zero, SimpleNamespace(buckets=[moved]))


# ---------------------------------------------------------------- on the ranks (one launch)

def _moved_in_a_hook(rank: int, world: int) -> dict:
    """``p.grad.data = t`` in a post-accumulate-grad hook at the third backward, after ``zero_grad()``
    at every step ("set to none") or with the gradients kept from the first ("kept"), on torch's DDP
    and fusedist's: whether each ``p.grad`` is on its ``t``'s memory, and ``t``'s values."""
    import fusedist

    out = {}
    for keep in (False, True):
        for name, wrap in (("torch", nn.parallel.DistributedDataParallel),
                           ("fusedist", fusedist.DistributedDataParallel)):
            torch.manual_seed(0)
            model = wrap(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)))
            params = list(model.parameters())
            moved, swap = {}, [False]

            def hook(p, params=params, moved=moved, swap=swap):
                if swap[0]:
                    k = next(i for i, q in enumerate(params) if q is p)
                    moved[k] = torch.full_like(p.grad, float(rank + 1) * (k + 1)) + torch.rand_like(p.grad)
                    p.grad.data = moved[k]

            for p in params:
                p.register_post_accumulate_grad_hook(hook)
            gen = torch.Generator().manual_seed(rank)
            for step in range(3):
                if not keep or step == 0:
                    model.zero_grad()
                swap[0] = step == 2
                model(torch.randn(3, 4, generator=gen)).sum().backward()
            out["kept" if keep else "set to none", name] = [
                (p.grad.data_ptr() == moved[k].data_ptr(), moved[k].clone()) for k, p in enumerate(params)]
    return out


def _no_sync_last(rank: int, world: int) -> str:
    """The last backward under ``no_sync()`` before a stage-2 step: the optimizer's own refusal, on this
    rank (the launch runs with the checks off: the step guard, which refuses it first otherwise and names
    the rank already, is installed once per process by the first model wrapped with the checks on)."""
    import fusedist

    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(nn.Linear(4, 2))
    opt = fusedist.ZeroRedundancyOptimizer(list(model.parameters()), torch.optim.SGD, stage=2, lr=0.1)
    with model.no_sync():
        model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError) as err:
        opt.step()
    return str(err.value)


def _default_class_missing_on_rank_1(rank: int, world: int) -> tuple:
    """Rank 1's installation lacks FusedAdamW (the default ``optimizer_class``): each rank's error
    and how long it took."""
    import fusedist
    import fusedist.optim

    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(nn.Linear(4, 2))
    held = fusedist.optim.FusedAdamW
    if rank == 1:
        del fusedist.optim.FusedAdamW
    start = time.monotonic()
    try:
        with pytest.raises(Exception) as err:
            fusedist.ZeroRedundancyOptimizer(list(model.parameters()), lr=0.1)
    finally:
        fusedist.optim.FusedAdamW = held
    return type(err.value).__name__, str(err.value), time.monotonic() - start


_SCENARIOS = {
    "test_a_gradient_moved_in_a_hook_during_backward_stays_and_takes_the_average_as_under_torch": {
        "moved in a hook": (_moved_in_a_hook, ())},
    "test_zero_refusals_of_one_rank_name_it_and_fail_every_rank_at_once": {
        "no_sync last": (_no_sync_last, ()),
        "default class missing": (_default_class_missing_on_rank_1, ())},
}


@pytest.fixture(scope="module")
def launched(request):
    # (FUSEDIST_CHECKS=0: see _no_sync_last; the other scenarios read nothing the checks give)
    return launch_for_selected(request, _SCENARIOS, 2, timeout=180, pg_timeout=60, env={"FUSEDIST_CHECKS": "0"})


def test_a_gradient_moved_in_a_hook_during_backward_stays_and_takes_the_average_as_under_torch(launched):
    for rank, out in enumerate(results_of(launched, "moved in a hook")):
        for case in ("set to none", "kept"):
            theirs, ours = out[case, "torch"], out[case, "fusedist"]
            assert all(on_t for on_t, _ in theirs), (case, "torch's p.grad left t")  # (what torch does)
            for k, ((on_t, t), (_, ref)) in enumerate(zip(ours, theirs)):
                assert on_t, (rank, case, k, "p.grad is no longer on t's memory")
                torch.testing.assert_close(t, ref, rtol=1e-6, atol=1e-6, msg=lambda m: f"{rank} {case} {k}: {m}")


def test_zero_refusals_of_one_rank_name_it_and_fail_every_rank_at_once(launched):
    for rank, text in enumerate(results_of(launched, "no_sync last")):
        assert f"ZeroRedundancyOptimizer(stage=2).step() (rank {rank}): the last backward ran under no_sync()" in text
    errors = results_of(launched, "default class missing")
    for rank, (kind, text, seconds) in enumerate(errors):
        assert "rank 1" in text and "FusedAdamW is unavailable on this host" in text, (rank, kind, text)
        assert seconds < 20, (rank, seconds, text)  # (the comparison answers: no wait for a timeout)
