"""Several optimizers over disjoint parts of one model in one checkpoint (Note [several
optimizers over one model] in fusedist/checkpoint/_optimizer_list.py), against torch's
``get_state_dict(model, optimizers=[...])`` / ``set_state_dict``.

* 2 ranks, one launch: a fusedist DDP model with [torch AdamW, torch SGD], with [FusedAdamW, SGD]
  and with two ZeroRedundancyOptimizers (stage 1) continues after save + load exactly as the
  uninterrupted run; a torch DCP checkpoint of the list loads into it, and a fusedist
  checkpoint of it into torch's set_state_dict; the ZeRO checkpoint loads at world size 1.
* A Checkpointer registering the list, with an LR scheduler per optimizer, resumes bit for bit.
* Refused before anything changes: overlapping optimizers, a list of another length, or whose
  optimizer at a position runs another algorithm than the saved one (order, kind), one optimizer
  for a checkpoint of several, a model with state beyond its tensors.
* A save of a list on rank 0 only (start exchange, or a DDP model's step check) says that every rank must
  call it, as a save of one optimizer does.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from torch import nn

import fusedist.checkpoint as ckpt
from shared_rank_launch import launch_for_selected, results_of, under_env
from test_checkpoint_small_save_entry import SAVE_ALONE_ENV, check_rank_0_saves_alone, rank_0_saves_alone

ROWS = 4  # global batch rows


def _model(seed: int = 0) -> nn.Module:
    """A frozen middle layer: parameters of the model in no optimizer are saved with the model."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    model[1].requires_grad_(False)
    return model


def _optimizers(model: nn.Module, kind: str = "torch") -> list:
    """A backbone and a head with their own algorithms: disjoint parameters."""
    import fusedist
    from fusedist.optim import FusedAdamW

    inner = model.module if hasattr(model, "module") else model
    backbone, head = list(inner[0].parameters()), list(inner[3].parameters())
    if kind == "zero":
        return [fusedist.ZeroRedundancyOptimizer(backbone, torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
                fusedist.ZeroRedundancyOptimizer(head, torch.optim.SGD, lr=5e-2, momentum=0.9)]
    first = FusedAdamW if kind == "fused" else torch.optim.AdamW
    return [first(backbone, lr=1e-2, weight_decay=0.1), torch.optim.SGD(head, lr=5e-2, momentum=0.9)]


def _batch(step: int, rank: int = 0, world: int = 1):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 3, generator=g)
    rows = ROWS // world
    return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]


def _train(model, optimizers, steps, rank: int = 0, world: int = 1, schedulers=()) -> list:
    losses = []
    for step in steps:
        x, y = _batch(step, rank, world)
        for opt in optimizers:
            opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        for opt in optimizers:
            opt.step()
        for scheduler in schedulers:
            scheduler.step()
        losses.append(loss.item())
    return losses


def _schedulers(optimizers) -> list:
    """One LR schedule per optimizer (another decay each), saved with its optimizer."""
    return [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=g) for o, g in zip(optimizers, (0.5, 0.8))]


def _state(model) -> dict:
    inner = model.module if hasattr(model, "module") else model
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


def _ddp(seed: int):
    import fusedist

    return fusedist.DistributedDataParallel(_model(seed), bucket_cap_mb=0.0001)


