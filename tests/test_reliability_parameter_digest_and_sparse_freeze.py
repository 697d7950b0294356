"""Replicated parameters that differ across ranks, and sparse-gradient weights frozen on some
ranks only, are found by the per-step check and named (Note [parameter check] in
fusedist/reliability/param_check.py, Note [sparse weights in the step check] in
fusedist/reliability/engine_watch.py)."""

import os

import torch
from torch import nn

from fusedist.testing import run_distributed

# A short collective timeout: without the checks, the sparse case below ends in a stall.
ENV = {"FUSEDIST_PARAM_CHECK_EVERY": "2", "FUSEDIST_TIMEOUT_S": "5"}


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 2))


def _steps(model, opt, rank, steps, after=None):
    """``steps`` SGD steps on rank-dependent random batches; ``after(step)`` runs after each."""
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(steps):
        model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if after is not None:
            after(step)


def _equal_everywhere(params) -> bool:
    """Whether every rank holds the same values of ``params`` (the truth the check must tell)."""
    import torch.distributed as dist

    flat = torch.cat([p.detach().reshape(-1) for p in params])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return all(torch.equal(everyone[0], other) for other in everyone[1:])


def _outcome(fn):
    from fusedist import RankMismatchError

    try:
        fn()
    except RankMismatchError as exc:
        return str(exc)
    return None


def _parameters_worker(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook

    import fusedist
    from fusedist.zero import ZeroRedundancyOptimizer

    out = {}
    # A weight changed in place on rank 1 after step 1: found by the periodic check (every 2
    # synchronized backwards here), at the forward after backward #2.
    net = _net()
    model = fusedist.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def nudge(step):
        if step == 1 and rank == 1:
            with torch.no_grad():
                net[2].weight[0, 0] += 1e-4
        out["steps_run"] = step

    out["in_place"] = _outcome(lambda: _steps(model, opt, rank, 6, nudge))
    # Loaded on rank 0 only, after the last step: check_consistency() (as checkpoint.save) finds it.
    net = _net()
    model = fusedist.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _steps(model, opt, rank, 3)
    if rank == 0:
        net.load_state_dict({k: v + 1 for k, v in net.state_dict().items()})
    out["loaded_diverged"] = not _equal_everywhere(net.parameters())
    out["loaded"] = _outcome(model.check_consistency)
    # No false alarm where the replicas agree: ZeRO-2 with overlapped parameter gathers (in flight
    # until the next forward), checked right after its step.
    net = _net()
    model = fusedist.DistributedDataParallel(net)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, stage=2, lr=0.01, overlap_param_gather=True)
    out["zero2"] = _outcome(lambda: (_steps(model, opt, rank, 5), model.check_consistency()))
    out["zero2_equal"] = _equal_everywhere(net.parameters())
    # ... nor with uneven inputs under join(): a joined rank is left out of the comparison.
    net = _net()
    model = fusedist.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def uneven():
        with model.join():
            _steps(model, opt, rank, 3 + 2 * rank)
        model.check_consistency()

    out["join"] = _outcome(uneven)
    out["join_equal"] = _equal_everywhere(net.parameters())
    # ... nor where they differ by design: post-local SGD averages gradients over subgroups only.
    net = _net()
    model = fusedist.DistributedDataParallel(net)
    subgroup, _ = dist.new_subgroups(group_size=1)
    model.register_comm_hook(PostLocalSGDState(None, subgroup, start_localSGD_iter=2), post_localSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out["local_sgd"] = _outcome(lambda: (_steps(model, opt, rank, 5), model.check_consistency()))
    out["local_sgd_equal"] = _equal_everywhere(net.parameters())
    # FUSEDIST_PARAM_CHECK_EVERY=0 (read when the model is wrapped): no comparison at all.
    os.environ["FUSEDIST_PARAM_CHECK_EVERY"] = "0"
    net = _net()
    model = fusedist.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out["off"] = _outcome(lambda: _steps(model, opt, rank, 3, nudge) or model.check_consistency())
    return out


def test_replicated_parameters_that_differ_are_found_and_named():
    for rank, out in enumerate(run_distributed(_parameters_worker, 2, env=ENV, timeout=60)):
        message = out["in_place"]
        assert message is not None, f"rank {rank}: a weight changed on rank 1 went unnoticed"
        assert out["steps_run"] == 2, out  # raised at the forward after backward #2 (its check)
        assert "parameter '2.weight' (shape (2, 12)) differs across ranks: ranks [0] | ranks [1]" in message, message
        assert "periodic parameter check at synchronized backward #2" in message, message
        assert "'0.weight'" not in message, message  # only the parameter that differs is named
        assert out["loaded_diverged"], out
        assert out["loaded"] is not None and "found by check_consistency()" in out["loaded"], out
        assert "parameter '0.weight'" in out["loaded"] and "params:" in out["loaded"], out["loaded"]
        assert out["zero2"] is None and out["zero2_equal"], out
        assert out["join"] is None and out["join_equal"], out
        assert out["local_sgd"] is None and not out["local_sgd_equal"], out
        assert out["off"] is None, out


class _Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.head = nn.Linear(4, 1)

    def forward(self, idx):
        return self.head(self.emb(idx)).sum()


def _sparse_run(rank, freeze_on):
    """Four steps of a model with an nn.Embedding(sparse=True) whose weight the ranks in
    ``freeze_on`` freeze before step 2: the mismatch message (None if none) and the weight."""
    import fusedist

    torch.manual_seed(0)
    net = _Bag()
    model = fusedist.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)

    def run():
        for step in range(4):
            if step == 2 and rank in freeze_on:
                net.emb.weight.requires_grad_(False)
            model(torch.randint(0, 10, (5,), generator=gen)).backward()
            opt.step()
            opt.zero_grad()
        model.check_consistency()

    return _outcome(run), net.emb.weight.detach().clone()


def _sparse_worker(rank, world_size):
    return _sparse_run(rank, [1]), _sparse_run(rank, [0, 1])


def test_sparse_weight_frozen_on_one_rank_is_named_on_every_rank():
    """Rank 1 freezes an nn.Embedding(sparse=True): every rank raises at the end of that backward,
    naming the weight and the ranks, instead of a collective timeout; frozen on every rank alike,
    training goes on with equal replicas."""
    results = run_distributed(_sparse_worker, 2, env=ENV, timeout=60)
    for rank, ((message, _), _) in enumerate(results):
        assert message is not None, f"rank {rank}: no mismatch reported"
        assert "synchronized backward #2" in message and "reported at the end of that backward" in message, message
        assert "parameter 'emb.weight' (sparse gradients): requires_grad=True on ranks [0], False on ranks [1]" \
            in message, message
    alike = [result[1] for result in results]
    assert [message for message, _ in alike] == [None, None], alike
    assert torch.equal(alike[0][1], alike[1][1])


def test_digest_depends_on_the_bits_only_not_where_they_lie():
    """A parameter that is a view into a flat buffer at an odd offset (ZeRO's) is read as
    int64 words like any other copy of its bits; any changed element changes the digest."""
    from fusedist.reliability.param_check import tensor_digest

    flat = torch.randn(23)
    for start, size in ((1, 4), (2, 6), (3, 5), (0, 8)):
        view = flat[start:start + size]
        assert tensor_digest(view).item() == tensor_digest(view.clone()).item()
        changed = view.clone()
        changed[-1] = torch.nextafter(changed[-1], torch.tensor(float("inf")))
        assert tensor_digest(changed).item() != tensor_digest(view).item()
