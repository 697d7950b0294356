"""fully_shard's per-step cross-rank check and optimizer-step guard (Note [stage-3 step check]
in fusedist/reliability/sharded_watch.py): ranks that fall out of step are told so on every
rank, one step later at the latest; misuse of ``optimizer.step()`` is refused on the rank
that makes it, before any parameter changes; the checks name parameters by their current paths
after the model's blocks were renumbered. The 2-rank scenarios share one launch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fusedist
from fusedist.testing import run_distributed
from shared_rank_launch import launch_for_selected, results_of


def _model(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    for layer in (model[0], model[2], model[4]):
        fusedist.fully_shard(layer)
    fusedist.fully_shard(model)
    return model


def _step(model, opt, rank, step, do_step=True):
    g = torch.Generator().manual_seed(100 * step + rank)
    loss = model(torch.randn(5, 8, generator=g)).square().mean()
    loss.backward()
    if do_step:
        opt.step()
    opt.zero_grad()


def _outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except fusedist.RankMismatchError as exc:
        return f"mismatch: {exc}"
    except RuntimeError as exc:
        return f"error: {exc}"


def _worker(rank, ws):
    out = {}
    # 1. A rank skips one optimizer step (what torch.amp.GradScaler does on the rank whose piece
    #    of the gradients overflowed): the check at the end of the next backward sees it, and
    #    every rank reports it at the training forward after that.
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        _step(model, opt, rank, step)
    _step(model, opt, rank, 2, do_step=rank != 1)
    out["next_step"] = _outcome(lambda: _step(model, opt, rank, 3))
    out["skipped_step"] = _outcome(lambda: _step(model, opt, rank, 4))

    # 2. The same divergence in the last step of a run: check_consistency() finds it, and
    #    fusedist.checkpoint.save refuses to write the checkpoint.
    model = _model(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, rank, 0)
    out["consistent"] = _outcome(model.check_consistency)
    _step(model, opt, rank, 1, do_step=rank != 0)
    out["last_step"] = _outcome(model.check_consistency)

    # 3. optimizer.step() misuse, refused on the rank that makes it, before any change.
    model = _model(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(5, 8)).sum()  # a forward, no backward yet
    before = [p.detach().clone() for p in model.parameters()]
    out["before_backward"] = _outcome(opt.step)
    model.set_requires_gradient_sync(False)
    model(torch.randn(5, 8)).sum().backward()
    out["unsynced"] = _outcome(opt.step)
    out["unchanged"] = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    model.set_requires_gradient_sync(True)
    model(torch.randn(5, 8)).sum().backward()
    out["synced"] = _outcome(opt.step)
    out["steps_counted"] = fusedist.fsdp.state.state_of(model).ctx.watch.optimizer_steps
    return out


def test_out_of_step_ranks_and_step_misuse_are_reported(launched):
    for rank, out in enumerate(results_of(launched, "out of step")):
        assert out["next_step"] == "ok", out["next_step"]
        skipped = out["skipped_step"]
        assert skipped.startswith("mismatch:"), (rank, skipped)
        assert "fully_shard" in skipped and "optimizer_steps: ranks [0]: 3; ranks [1]: 2" in skipped, skipped
        assert out["consistent"] == "ok", out["consistent"]
        last = out["last_step"]
        assert last.startswith("mismatch:") and "check_consistency()" in last, last
        assert "optimizer_steps: ranks [0]: 1; ranks [1]: 2" in last, last
        assert out["before_backward"].startswith("error:") and "before any backward" in out["before_backward"]
        assert out["unsynced"].startswith("error:") and "set_requires_gradient_sync(False)" in out["unsynced"]
        assert out["unchanged"]
        assert out["synced"] == "ok" and out["steps_counted"] == 1


def _guard_worker(rank, ws):
    """The optimizer step guard's two refusals and its step count, at this world size."""
    from models import error_text

    model = _model(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7 + rank)
    model(torch.randn(5, 8, generator=g)).sum()  # a forward, no backward yet
    before = [p.detach().clone() for p in model.parameters()]
    out = {"before_backward": error_text(opt.step, RuntimeError)}
    model.set_requires_gradient_sync(False)
    model(torch.randn(5, 8, generator=g)).sum().backward()
    out["unsynced"] = error_text(opt.step, RuntimeError)
    out["unchanged"] = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    model.set_requires_gradient_sync(True)
    model(torch.randn(5, 8, generator=g)).sum().backward()
    out["synced"] = error_text(opt.step, RuntimeError)
    watch = fusedist.fsdp.state.state_of(model).ctx.watch
    out["counts"] = (watch.optimizer_steps, watch.backwards, watch.sync_steps, watch.forwards)
    # the cross-rank check exists only where there are other ranks (no collective of its own at 1)
    out["cross_rank_check"] = watch.step_check is not None
    model.check_consistency()
    return out


