"""The per-step check carried by the last bucket's all-reduce (Note [the check carried by the last
bucket] in fusedist/reliability/carried_check.py): no collective of its own on the default host
path, gradients as torch DDP's, and the same verdict and error as the check's own all-reduce. And
the dense all-reduce of a sparse-gradient weight: parts compared through the size exchange, not
fingerprints, and weights that differ across ranks still reported; likewise the average of the
gradients of parameters unfrozen after wrapping."""

import pytest
import torch
from torch import nn

import models
from shared_rank_launch import launch_for_selected
from fusedist.reliability import carried_check
from fusedist.reliability.step_check import FIELDS, JOINED


def test_rows_round_trip_through_a_float32_sum_exactly():
    """Every rank's values come back exactly from the sum of the ranks' tails, and the bounds are
    the max/min of the ranks still training (a joined rank neutral), in float32 and float64."""
    gen = torch.Generator().manual_seed(0)
    for dtype in carried_check.DTYPES:
        world = 5
        table = [[int(v) for v in torch.randint(-(2**62), 2**62, (len(FIELDS),), generator=gen)]
                 for _ in range(world)]
        # the edges of the int64 range and of the pieces, each in some field, whatever their count
        edges = [2**63 - 1, -(2**63), -1, 0, 1, 2**31 - 1, 2**32, 65535, 65536, 7]
        table[1] = [edges[i % len(edges)] for i in range(len(FIELDS))]
        table[2] = [edges[(i + len(FIELDS)) % len(edges)] for i in range(len(FIELDS))]
        table[3] = [JOINED] * len(FIELDS)
        total = sum(carried_check.encode(row, r, world, dtype) for r, row in enumerate(table))
        assert total.dtype == dtype and total.numel() == carried_check.tail_numel(len(FIELDS), world)
        assert carried_check.decode(total, world, len(FIELDS)) == table
        active = [row for row in table if row[0] != JOINED]
        expected = [max(c) for c in zip(*active)] + [max(-v for v in c) for c in zip(*active)]
        assert carried_check.bounds(table, JOINED) == expected


# ---------------------------------------------------------------- multi-rank scenarios (one launch)
class _Branchy(models.MLP):
    """The MLP whose second layer a forward may skip (its parameters then get no gradient)."""

    def forward(self, x, skip=False):
        for i, layer in enumerate(self.layers):
            if skip and i == 1:
                continue
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def _tags_of_a_step(model, opt, x, y) -> list:
    comm = model.watch.step_check.comm
    seen = []
    original = comm.all_reduce

    def recording(tensor, **kwargs):
        seen.append((kwargs.get("tag"), tensor.numel()))
        return original(tensor, **kwargs)

    comm.all_reduce = recording
    try:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    finally:
        del comm.all_reduce
    return seen


def _gradients_and_collectives(rank, world):
    """Gradients after each step against torch DDP's, on fresh inputs: one bucket, several small
    buckets (the last one held back to the end of backward), and unused parameters; and the
    collectives of a step: the buckets' all-reduces only, the last one with the check's tail."""
    import fusedist

    out = {}
    configs = {"one bucket": {}, "buckets": {"bucket_cap_mb": 0.002},
               "unused": {"find_unused_parameters": True, "bucket_cap_mb": 0.002}}
    for name, kwargs in configs.items():
        torch.manual_seed(0)
        base = _Branchy(layers=4)
        ours = fusedist.DistributedDataParallel(_Branchy(layers=4), **kwargs)
        ours.module.load_state_dict(base.state_dict())
        ref = nn.parallel.DistributedDataParallel(base, **kwargs)
        gen = torch.Generator().manual_seed(100 + rank)
        worst = 0.0
        for step in range(3):
            x, y = models.MLP.batch(gen)
            for m in (ours, ref):
                m.zero_grad(set_to_none=True)
                nn.functional.mse_loss(m(x, skip=name == "unused" and step == 1), y).backward()
            for a, b in zip(ours.parameters(), ref.parameters()):
                assert (a.grad is None) == (b.grad is None), (name, step)
                if a.grad is not None:
                    worst = max(worst, (a.grad - b.grad).abs().max().item())
        out[name] = (worst, ours.watch.carries(ours.reducer), len(ours.reducer.layout.buckets))
    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(models.MLP(), bucket_cap_mb=0.002)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    _tags_of_a_step(model, opt, *models.MLP.batch(gen))
    tags = _tags_of_a_step(model, opt, *models.MLP.batch(gen))
    last = model.reducer.layout.buckets[-1]
    out["tags"] = (tags, len(model.reducer.layout.buckets), last.numel)
    return out


