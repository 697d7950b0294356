"""Replicated parameters that differ across ranks, and sparse-gradient weights frozen on some
ranks only, are found by the per-step check and named (Note [parameter check] in
fusedist/reliability/param_check.py, Note [sparse weights in the step check] in
fusedist/reliability/engine_watch.py); the parameter check names a parameter by its current path
after its ModuleList was renumbered, sees swapped and sign-flipped elements, and says that a gradient
changed after the average made the replicas differ.

The multi-rank scenarios of this file's tests share one launch of the ranks (starting them costs
more than the scenarios); each runs under the settings its test's own launch had."""

import os

import pytest
import torch
from torch import nn

from shared_rank_launch import launch_for_selected, results_of, under_env

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


def test_replicated_parameters_that_differ_are_found_and_named(launched):
    for rank, out in enumerate(results_of(launched, "parameters")):
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


def test_sparse_weight_frozen_on_one_rank_is_named_on_every_rank(launched):
    """Rank 1 freezes an nn.Embedding(sparse=True): every rank raises at the end of that backward,
    naming the weight and the ranks, instead of a collective timeout; frozen on every rank alike,
    training goes on with equal replicas."""
    results = results_of(launched, "sparse")
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


# ---------------------------------------------------------------- names after the module tree changed
# (Note [names follow the module] in fusedist/ddp/module_tree.py)
class _Stack(nn.Module):
    def __init__(self, head=()):
        super().__init__()
        self.layers = nn.ModuleList([*head, nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 2)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _diverge_after(change, rank, head=()):
    """Train, check, ``change`` the wrapped model's tree, train, make rank 1's copy of the middle
    Linear's weight differ, check again: (its current path, the check's message or None)."""
    import fusedist

    torch.manual_seed(0)
    net = _Stack(head)
    model = fusedist.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(10 + rank)

    def step():
        model(torch.randn(4, 6, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    model.check_consistency()  # the digest exists before the tree changes (built under wrap-time names)
    target = net.layers[len(head) + 1].weight
    change(net.layers)
    step()
    current = next(n for n, p in net.named_parameters() if p is target)
    if rank == 1:
        with torch.no_grad():
            target.add_(torch.randn(target.shape, generator=gen))
    try:
        model.check_consistency()
    except Exception as e:  # noqa: BLE001 -- the message is what is checked
        return current, str(e)
    return current, None


def _renumbering_worker(rank, world):
    return {
        # every Linear moves up one index: the middle one was wrapped as 'layers.1', is 'layers.2' now
        "insert": _diverge_after(lambda layers: layers.insert(0, nn.Identity()), rank),
        # every Linear moves down one index: the middle one was wrapped as 'layers.2', is 'layers.1' now
        "del": _diverge_after(lambda layers: layers.__delitem__(0), rank, head=[nn.ReLU()]),
    }


def test_parameter_check_names_current_path_after_renumbering(launched):
    """After a ModuleList insert or del renumbers its entries, the parameter check names a parameter
    that differs across ranks by its current path, not by the one it had when the model was wrapped."""
    for rank, out in enumerate(results_of(launched, "renumbering")):
        for case, expected, stale in (("insert", "layers.2.weight", "layers.1.weight"),
                                      ("del", "layers.1.weight", "layers.2.weight")):
            current, message = out[case]
            assert current == expected, (case, out)
            assert message is not None, f"rank {rank}, {case}: a weight changed on rank 1 went unnoticed"
            assert f"parameter '{current}' (shape (6, 6)) differs across ranks: ranks [0] | ranks [1]" in message, \
                (rank, case, message)
            assert f"'{stale}'" not in message, (rank, case, message)  # the wrap-time path: another Linear now


# ---------------------------------------------------------------- swapped and sign-flipped elements
# (Note [a digest that sees positions] in fusedist/reliability/param_check.py)
def _swap_worker(rank, world_size):
    import fusedist
    from fusedist import RankMismatchError

    out = {}
    for what in ("swap", "sign"):
        torch.manual_seed(0)
        model = fusedist.DistributedDataParallel(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        try:
            for step in range(3):
                model(torch.randn(4, 6, generator=gen)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                if step == 0 and rank == 1:
                    with torch.no_grad():
                        w = model.module[0].weight.view(-1)
                        if what == "swap":  # two elements of a replicated weight change places
                            w[[2, 8]] = w[[8, 2]].clone()
                        else:  # one element's sign, in the upper half of an int64 word
                            w[5] = -w[5]
            out[what] = None
        except RankMismatchError as exc:
            out[what] = str(exc)
    return out


def test_swapped_or_sign_flipped_weight_on_one_rank_is_named_on_every_rank(launched):
    for rank, out in enumerate(results_of(launched, "swap")):
        for what, message in out.items():
            assert message is not None, (rank, what)
            assert "parameter '0.weight'" in message and "ranks [0] | ranks [1] hold different values" in message, \
                message


# ---------------------------------------------------------------- a gradient changed after the average
# A gradient changed on one rank after DDP averaged it (code between backward() and step()): the
# ranks ran the same steps and collectives, only their parameters differ, and the error says so --
# it names gradients or weights changed on some ranks, not rank-dependent control flow (Note
# [parameters that differ after the same steps] in fusedist/reliability/step_check_text.py).
AFTER_REDUCE = "drifted apart after the reduce"
CONTROL_FLOW = "rank-dependent control flow"


def _edit_after_reduce(rank: int, world: int, optimizer: str) -> dict:
    """Four steps; on step 1, rank 1 adds 1 to one element of its averaged gradient (a
    rank-local edit). The parameter check (every step here) takes step 2's digest at the end of
    its backward; the verdict is read at step 3's forward."""
    import fusedist
    from fusedist import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    ddp = DDP(model)
    params = list(ddp.parameters())
    opt = torch.optim.SGD(params, lr=0.1) if optimizer == "torch" else fusedist.optim.FusedAdam(params, lr=0.01)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(4):
        try:
            loss = ddp(torch.randn(4, 6, generator=gen)).square().mean()
        except fusedist.RankMismatchError as exc:
            return {"step": step, "message": str(exc)}
        loss.backward()
        if step == 1 and rank == 1:
            model[0].weight.grad[2, 3] += 1.0
        opt.step()
        opt.zero_grad()
    return {"step": None, "message": None}


@pytest.mark.parametrize("optimizer", ["torch", "fused"])
def test_grad_changed_after_reduce_is_named_on_both_ranks(launched, optimizer):
    per_rank = results_of(launched, f"after reduce, {optimizer}")
    for rank, result in enumerate(per_rank):
        assert result["step"] == 3, (rank, result)  # step 2 backward digest, read at step 3
        message = result["message"]
        assert f"this is rank {rank}" in message
        assert "their parameters differ" in message
        assert "parameter '0.weight' (shape (5, 6)) differs across ranks: ranks [0] | ranks [1]" in message
        assert "'2.weight'" not in message and "'0.bias'" not in message  # (the edit reached only 0.weight)
        assert "changed its gradients after they were averaged" in message
        assert AFTER_REDUCE in message and "between backward() and optimizer.step()" in message
        assert CONTROL_FLOW not in message, message
    assert per_rank[0]["message"].replace("rank 0)", "rank 1)") == per_rank[1]["message"]


# ---------------------------------------------------------------- the shared launch
# {test: {scenario: (fn, args)}}, each under the settings its test's own launch had (the launch's
# own environment is the parent's, which each scenario finds again).
_EVERY_1 = {"FUSEDIST_PARAM_CHECK_EVERY": "1"}
SCENARIOS = {
    "test_replicated_parameters_that_differ_are_found_and_named": {
        "parameters": (under_env, (ENV, _parameters_worker))},
    "test_sparse_weight_frozen_on_one_rank_is_named_on_every_rank": {
        "sparse": (under_env, (ENV, _sparse_worker))},
    "test_parameter_check_names_current_path_after_renumbering": {
        "renumbering": (under_env, ({**_EVERY_1, "FUSEDIST_TIMEOUT_S": "5"}, _renumbering_worker))},
    "test_swapped_or_sign_flipped_weight_on_one_rank_is_named_on_every_rank": {
        "swap": (under_env, ({**_EVERY_1, "FUSEDIST_TIMEOUT_S": "10"}, _swap_worker))},
    "test_grad_changed_after_reduce_is_named_on_both_ranks": {
        f"after reduce, {optimizer}": (under_env, (_EVERY_1, _edit_after_reduce, optimizer))
        for optimizer in ("torch", "fused")},
}


@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, SCENARIOS, 2, timeout=180)