def _resume(rank: int, world: int, kind: str, directory: str) -> dict:
    """Uninterrupted 4 steps vs 2 steps, save of the list, load into fresh objects, 2 steps."""
    import torch.distributed as dist

    ref = _ddp(0)
    ref_opts = _optimizers(ref, kind)
    ref_losses = _train(ref, ref_opts, range(4), rank, world)

    model = _ddp(0)
    opts = _optimizers(model, kind)
    _train(model, opts, range(2), rank, world)
    ckpt.save(directory, model, opts)
    fresh = _ddp(9)
    fresh_opts = _optimizers(fresh, kind)
    ckpt.load(directory, fresh, fresh_opts)
    losses = _train(fresh, fresh_opts, range(2, 4), rank, world)
    out = {"ref_losses": ref_losses[2:], "losses": losses, "ref": _state(ref), "resumed": _state(fresh)}
    if kind == "torch":  # torch's DCP of the same list, both ways
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model = _ddp(0)
        opts = _optimizers(model, kind)
        _train(model, opts, range(2), rank, world)
        msd, osd = get_state_dict(model.module, opts)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory + "-dcp")
        fresh = _ddp(9)
        fresh_opts = _optimizers(fresh, kind)
        ckpt.load(directory + "-dcp", fresh, fresh_opts)
        out["from_dcp"] = _train(fresh, fresh_opts, range(2, 4), rank, world)

        torch_model = nn.parallel.DistributedDataParallel(_model(9))
        torch_opts = _optimizers(torch_model, kind)
        loaded = _model(9)
        loaded_opts = _optimizers(loaded, kind)
        ckpt.load(directory, loaded, loaded_opts)
        msd, osd = get_state_dict(loaded, loaded_opts)
        set_state_dict(torch_model.module, torch_opts, model_state_dict=msd, optim_state_dict=osd)
        out["into_torch"] = _train(torch_model, torch_opts, range(2, 4), rank, world)
    dist.barrier()
    return out


def _checkpointer(rank: int, world: int, kind: str, directory: str) -> dict:
    """A Checkpointer registering the list (and an LR scheduler per optimizer): restored in a new
    Checkpointer, training continues as the uninterrupted run."""
    ref = _ddp(0)
    ref_opts = _optimizers(ref, kind)
    ref_losses = _train(ref, ref_opts, range(4), rank, world, _schedulers(ref_opts))
    model = _ddp(0)
    opts = _optimizers(model, kind)
    scheds = _schedulers(opts)
    with ckpt.Checkpointer(directory, async_save=False) as cp:
        assert cp.restore(model, opts, lr_scheduler=scheds) == 0
        _train(model, opts, range(2), rank, world, scheds)
        cp.save(2)
    fresh = _ddp(9)
    fresh_opts = _optimizers(fresh, kind)
    fresh_scheds = _schedulers(fresh_opts)
    with ckpt.Checkpointer(directory, async_save=False) as cp:
        step = cp.restore(fresh, fresh_opts, lr_scheduler=fresh_scheds)
        losses = _train(fresh, fresh_opts, range(step, 4), rank, world, fresh_scheds)
    return {"ref_losses": ref_losses[2:], "losses": losses, "ref": _state(ref), "resumed": _state(fresh),
            "step": step}


def _diverged(rank: int, world: int, kind: str, directory: str) -> dict:
    """A weight changed on rank 1 after the last step: the Checkpointer's save of the list and a
    plain save of it each raise on every rank, writing nothing (the earlier checkpoint stays)."""
    model = _ddp(0)
    opts = _optimizers(model, kind)
    cp = ckpt.Checkpointer(directory, async_save=False)
    cp.restore(model, opts)
    _train(model, opts, range(2), rank, world)
    cp.save(2)
    _train(model, opts, range(2, 3), rank, world)
    if rank == 1:
        with torch.no_grad():
            model.module[3].weight[0, 0] += 1e-3
    out = {}
    for name, save in (("checkpointer", lambda: cp.save(3)), ("save", lambda: ckpt.save(directory + "-plain", model,
                                                                                         opts))):
        try:
            save()
            out[name] = None
        except Exception as exc:  # noqa: BLE001 - compared across ranks by the test
            out[name] = (type(exc).__name__, str(exc))
    out["written"] = sorted(os.listdir(directory)), os.path.exists(directory + "-plain")
    cp.close()
    return out