def test_step_guard_applies_at_world_size_one_as_at_two(launched):
    """As DDP's StepWatch: the guard refuses the same misuse with the same message at world
    size 1; only the cross-rank check is off there."""
    one = run_distributed(_guard_worker, 1, timeout=120)[0]
    two = results_of(launched, "guard")
    for out in [one, *two]:
        assert out["before_backward"] is not None and "before any backward" in out["before_backward"], out
        assert out["unsynced"] is not None and "set_requires_gradient_sync(False)" in out["unsynced"], out
        assert out["unchanged"] and out["synced"] is None, out
        assert out["counts"] == (1, 2, 1, 3), out["counts"]
    assert one["before_backward"] == two[0]["before_backward"]
    assert one["unsynced"] == two[0]["unsynced"]
    assert not one["cross_rank_check"] and two[0]["cross_rank_check"]


class _Block(nn.Module):
    """A trunk and an optional side branch: one unit."""

    def __init__(self, d_in: int):
        super().__init__()
        self.trunk, self.side = nn.Linear(d_in, 16), nn.Linear(16, 16)

    def forward(self, x, use_side=True):
        h = torch.tanh(self.trunk(x))
        return h + self.side(h) if use_side else h


class _Branchy(nn.Module):
    """Three units: a block, a block whose side branch may be skipped, a head."""

    def __init__(self):
        super().__init__()
        self.first, self.middle, self.head = _Block(8), _Block(16), nn.Linear(16, 4)

    def forward(self, x, use_side=True):
        return self.head(self.middle(self.first(x), use_side))


def _branchy_worker(rank, ws):
    """Note [rank-independent reductions]: gradients that reach different parameters on
    different ranks are reported on every rank, naming them. Here the middle unit's side
    branch runs on rank 0 only: rank 0's middle unit has all its gradients when its backward
    is done, rank 1's only at the end of backward (one parameter never gets one), after the
    first unit's; the reduce-scatters are still issued in one order on both ranks (else rank
    1's first-unit reduce-scatter would meet rank 0's middle-unit one: a crash, or a silent
    mix of two units' gradients where their sizes agree)."""
    import copy

    out = {}
    torch.manual_seed(0)
    base = _Branchy()
    for case, kwargs in (("side branch on rank 0 only", {"use_side": rank == 0}),
                         ("same on every rank", {"use_side": False})):
        model = copy.deepcopy(base)
        for unit in (model.first, model.middle, model.head, model):
            fusedist.fully_shard(unit)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(rank))
        model(x, **kwargs).square().mean().backward()
        opt.step()
        opt.zero_grad()
        out[case] = _outcome(lambda: model(x).square().mean().backward())
    return out


def test_rank_dependent_gradients_are_reported(launched):
    for rank, out in enumerate(results_of(launched, "branchy")):
        side = out["side branch on rank 0 only"]
        assert side.startswith("mismatch") and "unused" in side, side
        assert "branch of a unit ran on some ranks only" in side, side
        if rank == 1:  # the rank the branch's gradients did not reach names them, from the root
            assert "parameters without a gradient on rank 1: ['middle.side.weight', 'middle.side.bias']" in side, side
        assert out["same on every rank"] == "ok", out["same on every rank"]


