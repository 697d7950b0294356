"""``fully_shard([a, b])``: several modules as one unit, as torch's FSDP2 and torchtitan's
recipe (``fully_shard([model.norm, model.output], reshard_after_forward=False)``; the tied
variant ``fully_shard([model.tok_embeddings, model.output])``), against torch's FSDP2 with the
same wrapping on 2 gloo ranks (Note [a list of modules as one unit] in fusedist/fsdp/members.py);
and ``fusedist.checkpoint`` saves and loads such a model bit for bit.

Tolerance: both libraries gather the same values, run the same ops and average two partial
gradients (exact), and AdamW's update is the same formula; they differ only in the order of
fp32 sums inside the reduce-scatter of a unit's flat buffer against FSDP2's per-parameter
padding, which is the same pairwise sum of two ranks: equal in practice. FP32_TOL = 2e-6 leaves
room for an ulp or two carried through the steps; a member that missed its gradient, a stale
gather or a wrong row is off by more than 1e-3.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fusedist.testing import run_distributed
from shared_rank_launch import launch_for_selected, results_of
from test_fully_shard_api_parity import _count_gathers

VOCAB, DIM, SEQ, N_BLOCKS, BATCH = 40, 16, 6, 2, 3
STEPS = 3
FP32_TOL = 2e-6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Tiny(nn.Module):
    """torchtitan's layout: embeddings, blocks, a final norm, an output head."""

    def __init__(self, tied: bool):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(N_BLOCKS))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _wrap(model, shard, mesh, grouping: str, reshard_group: bool):
    for layer in model.layers:
        shard(layer, mesh=mesh)
    if grouping == "norm+output":
        shard([model.norm, model.output], mesh=mesh, reshard_after_forward=reshard_group)
    elif grouping == "embeddings+output":  # the tied weight in one unit
        shard([model.tok_embeddings, model.output], mesh=mesh, reshard_after_forward=reshard_group)
    shard(model, mesh=mesh)
    return model


def _full(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def _train(model, seed: int, rank: int) -> list:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed * 7 + rank)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        target = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), target.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        with torch.no_grad():  # an evaluation forward between steps
            losses.append(F.cross_entropy(model(tokens).flatten(0, 1), target.flatten()).item())
    return losses