def _saved_alone_with_a_list(rank: int, world: int, directory: str) -> dict:
    """``rank_0_saves_alone``, then rank 0 alone saves the model with a list of two optimizers (a save of
    the whole job, last: it gives the default group up) while rank 1 goes on to an all-reduce."""
    import datetime
    import traceback

    from fusedist.comm import get_communicator

    errors = rank_0_saves_alone(rank, world, directory)
    model = _model()
    optimizers = _optimizers(model)
    get_communicator(None).timeout = datetime.timedelta(seconds=2)  # (the launch's default group waits minutes)
    try:
        if rank == 1:
            get_communicator(None).all_reduce(torch.ones(3))
        else:
            ckpt.save(os.path.join(directory, "list"), model, optimizers)
        errors["save of a list"] = None
    except Exception:  # noqa: BLE001 - the test reads it
        errors["save of a list"] = traceback.format_exc()
    return errors


SCENARIOS = {
    "test_a_save_of_a_list_refuses_diverged_ranks": {"diverged": (_diverged, ("torch", None))},
    "test_a_checkpointer_of_a_list_resumes_like_an_uninterrupted_run": {
        f"checkpointer {kind}": (_checkpointer, (kind, None)) for kind in ("torch", "zero")},
    "test_a_list_resumes_like_an_uninterrupted_run": {
        kind: (_resume, (kind, None)) for kind in ("torch", "fused", "zero")},
    "test_a_save_on_rank_0_only_says_that_every_rank_must_call_it": {  # (last: it gives its group up)
        "saved alone": (under_env, (SAVE_ALONE_ENV, _saved_alone_with_a_list, None))},
}


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lists"))
    by_test = {test: {name: (fn, (*args[:-1], os.path.join(root, name))) for name, (fn, args) in scenarios.items()}
               for test, scenarios in SCENARIOS.items()}
    launched = launch_for_selected(request, by_test, 2, timeout=240)
    launched["root"] = root
    return launched


def test_a_save_on_rank_0_only_says_that_every_rank_must_call_it(launched):
    """torch.save's habit, ``if rank == 0: save(...)`` (plain, Checkpointer, and a list of optimizers): rank
    0's error names rank 1 and says what to do."""
    errors = results_of(launched, "saved alone")
    check_rank_0_saves_alone(errors)
    text0, text1 = errors[0]["save of a list"], errors[1]["save of a list"]
    assert text0 is not None and text1 is not None, errors
    opening = "fusedist.checkpoint.save: rank 0's save could not start: rank(s) [1] did not join it."
    said = [line for line in text0.splitlines() if opening in line]
    assert said and re.match(r"fusedist\.(comm\.base\.CollectiveError|reliability\.monitor\.StallError): ",
                             said[-1]), text0
    assert "every rank of the group must call it" in said[-1] and "if rank == 0:" in said[-1], text0
    assert said[-1].count("could not start") == 1, text0  # said once, not by each layer of the save
    raised_last = text1.rsplit("the following exception:", 1)[-1]  # rank 1 ends with a failed collective
    assert re.search(r"^fusedist\.[\w.]+\.(CollectiveError|StallError): ", raised_last, re.MULTILINE), text1


@pytest.mark.parametrize("kind", ["torch", "zero"])
def test_a_checkpointer_of_a_list_resumes_like_an_uninterrupted_run(launched, kind):
    """Same ranks, same ops: bit for bit, the LR schedules included (their decays differ)."""
    for out in results_of(launched, f"checkpointer {kind}"):
        assert out["step"] == 2
        assert out["losses"] == out["ref_losses"]
        assert all(torch.equal(out["resumed"][k], v) for k, v in out["ref"].items())


@pytest.mark.parametrize("kind", ["torch", "fused", "zero"])
def test_a_list_resumes_like_an_uninterrupted_run(launched, kind):
    """Same ranks, same ops: bit for bit (losses and every model entry, the frozen layer too)."""
    for out in results_of(launched, kind):
        assert out["losses"] == out["ref_losses"]
        assert all(torch.equal(out["resumed"][k], v) for k, v in out["ref"].items())
        if kind == "torch":
            assert out["from_dcp"] == out["ref_losses"]  # torch's checkpoint of the list, loaded here
            # ours into torch's set_state_dict and torch DDP: its all-reduce averages in another
            # order than fusedist's, so fp32 rounding only
            torch.testing.assert_close(out["into_torch"], out["ref_losses"], rtol=1e-5, atol=1e-6)
    if kind == "zero":  # the ZeRO shards of 2 ranks into one process, unsharded optimizers
        model = _model(9)
        opts = _optimizers(model, "torch")
        ckpt.load(os.path.join(launched["root"], "zero"), model, opts)
        losses = _train(model, opts, range(2, 4))
        # the global batch in one process vs its halves averaged over 2 ranks (each rank's loss is
        # its half's mean, the global loss their mean): fp32 rounding only
        halves = [out["ref_losses"] for out in results_of(launched, "zero")]
        torch.testing.assert_close(losses, [(a + b) / 2 for a, b in zip(*halves)], rtol=1e-5, atol=1e-6)