# ------------------------------------------------ names after a renumbering of the blocks
# After a ModuleList insert or del renumbers the blocks, the replica check names a parameter
# whose replicas differ by its current path (torch's ``named_parameters()``), not by the one it
# had when the check's digest was built, and the units take their current paths (Note [unit
# paths follow the module] in fusedist/fsdp/tree_names.py). torch's FSDP2 keeps the names of its
# first forward (``_init_fqns``) and has no replica check to compare with.
class _Stack(nn.Module):
    def __init__(self, head=()):
        super().__init__()
        self.layers = nn.ModuleList([*head, nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 2)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _diverge_after(change, rank, head=(), step_after=True):
    """On a (2 replicas, 1 shard) mesh: train, check (the digest is built under the first
    forward's paths), ``change`` the model's blocks, train (or not), make rank 1's replica of the
    middle Linear's weight differ, check again: (its current path, its unit's path, the message)."""
    from torch.distributed.device_mesh import init_device_mesh

    from fusedist.fsdp.owners import owner_of

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    net = _Stack(head)
    for layer in net.layers:
        if isinstance(layer, nn.Linear):
            fusedist.fully_shard(layer, mesh=mesh)
    fusedist.fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(10 + rank)

    def step():
        net(torch.randn(4, 6, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    net.check_consistency()
    target = net.layers[len(head) + 1].weight
    change(net.layers)
    if step_after:
        step()
    current = next(n for n, p in net.named_parameters() if p is target)
    if rank == 1:
        with torch.no_grad():
            target.add_(torch.randn(target.shape, generator=gen))
    message = None
    try:
        net.check_consistency()
    except fusedist.RankMismatchError as e:
        message = str(e)
    return current, owner_of(target)[0].path, message


def _renumbered(rank, ws):
    return {
        # every Linear moves up one index: the middle one was 'layers.1', is 'layers.2' now
        "insert": _diverge_after(lambda layers: layers.insert(0, nn.Identity()), rank),
        # every Linear moves down one index: the middle one was 'layers.2', is 'layers.1' now;
        # no forward since: check_consistency() itself sees the change
        "del": _diverge_after(lambda layers: layers.__delitem__(0), rank, head=[nn.ReLU()], step_after=False),
    }


def test_replica_check_names_current_path_after_renumbering(launched):
    for rank, out in enumerate(results_of(launched, "renumbered")):
        for case, expected, stale in (("insert", "layers.2.weight", "layers.1.weight"),
                                      ("del", "layers.1.weight", "layers.2.weight")):
            current, unit_path, message = out[case]
            assert current == expected, (case, out)
            assert unit_path == expected.rsplit(".", 1)[0], (rank, case, unit_path)  # (its collective tags' name)
            assert message is not None, f"rank {rank}, {case}: a weight changed on rank 1 went unnoticed"
            assert f"parameter '{current}' (shape (6, 6)) differs across ranks" in message, (rank, case, message)
            assert f"'{stale}'" not in message, (rank, case, message)  # the first forward's path: another Linear now


# A renumbering inside one unit: the unit's messages name a parameter by its current name too,
# as torch's ``named_parameters()`` does, not by the one ``fully_shard`` took at wrapping (which
# now names its neighbour).
class _Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6))

    def forward(self, x):
        return self.body(x)


def _renumbered_inside_a_unit(rank, ws):
    torch.manual_seed(0)
    net = fusedist.fully_shard(_Body())
    net(torch.randn(3, 6)).sum().backward()
    target = net.body[1].weight  # 'body.1.weight' until the insert, then the first Linear's name
    net.body.insert(0, nn.Identity())
    current = next(n for n, p in net.named_parameters() if p is target)
    target.data = torch.zeros(5, 7)  # no rank's piece has 35 elements: refused on every rank
    try:
        net(torch.randn(3, 6))
    except ValueError as e:
        return current, str(e)
    return current, None


def test_unit_messages_name_current_parameter_after_renumbering_inside_the_unit(launched):
    for rank, (current, message) in enumerate(results_of(launched, "renumbered inside")):
        assert current == "body.2.weight", (rank, current)
        assert message is not None, f"rank {rank}: a piece replaced by the whole weight was not refused"
        assert f"parameter '{current}' of the root module (_Body)" in message, (rank, message)
        assert "'body.1.weight'" not in message, (rank, message)  # the name at wrapping: the other Linear's now


JOBS = {
    "test_out_of_step_ranks_and_step_misuse_are_reported": {"out of step": (_worker, ())},
    "test_step_guard_applies_at_world_size_one_as_at_two": {"guard": (_guard_worker, ())},
    "test_rank_dependent_gradients_are_reported": {"branchy": (_branchy_worker, ())},
    "test_replica_check_names_current_path_after_renumbering": {"renumbered": (_renumbered, ())},
    "test_unit_messages_name_current_parameter_after_renumbering_inside_the_unit": {
        "renumbered inside": (_renumbered_inside_a_unit, ())},
}


@pytest.fixture(scope="module")
def launched(request):
    """The 2-rank scenarios of the selected tests, in one launch."""
    return launch_for_selected(request, JOBS, 2, timeout=240)