def _side_by_side(rank, world, seed, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fusedist

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for grouping, tied, reshard_group, frozen in (("norm+output", False, False, False),
                                                  ("norm+output", False, True, True),
                                                  ("embeddings+output", True, True, False)):
        torch.manual_seed(seed)
        base = Tiny(tied)
        base.norm.requires_grad_(not frozen)  # a frozen member: its unit waits for its inputs' gradients
        ref = _wrap(copy.deepcopy(base), torch_fully_shard, mesh, grouping, reshard_group)
        ours = _wrap(copy.deepcopy(base), fusedist.fully_shard, mesh, grouping, reshard_group)
        group = ours.norm if grouping == "norm+output" else ours.tok_embeddings
        assert fusedist.fsdp.state.state_of(group) is fusedist.fsdp.state.state_of(ours.output)
        gathers = _count_gathers(group)
        key = f"{grouping}{', norm frozen' if frozen else ''}, reshard_after_forward={reshard_group}"
        losses = _train(ours, seed, rank)
        out[key] = {
            "ours": losses, "gathers": len(gathers), "torch": _train(ref, seed, rank),
            "weights": (_full(ours), _full(ref)),
            "keys": (sorted(ours.state_dict()), sorted(ref.state_dict())),
            "tied": ours.output.weight is ours.tok_embeddings.weight if tied else None,
        }
        # fusedist.checkpoint round trip into a model wrapped alike
        path = f"{root}/{len(out)}"
        fusedist.checkpoint.save(path, ours)
        torch.manual_seed(seed + 1)
        fresh = _wrap(Tiny(tied), fusedist.fully_shard, mesh, grouping, reshard_group)
        fusedist.checkpoint.load(path, fresh)
        out[key]["reloaded"] = _full(fresh)
    return out


def test_a_list_of_modules_is_one_unit_and_trains_as_torch_fsdp2(tmp_path):
    seed = random.randrange(2**31)
    for rank, out in enumerate(run_distributed(_side_by_side, 2, seed, str(tmp_path), timeout=240)):
        for case, res in out.items():
            what = f"{case}, rank {rank}, seed {seed}"
            for i, (a, b) in enumerate(zip(res["ours"], res["torch"])):
                assert abs(a - b) <= FP32_TOL * max(1.0, abs(b)), f"{what}: loss {i}: {a} vs torch {b}"
            ours, ref = res["weights"]
            assert ours.keys() == ref.keys(), what
            for k in ref:
                diff = (ours[k] - ref[k]).abs().max().item()
                assert diff <= FP32_TOL, f"{what}: {k} differs from torch's by {diff}"
            assert res["keys"][0] == res["keys"][1], f"{what}: state-dict keys {res['keys']}"
            assert all(torch.equal(res["reloaded"][k], ours[k]) for k in ours), f"{what}: checkpoint round trip"
            if res["tied"] is not None:
                assert res["tied"], f"{what}: the tied weight came apart"
            # Gathers for the whole group, not one per member (as FSDP2). Resharding after forward:
            # each training forward, its backward and each evaluation forward gather once.
            # Keeping it: the first training forward gathers, backward reshards (as always), and
            # each evaluation forward gathers and keeps it for the next training forward
            # (Note [forward without gradients] in fusedist/fsdp/state.py).
            expected = 3 * STEPS if case.endswith("True") else 1 + STEPS
            assert res["gathers"] == expected, f"{what}: {res['gathers']} gathers, expected {expected}"


def _refusals(rank, world):
    import fusedist

    pg = dist.group.WORLD
    messages = []
    for bad, error in (([], ValueError), ([nn.Linear(2, 2), "x"], TypeError)):
        try:
            fusedist.fully_shard(bad, process_group=pg)
        except error as exc:
            messages.append(str(exc))
    done = nn.Linear(2, 2)
    fusedist.fully_shard(done, process_group=pg)
    try:
        fusedist.fully_shard([nn.Linear(2, 2), done], process_group=pg)
    except ValueError as exc:
        messages.append(str(exc))
    # A member inside another member is part of the outer one (as FSDP2's root modules).
    outer = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    fusedist.fully_shard([outer[1], outer], process_group=pg)
    same = fusedist.fsdp.state.state_of(outer)
    messages.append((same.modules == [outer], same.unit is not None and len(same.unit.sharded) == 4))
    return messages


def test_a_bad_list_is_refused_by_name():
    for empty, not_module, sharded, nested in run_distributed(_refusals, 2, timeout=120):
        assert "list of modules is empty" in empty
        assert "item 1 of the list is a str" in not_module
        assert "Linear is already sharded" in sharded
        assert nested == (True, True)


def _aborted_group_call(rank, world, seed):
    """An exception between the members of a group call (output raises after norm ran): the next
    forward starts the group afresh (gathers, runs, reshards) and matches the unsharded model."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    import fusedist

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    base = Tiny(tied=False)
    plain = copy.deepcopy(base)
    ours = _wrap(copy.deepcopy(base), fusedist.fully_shard, mesh, "norm+output", True)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed + rank))
    forward = type(ours.output).forward

    def fails_once(self, x):
        type(ours.output).forward = forward
        raise RuntimeError("injected")

    type(ours.output).forward = fails_once
    try:
        ours(tokens)
    except RuntimeError as exc:
        assert "injected" in str(exc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the aborted forward's notice
        out = ours(tokens)
    out.sum().backward()
    unit = fusedist.fsdp.state.state_of(ours.norm).unit
    return (out - plain(tokens)).abs().max().item(), unit.is_unsharded


class _Parent(nn.Module):
    """A plain parent calling a group's members one after the other: the group is the root."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
        self.head = nn.Linear(DIM, 4)

    def forward(self, x):
        return self.head(self.body(x))


def _group_as_root(rank, world, seed):
    """``fully_shard([body, head])`` under a plain parent, two iterations: the head's call
    continues the group call the body began -- no aborted-forward warning, one gather per
    iteration -- and the accumulated gradients are the unsharded model's on the global batch."""
    import warnings

    import fusedist

    torch.manual_seed(seed)
    net = _Parent()
    plain = copy.deepcopy(net)
    fusedist.fully_shard([net.body, net.head])
    gathers = _count_gathers(net.body)
    x = torch.randn(world, 5, DIM, generator=torch.Generator().manual_seed(seed + 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            net(x[rank]).square().mean().backward()
    plain(x.reshape(-1, DIM)).square().mean().backward()  # (the mean over both ranks' rows)
    diffs = {n: (p.grad.full_tensor() - 2 * q.grad).abs().max().item()
             for (n, p), (_, q) in zip(net.named_parameters(), plain.named_parameters())}
    return [str(w.message) for w in caught], len(gathers), diffs


JOBS = {
    "test_a_group_call_ended_by_an_exception_starts_afresh": {"aborted": (_aborted_group_call, ())},
    "test_a_group_as_the_root_runs_its_members_as_one_call": {"group root": (_group_as_root, ())},
}
_SEED = random.randrange(2**31)


@pytest.fixture(scope="module")
def launched(request):
    """The 2-rank group-call scenarios of the selected tests, in one launch (one seed)."""
    jobs = {test: {name: (fn, (_SEED,)) for name, (fn, _) in scenarios.items()} for test, scenarios in JOBS.items()}
    return launch_for_selected(request, jobs, 2, timeout=180)


def test_a_group_call_ended_by_an_exception_starts_afresh(launched):
    for diff, gathered in results_of(launched, "aborted"):
        assert diff <= FP32_TOL, f"seed {_SEED}: {diff}"
        assert not gathered, f"seed {_SEED}: the group's unit stayed gathered after backward"


def test_a_group_as_the_root_runs_its_members_as_one_call(launched):
    for rank, (warned, gathers, diffs) in enumerate(results_of(launched, "group root")):
        assert warned == [], (rank, warned)  # each later member took itself for an aborted forward's successor
        assert gathers == 2, (rank, gathers)  # one per iteration: the root keeps its unit gathered until backward
        for name, diff in diffs.items():
            assert diff <= FP32_TOL, f"seed {_SEED}, rank {rank}, {name}: {diff}"