def test_a_save_of_a_list_refuses_diverged_ranks(launched):
    """A Checkpointer of a list of optimizers ran no DDP step check (its views of the model are
    bare modules) and wrote the diverged replicas; now it raises plain save's error, on every
    rank alike, and writes nothing."""
    outs = results_of(launched, "diverged")
    for out in outs:
        assert out["checkpointer"] is not None and out["checkpointer"][0] == "RankMismatchError", out
        assert out["save"] is not None and out["save"][0] == "RankMismatchError", out
        steps, plain = out["written"]
        assert not plain and not [n for n in steps if "00000003" in n], out["written"]
        assert [n for n in steps if "00000002" in n], steps  # the earlier checkpoint is kept
    same = [re.sub(r"this is rank \d", "", out["checkpointer"][1]) for out in outs]
    assert same[0] == same[1] and "hold different values" in same[0], same


# ----------------------------------------------------------------------------- refusals (one process)
def _saved(tmp_path) -> tuple:
    model = _model()
    opts = _optimizers(model)
    _train(model, opts, range(2))
    directory = str(tmp_path / "c")
    ckpt.save(directory, model, opts)
    return directory, model, opts


def _unchanged(model, opts, check):
    """``check()`` raises; the model and optimizers are as they were."""
    before, states = _state(model), [repr(o.state_dict()) for o in opts]
    check()
    assert all(torch.equal(v, before[k]) for k, v in _state(model).items())
    assert [repr(o.state_dict()) for o in opts] == states


def test_overlapping_optimizers_are_refused_before_anything_is_written(tmp_path):
    model = _model()
    opts = [torch.optim.AdamW(model.parameters()), torch.optim.SGD(model[3].parameters(), lr=0.1)]
    with pytest.raises(ValueError, match=r"parameter '3.weight' is in optimizers 0 and 1"):
        ckpt.save(str(tmp_path / "c"), model, opts)
    assert not os.path.exists(tmp_path / "c")


@pytest.mark.parametrize("case", ["reordered", "shorter", "longer", "other kind", "one optimizer"])
def test_a_load_into_other_optimizers_is_refused(tmp_path, case):
    directory, _, _ = _saved(tmp_path)
    model = _model(3)
    adamw, sgd = _optimizers(model)
    _train(model, [adamw, sgd], range(1))
    frozen = torch.optim.SGD(model[1].parameters(), lr=0.1)  # (an optimizer of the frozen layer)
    given = {"reordered": [sgd, adamw], "shorter": [adamw], "one optimizer": adamw, "longer": [adamw, sgd, frozen],
             "other kind": [adamw, torch.optim.Adam(model[3].parameters())]}[case]
    message = {"reordered": r"2 optimizers \['AdamW', 'SGD'\], not of 2 \['SGD', 'AdamW'\]; optimizer 0: .*runs SGD",
               "shorter": r"holds the state of a list of optimizers \['AdamW', 'SGD'\]: pass that list",
               "longer": r"2 optimizers \['AdamW', 'SGD'\], not of 3 \['AdamW', 'SGD', 'SGD'\]\. Pass",
               "other kind": r"not of 2 \['AdamW', 'Adam'\]; optimizer 1: it holds the state of SGD",
               "one optimizer": r"holds the state of a list of optimizers \['AdamW', 'SGD'\]: pass that list"}[case]

    def load():
        with pytest.raises(ckpt.CheckpointError, match=message):
            ckpt.load(directory, model, given)
    _unchanged(model, [adamw, sgd], load)
    ckpt.load(directory, model, None)  # the model alone loads


