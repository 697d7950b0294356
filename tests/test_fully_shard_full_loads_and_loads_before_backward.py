"""torch's state-dict helpers (``torch.distributed.checkpoint.state_dict``) on fusedist's
``fully_shard`` models, against torch's FSDP2 on the same model and wrapping, world size 2 on
gloo: loads of a full state dict that must reach every rank (Note [full state dict loaded on
some ranks only] in fusedist/fsdp/torch_helpers.py), and loads after a forward with gradients,
which leaves the root's unit gathered (``_reshard_at_rest`` in fusedist/fsdp/state_dict_hooks.py).
"""

from __future__ import annotations

import pytest
import torch

import fusedist
from phased_launches import launch_phase
from shared_rank_launch import results_of
from models import BlockStack

# a short collective timeout: a rank that never joins a check is reported after it
ENV = {"FUSEDIST_TIMEOUT_S": "6"}


def _make(kind: str, seed: int, ws: int, **kwargs):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(seed)
    model = BlockStack(d_in=4, d=6, d_out=3)
    if kind == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = fusedist.fully_shard
    mesh = init_device_mesh("cpu", (ws,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _whole(model) -> dict:
    sd = model.state_dict()
    if any(type(v).__name__ == "DTensor" for v in sd.values()):
        return {k: v.full_tensor().detach().clone() for k, v in sd.items()}
    return {k: v.clone() for k, v in fusedist.fsdp.full_state_dict(model).items()}


def _steps(model, opt, rank: int, seeds) -> list:
    """The global losses of one Adam step per seed (each rank its half of the batch)."""
    import torch.distributed as dist

    out = []
    for seed in seeds:
        torch.manual_seed(seed)
        x = torch.randn(4, 4)[2 * rank:2 * rank + 2]
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        out.append(t.item())
    return out


def _source() -> dict:
    torch.manual_seed(11)
    return {k: v.detach().clone() for k, v in BlockStack(d_in=4, d=6, d_out=3).state_dict().items()}


# ------------------------------------------------------------------ full dicts on every rank load as FSDP2's
def _full_on_every_rank(rank, ws):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict,
                                                         set_state_dict)

    full = _source()
    for cpu, bc, together in ((True, False, True), (False, True, False)):
        got = {}
        for kind in ("torch", "ours"):
            model = _make(kind, 0, ws)
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            _steps(model, opt, rank, (1,))
            osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
            osd = {"state": {k: dict(v) for k, v in osd["state"].items()}, "param_groups": osd["param_groups"]}
            give = rank == 0 or not bc
            opts = StateDictOptions(full_state_dict=True, cpu_offload=cpu, broadcast_from_rank0=bc)
            if together:
                set_state_dict(model, opt, model_state_dict=dict(full), optim_state_dict=osd, options=opts)
            else:
                set_model_state_dict(model, dict(full) if give else {}, options=opts)
                set_optimizer_state_dict(model, opt, osd if give else {}, options=opts)
            got[kind] = (_whole(model), _steps(model, opt, rank, (2, 3)))
        for k, v in full.items():
            assert torch.equal(got["ours"][0][k], v), (cpu, bc, k)
            assert torch.equal(got["torch"][0][k], v), (cpu, bc, k)
        assert got["ours"][1] == pytest.approx(got["torch"][1], rel=1e-5, abs=1e-7), (cpu, bc)


def test_full_state_dict_loads_on_every_rank_as_fsdp2(launched):
    results_of(launched, "full on every rank")


# ------------------------------------------------------------------ an empty dict on rank 1 is refused
def _empty_on_rank1(rank, ws):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    full = _source()
    model = _make("ours", 0, ws)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _steps(model, opt, rank, (1,))
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # the optimizer: every rank reaches the load, every rank raises the same error
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    with pytest.raises(RuntimeError, match=r"ranks \[1\]: an empty state dict"):
        set_optimizer_state_dict(model, opt, osd if rank == 0 else {}, options=opts)
    # keys missing on one rank only: named, on every rank
    partial = dict(full) if rank == 0 else {k: v for k, v in full.items() if k != "head.bias"}
    with pytest.raises(RuntimeError, match=r"ranks \[1\] hold missing 'head.bias'"):
        set_model_state_dict(model, partial, options=opts)
    # the model: torch skips the load on rank 1 (an empty dict); rank 0 must not load its rows alone
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if rank == 0:
        with pytest.raises(RuntimeError, match="not every rank joined the load"):
            set_model_state_dict(model, dict(full), options=opts)
    else:
        set_model_state_dict(model, {}, options=opts)
        with pytest.raises(RuntimeError):  # its next collective stalls: the report names rank 0's load check
            fusedist.fsdp.full_state_dict(model)
    after = model.state_dict()
    for k, v in before.items():
        assert torch.equal(after[k], v), (rank, k)  # nothing loaded on either rank


def test_full_state_dict_with_an_empty_dict_on_some_ranks_is_refused(launched):
    results_of(launched, "empty on rank 1")


# ------------------------------------------------------------------ loads after a forward with gradients
def _load_after_forward(rank, ws):
    """A forward with gradients leaves the root's unit gathered until its backward: a load then
    (the model's own sharded state dict, or a full one) must reach the pieces and the gathered
    copy alike, whether the backward comes or not, as with FSDP2."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    for backward in (False, True):
        for full in (False, True):
            got = {}
            for kind in ("torch", "ours"):
                model, src = _make(kind, 0, ws), _make(kind, 1, ws)
                # (FSDP2's own load of a full dict fails here: its reference is the sharded one)
                sd = get_model_state_dict(src, options=StateDictOptions(full_state_dict=full and kind == "ours"))
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                torch.manual_seed(4)
                loss = model(torch.randn(4, 4)[2 * rank:2 * rank + 2]).pow(2).mean()
                model.load_state_dict(sd)
                if backward:  # FSDP2's backward gathers the loaded parameters again
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                del loss
                got[kind] = (_whole(model), _steps(model, opt, rank, (2, 3)))
            for k, v in got["torch"][0].items():
                torch.testing.assert_close(got["ours"][0][k], v, msg=lambda m: f"{backward} {full} {k}: {m}")
            assert got["ours"][1] == pytest.approx(got["torch"][1], rel=1e-5, abs=1e-7), (backward, full)


def test_load_after_a_forward_with_gradients_as_fsdp2(launched):
    results_of(launched, "load after forward")


def _dcp_load_after_forward(rank, ws, path):
    """``dcp.load`` into ``model.state_dict()`` after a forward with gradients whose backward never
    came (an evaluation with gradients on): the next steps run the loaded parameters, as FSDP2's."""
    import torch.distributed.checkpoint as dcp

    got = {}
    for kind in ("torch", "ours"):
        dcp.save({"model": _make(kind, 1, ws).state_dict()}, checkpoint_id=f"{path}/{kind}")
        model = _make(kind, 0, ws)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(4)
        model(torch.randn(4, 4)[2 * rank:2 * rank + 2]).pow(2).mean()  # (its graph dropped)
        sd = {"model": model.state_dict()}
        dcp.load(sd, checkpoint_id=f"{path}/{kind}")
        got[kind] = (_whole(model), _steps(model, opt, rank, (2, 3)))
    for k, v in got["torch"][0].items():
        torch.testing.assert_close(got["ours"][0][k], v, msg=lambda m: f"{k}: {m}")
    assert got["ours"][1] == pytest.approx(got["torch"][1], rel=1e-5, abs=1e-7)


def test_dcp_load_after_a_forward_with_gradients_as_fsdp2(launched):
    results_of(launched, "dcp load after forward")


def _load_after_forward_not_gathered_in_backward(rank, ws):
    """Units that stay gathered after forward and are not gathered in backward
    (``set_unshard_in_backward(False)``): a load after a forward with gradients, as FSDP2's."""
    got = {}
    for kind in ("torch", "ours"):
        model, src = _make(kind, 0, ws, reshard_after_forward=False), _make(kind, 1, ws)
        model.set_unshard_in_backward(False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(4)
        model(torch.randn(4, 4)[2 * rank:2 * rank + 2]).pow(2).mean()  # (its graph dropped)
        model.load_state_dict(src.state_dict())
        got[kind] = _steps(model, opt, rank, (2, 3))
    assert got["ours"] == pytest.approx(got["torch"], rel=1e-5, abs=1e-7)


def test_load_after_a_forward_into_units_not_gathered_in_backward_as_fsdp2(launched):
    results_of(launched, "not gathered in backward")


# ------------------------------------------------------------------ one launch of the ranks
@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """The selected tests' scenarios in one launch; the empty dict on rank 1 last (a rank's
    collective stalls there until the short timeout)."""
    return launch_phase(request, {
        "test_full_state_dict_loads_on_every_rank_as_fsdp2": {"full on every rank": (_full_on_every_rank, ())},
        "test_load_after_a_forward_with_gradients_as_fsdp2": {"load after forward": (_load_after_forward, ())},
        "test_dcp_load_after_a_forward_with_gradients_as_fsdp2": {
            "dcp load after forward": (_dcp_load_after_forward, (str(tmp_path_factory.mktemp("dcp-load")),))},
        "test_load_after_a_forward_into_units_not_gathered_in_backward_as_fsdp2": {
            "not gathered in backward": (_load_after_forward_not_gathered_in_backward, ())},
        "test_full_state_dict_with_an_empty_dict_on_some_ranks_is_refused": {"empty on rank 1": (_empty_on_rank1, ())},
    }, 2, timeout=300, env=ENV)