def _skip_a_backward(model, rank):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for step in range(4):
        x, y = models.MLP.batch(gen)
        opt.zero_grad()
        try:
            loss = nn.functional.mse_loss(model(x), y)
        except Exception as exc:  # noqa: BLE001 - the verdict, compared by the test
            return type(exc).__name__, str(exc), step
        if rank == 1 and step == 1:
            continue
        loss.backward()
        opt.step()
    return "no error", "", -1


def _same_error_carried_or_not(rank, world):
    """A rank skips a backward: the verdict carried by the last bucket and the check's own
    all-reduce raise the same error at the same forward."""
    import fusedist

    out = {}
    for carried in (True, False):
        torch.manual_seed(0)
        model = fusedist.DistributedDataParallel(models.MLP())
        if not carried:
            model.reducer.check_carrier = None  # the check's own all-reduce, as on every other path
        carries = model.reducer.check_carrier is not None and model.watch.carries(model.reducer)
        out[carried] = _skip_a_backward(model, rank) + (carries,)
    return out


class _TiedEmbedding(nn.Module):
    """A sparse-gradient embedding whose weight is also used densely: its gradient is dense."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.out = nn.Linear(4, 3)

    def forward(self, idx):
        return self.out(self.emb(idx).sum(1)) + (self.emb.weight ** 2).sum() * 1e-2


def _sparse_weight_dense_average(rank, world):
    """The dense average of the tied weight against every rank's local gradient averaged with
    torch.distributed; whether its all-reduce skipped the fingerprints; then rank 1 replaces the
    weight with a larger one after wrapping: every rank raises, naming it, and the group goes on."""
    import torch.distributed as dist

    import fusedist

    torch.manual_seed(0)
    plain = _TiedEmbedding()
    model = fusedist.DistributedDataParallel(_TiedEmbedding())
    model.module.load_state_dict(plain.state_dict())
    comm = model.watch.step_check.comm
    calls = []
    original = comm.all_reduce

    def recording(tensor, **kwargs):
        calls.append((kwargs.get("tag"), kwargs.get("parts_checked", False)))
        return original(tensor, **kwargs)

    comm.all_reduce = recording
    gen = torch.Generator().manual_seed(10 + rank)
    idx, y = torch.randint(0, 10, (8, 3), generator=gen), torch.randn(8, 3, generator=gen)
    try:
        model.zero_grad()
        nn.functional.mse_loss(model(idx), y).backward()
    finally:
        del comm.all_reduce
    plain.zero_grad()
    nn.functional.mse_loss(plain(idx), y).backward()
    expected = plain.emb.weight.grad.to_dense()
    dist.all_reduce(expected)
    expected /= world
    got = model.module.emb.weight.grad
    error = (got.is_sparse, (got - expected).abs().max().item())
    model.zero_grad()
    if rank == 1:
        model.module.emb.weight.data = torch.randn(12, 4)
    try:
        nn.functional.mse_loss(model(idx), y).backward()
        raised = None
    except RuntimeError as exc:
        raised = str(exc)
    after = torch.ones(1)
    dist.all_reduce(after)  # still in step: nothing was launched with the weights that differ
    return error, [c for c in calls if "sparse gradient" in (c[0] or "")], raised, after.item()


def _unfrozen_average(rank, world, different: bool):
    """Two weights frozen at wrapping; at step 1 the same one is unfrozen on every rank (its first
    average against every rank's local gradient averaged with torch.distributed), or different ones
    with the step check off: every rank raises, naming them, and the group goes on."""
    import os

    import torch.distributed as dist

    import fusedist

    torch.manual_seed(0)
    plain = models.MLP()
    for layer in plain.layers[:2]:
        layer.weight.requires_grad_(False)
    copy = models.MLP()
    copy.load_state_dict(plain.state_dict())
    for layer in copy.layers[:2]:
        layer.weight.requires_grad_(False)
    if different:
        os.environ["FUSEDIST_CHECKS"] = "0"  # (read when the model is built)
    try:
        model = fusedist.DistributedDataParallel(copy)
    finally:
        os.environ.pop("FUSEDIST_CHECKS", None)
    comm = model.comm
    calls = []
    original = comm.all_reduce

    def recording(tensor, **kwargs):
        calls.append((kwargs.get("tag"), kwargs.get("parts_checked", False)))
        return original(tensor, **kwargs)

    gen = torch.Generator().manual_seed(20 + rank)
    raised = None
    for step in range(2):
        x, y = models.MLP.batch(gen)
        if step == 1:
            which = rank if different else 0
            model.module.layers[which].weight.requires_grad_(True)
            plain.layers[which].weight.requires_grad_(True)
            comm.all_reduce = recording
        model.zero_grad(set_to_none=True)
        try:
            nn.functional.mse_loss(model(x), y).backward()
        except RuntimeError as exc:
            raised = str(exc)
        finally:
            comm.__dict__.pop("all_reduce", None)
    after = torch.ones(1)
    dist.all_reduce(after)  # still in step: nothing was launched with the parts that differ
    if different:
        return raised, after.item()
    plain.zero_grad(set_to_none=True)
    nn.functional.mse_loss(plain(x), y).backward()
    expected = plain.layers[0].weight.grad
    dist.all_reduce(expected)
    expected /= world
    worst = (model.module.layers[0].weight.grad - expected).abs().max().item()
    return raised, worst, [c for c in calls if "unfrozen" in (c[0] or "")]


SCENARIOS = {
    "test_unfrozen_parameters_averaged_without_fingerprints_and_different_ones_reported": {
        "unfrozen same": (_unfrozen_average, (False,)), "unfrozen different": (_unfrozen_average, (True,))},
    "test_sparse_weight_averaged_dense_without_fingerprints_and_weights_that_differ_reported": {
        "sparse": (_sparse_weight_dense_average, ())},
    "test_gradients_match_torch_ddp_and_the_check_has_no_collective_of_its_own": {
        "grads": (_gradients_and_collectives, ())},
    "test_a_skipped_backward_raises_the_same_error_carried_or_not": {
        "skip": (_same_error_carried_or_not, ())},
}


@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, SCENARIOS, 2, timeout=180)


def _results(launched, name):
    per_rank = launched[name]
    for ok, result in per_rank:
        assert ok, result
    return [result for _, result in per_rank]


def test_gradients_match_torch_ddp_and_the_check_has_no_collective_of_its_own(launched):
    for rank, out in enumerate(_results(launched, "grads")):
        for name in ("one bucket", "buckets", "unused"):
            worst, carries, buckets = out[name]
            # fp32, world 2: the same divide-then-sum as torch DDP's, so equal to rounding at most
            assert worst <= 1e-6, (rank, name, worst)
            assert carries, (rank, name)
        assert out["buckets"][2] > 1 and out["unused"][2] > 1
        tags, buckets, last_numel = out["tags"]
        assert [t for t, _ in tags] == [f"ddp bucket {i}" for i in range(buckets)], tags
        assert tags[-1][1] == last_numel + carried_check.tail_numel(len(FIELDS), 2)


def test_a_skipped_backward_raises_the_same_error_carried_or_not(launched):
    for rank, out in enumerate(_results(launched, "skip")):
        kind, text, step, carries = out[True]
        assert carries and not out[False][3]
        assert kind == "RankMismatchError" and step == 2 + rank, (rank, kind, text)  # (rank 1 skipped one)
        assert "forward: ranks [0]: 2; ranks [1]: 3" in text, text
        assert out[True][:3] == out[False][:3], (out[True], out[False])


def test_sparse_weight_averaged_dense_without_fingerprints_and_weights_that_differ_reported(launched):
    for rank, (error, calls, raised, after) in enumerate(_results(launched, "sparse")):
        is_sparse, worst = error
        assert not is_sparse and worst <= 1e-6, (rank, error)  # fp32, world 2: one rounding at most
        assert calls == [("ddp sparse gradient emb.weight (dense)", True)], calls
        assert raised is not None and "parameter 'emb.weight'" in raised, (rank, raised)
        assert "ranks [0]: 40 x torch.float32; ranks [1]: 48 x torch.float32" in raised, raised
        assert after == 2.0


def test_unfrozen_parameters_averaged_without_fingerprints_and_different_ones_reported(launched):
    for rank, (raised, worst, calls) in enumerate(_results(launched, "unfrozen same")):
        assert raised is None, (rank, raised)
        assert worst <= 1e-6, (rank, worst)  # fp32, world 2: one rounding at most
        assert calls == [("ddp unfrozen used-map", False), ("ddp unfrozen gradients torch.float32", True)], calls
    for rank, (raised, after) in enumerate(_results(launched, "unfrozen different")):
        assert raised is not None and "differ in size or dtype across ranks" in raised, (rank, raised)
        name, numel = ("layers.0.weight", 512) if rank == 0 else ("layers.1.weight", 1024)
        assert f"(rank {rank})" in raised, raised
        assert f"'{name}' ({numel} elements here, 512..1024 across ranks)" in raised, raised
        assert after == 2.0