def test_a_list_is_refused_for_a_checkpoint_of_one_optimizer(tmp_path):
    """(and one optimizer for a checkpoint of several: test_a_load_into_other_optimizers_is_refused)"""
    model = _model()
    opts = _optimizers(model)
    ckpt.save(str(tmp_path / "c"), model, opts[0])
    with pytest.raises(ckpt.CheckpointError, match=r"was not saved with a list of optimizers"):
        ckpt.load(str(tmp_path / "c"), model, opts)


def test_a_checkpointer_refuses_another_list_and_a_model_with_extra_state(tmp_path):
    model = _model()
    opts = _optimizers(model)
    with ckpt.Checkpointer(str(tmp_path / "root"), async_save=False) as cp:
        assert cp.restore(model, opts) == 0
        _train(model, opts, range(1))
        cp.save(1)
    fresh = _model(3)
    adamw, sgd = _optimizers(fresh)
    other = [torch.optim.SGD(fresh[0].parameters(), lr=0.1), sgd]

    def restore():
        with ckpt.Checkpointer(str(tmp_path / "root"), async_save=False) as cp:
            with pytest.raises(ckpt.CheckpointError, match=r"not of 2 \['SGD', 'SGD'\]; optimizer 0: .*AdamW"):
                cp.restore(fresh, other)
    _unchanged(fresh, other, restore)

    class WithExtra(nn.Linear):
        def get_extra_state(self):
            return {"calls": 1}

        def set_extra_state(self, state):
            pass

    model[3] = WithExtra(8, 3)
    opts = _optimizers(model)
    with pytest.raises(TypeError, match=r"module '3' \(WithExtra\) adds state beyond its parameters"):
        ckpt.save(str(tmp_path / "c"), model, opts)
    assert not os.path.exists(tmp_path / "c")


def test_a_fused_optimizer_takes_the_state_of_torchs_in_a_list(tmp_path):
    """torch's AdamW and fusedist's FusedAdamW run one algorithm: a list saved with one loads into
    the other, and training continues as torch's would (fp32, the fused kernel's rounding only)."""
    from fusedist.optim import FusedAdamW

    directory, model, opts = _saved(tmp_path)
    ref_losses = _train(model, opts, range(2, 4))
    fresh = _model(3)
    fused = [FusedAdamW(fresh[0].parameters(), lr=1e-2, weight_decay=0.1),
             torch.optim.SGD(fresh[3].parameters(), lr=5e-2, momentum=0.9)]
    ckpt.load(directory, fresh, fused)
    torch.testing.assert_close(_train(fresh, fused, range(2, 4)), ref_losses, rtol=1e-5, atol=1e-6)


def test_a_list_save_whose_step_check_fails_says_that_every_rank_must_call_it(tmp_path, monkeypatch):
    """The step check of a fusedist DDP model is the first collective of a list's save: its failure (a peer
    that never called the save) begins with the same guidance as the start exchange's, and keeps its type."""
    from fusedist.checkpoint import api
    from fusedist.comm.base import CollectiveError

    def step_check_not_joined(model, optimizer):
        raise CollectiveError("all_gather [ddp: step check] timed out", op="all_gather", tag="ddp: step check",
                              rank=0)

    monkeypatch.setattr(api, "_check_ranks_agree", step_check_not_joined)
    model = _model()
    with pytest.raises(CollectiveError) as raised:
        ckpt.save(str(tmp_path / "list"), model, _optimizers(model))
    text = str(raised.value)
    assert text.startswith("fusedist.checkpoint.save: rank 0's save could not start: some rank of the group did "
                           "not join it"), text
    assert "every rank of the group must call it" in text and "'ddp: step check'" in text, text
    assert text.endswith("That error: all_gather [ddp: step check] timed out"), text
    assert not os.path.exists(tmp_path / "list")
