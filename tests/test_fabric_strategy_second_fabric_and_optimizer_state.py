"""FusedistFabricStrategy against Lightning Fabric's ``strategy="ddp"`` where a program runs a second
Fabric experiment in the same process, and reads the optimizer's state by parameter:

* a Fabric with ``strategy="ddp"`` over the model and optimizer a fusedist Fabric set up, without
  ``strategy.teardown()`` (Fabric never calls it): it trains on as after Fabric's DDP;
* ``optimizer.state[p]["exp_avg"]`` on the torch optimizer given to ``fabric.setup``: the moments
  of the optimizer that steps for it (unsharded), or an error naming where the sharded state is;
* a ZeRO checkpoint written by ``fabric.save`` resumed by Fabric's DDP, and the reverse.

Ranks are processes of :func:`fusedist.testing.run_distributed` with the torchelastic variables
set, so Fabric starts no workers of its own. Tolerance: fp32, fused kernels and bucketed
all-reduces against torch's ops over a few steps on values of order 1: 1e-5 (they agree to
~3e-8); the failures these tests exist for raise, or leave the state empty.
"""

from __future__ import annotations

import gc
import os
import re

import pytest
import torch

from shared_rank_launch import results_of
from test_e2e_lightning_recipe import _launched_env
from test_fabric_strategy_setup_again_teardown_and_prewarmed import _fabric, _flat, _model_and_optimizer, _train
from test_lightning_launch import register, shared_launch

TOL = 1e-5


def _moments(optimizer, model):
    """``optimizer.state[p]["exp_avg"]`` of every parameter, flat (or the KeyError's text)."""
    try:
        return torch.cat([optimizer.state[p]["exp_avg"].reshape(-1) for p in model.parameters()])
    except KeyError as error:
        return str(error)


def _then_ddp(side, zero_stage, keep_first):
    """Train with ``side``; read the kept optimizer's moments; then, with no teardown, train the same
    model and optimizer in a Fabric with ``strategy="ddp"`` (the first Fabric still referenced, or
    dropped and collected): the moments, the weights, the moments; and (first Fabric kept, fusedist)
    what a forward through the first Fabric's retired wrapper raises."""
    fabric = _fabric(side, zero_stage)
    model, optimizer = _model_and_optimizer()
    wrapped, returned = fabric.setup(model, optimizer)
    _train(fabric, wrapped, returned, range(3))
    first = _moments(optimizer, model)
    kept = fabric if keep_first else None
    del fabric, returned
    if not keep_first:
        del wrapped
        gc.collect()  # (a collection takes the unreferenced wrappers that cycles keep till then)
    second = _fabric("ddp")
    _train(second, *second.setup(model, optimizer), range(3, 6), clip=0.05)
    refusal = None
    if keep_first and side != "ddp":
        try:
            wrapped(torch.randn(2, 8))
        except RuntimeError as error:
            refusal = str(error)
    del kept
    return first, _flat(model), _moments(optimizer, model), refusal


def _second_fabric_worker(rank, world):
    _launched_env(rank, world)
    ref = _then_ddp("ddp", 0, True)
    out = {}
    for stage, keep in ((0, True), (2, True), (2, False)):
        name = f"ZeRO {stage}, first Fabric {'kept' if keep else 'dropped'}"
        try:
            ours = _then_ddp("fusedist", stage, keep)
        except RuntimeError as error:  # (the refusal this test exists for)
            out[name] = str(error)[:300]
            continue
        out[name] = [a if isinstance(a, str) else (a - b).abs().max().item() for a, b in zip(ours[:3], ref)]
        out[name].append(ours[3])
    return out


def test_fabric_strategy_a_ddp_fabric_after_it_trains_without_teardown(launched):
    """A Fabric with ``strategy="ddp"`` over the same model and optimizer, after a fusedist Fabric that
    nobody tore down, was refused at its first step ("a backward pass that was not synchronized"):
    the fusedist wrapper still owned the parameters (unsharded: until a garbage collection took
    it). Its first forward through torch's DDP now retires the fusedist wrapper and optimizers,
    and it trains as Fabric's DDP run twice, the torch optimizer's own state (taken back from the
    shards at ZeRO stage 2) included."""
    for rank, diffs in enumerate(results_of(launched, "second Fabric")):
        for name, result in diffs.items():
            assert not isinstance(result, str), f"{name}, rank {rank}: the 'ddp' Fabric failed: {result}"
            _, weights, moments, refusal = result
            assert weights <= TOL, f"{name}, rank {rank}: weights differ from Fabric's DDP by {weights}"
            assert not isinstance(moments, str) and moments <= TOL, \
                f"{name}, rank {rank}: the optimizer's moments differ by {moments}"
            if "kept" in name:  # a forward through the retired wrapper names what retired it, not a teardown
                assert refusal is not None, f"{name}, rank {rank}: a forward through the retired wrapper ran"
                assert re.search(rf"rank {rank}\): this wrapper was retired when torch's DistributedDataParallel "
                                 r"wrapped its module \(of type Sequential.* Train through torch's wrapper", refusal), \
                    refusal
                assert "torn down" not in refusal, refusal


def test_fabric_strategy_kept_optimizer_state_reads_the_moments_by_parameter(launched):
    """``optimizer.state`` of the torch optimizer given to ``fabric.setup`` was empty (its state lived
    in the fused one swapped in): ``state[p]["exp_avg"]`` raised a bare KeyError. It reads the
    fused optimizer's state now, equal to torch's; at ZeRO stage 2 the lookup names the calls that
    read the sharded state."""
    for rank, diffs in enumerate(results_of(launched, "second Fabric")):
        unsharded, sharded = diffs["ZeRO 0, first Fabric kept"], diffs["ZeRO 2, first Fabric kept"]
        assert not isinstance(unsharded, str) and not isinstance(unsharded[0], str), (rank, unsharded)
        assert unsharded[0] <= TOL, f"rank {rank}: exp_avg differs from torch's AdamW by {unsharded[0]}"
        assert not isinstance(sharded, str), (rank, sharded)
        assert "sharded across 2 ranks" in sharded[0] and "consolidate_state_dict(to=0)" in sharded[0], sharded[0]


def _saved(side, zero_stage, path):
    """Two steps, then ``fabric.save``: the checkpoint's param-group keys."""
    fabric = _fabric(side, zero_stage)
    model, optimizer = fabric.setup(*_model_and_optimizer())
    _train(fabric, model, optimizer, range(2))
    fabric.save(path, {"model": model, "optimizer": optimizer})
    fabric.barrier()
    return sorted(torch.load(path, weights_only=False)["optimizer"]["param_groups"][0])


def _resumed(side, zero_stage, path):
    """A fresh model and optimizer loaded from ``path`` by ``side``, trained two more steps."""
    fabric = _fabric(side, zero_stage)
    model, optimizer = _model_and_optimizer()
    with torch.no_grad():  # (other weights than the checkpoint's: the load must replace them)
        for p in model.parameters():
            p.add_(1.0)
    model, optimizer = fabric.setup(model, optimizer)
    fabric.load(path, {"model": model, "optimizer": optimizer})
    _train(fabric, model, optimizer, range(2, 4))
    return _flat(model)


def _checkpoint_worker(rank, world, root):
    _launched_env(rank, world)
    ddp_path = os.path.join(root, "ddp.ckpt")
    ddp_keys = _saved("ddp", 0, ddp_path)
    ref = _resumed("ddp", 0, ddp_path)
    out = {}
    for stage in (1, 2):
        path = os.path.join(root, f"zero{stage}.ckpt")
        keys = _saved("fusedist", stage, path)
        out[f"ZeRO {stage} checkpoint: group keys"] = sorted(set(keys) ^ set(ddp_keys))
        out[f"ZeRO {stage} checkpoint resumed by 'ddp'"] = (_resumed("ddp", 0, path) - ref).abs().max().item()
        resumed = _resumed("fusedist", stage, ddp_path)
        out[f"'ddp' checkpoint resumed by ZeRO {stage}"] = (resumed - ref).abs().max().item()
    return out


def test_fabric_strategy_zero_checkpoints_resume_under_fabrics_ddp_and_back(launched):
    """A ZeRO stage 1/2 checkpoint carried a ``master_weights`` group key that Fabric's DDP never
    writes (a "ddp" run resumed from it wrote it on in every checkpoint after): its groups have
    torch's keys now, and either side's checkpoint resumes on the other as on its own."""
    for rank, results in enumerate(results_of(launched, "checkpoints")):
        for name, result in results.items():
            if name.endswith("group keys"):
                assert result == [], f"{name}, rank {rank}: keys that only one side writes: {result}"
            else:
                assert result <= TOL, f"{name}, rank {rank}: weights differ from Fabric's DDP by {result}"


def test_fabric_strategy_sharded_state_note_is_read_only_and_pickles():
    """The stage-2 ``state`` refuses writes (they would reach nothing) and survives a pickle."""
    import pickle

    from fusedist.integrations._optimizer_swap import ShardedStateNote

    note = ShardedStateNote("AdamW.state: sharded")
    with pytest.raises(TypeError, match="read-only"):
        note[0] = {}
    assert list(note.items()) == [] and pickle.loads(pickle.dumps(note)).what == "AdamW.state: sharded"
    with pytest.raises(KeyError, match="sharded.*consolidate_state_dict"):
        note[torch.zeros(1)]


def _jobs(tmp_path_factory):
    """The file's multi-rank checks, in the launch shared with the other Lightning and Fabric
    files (test_lightning_launch.py)."""
    # (both tests read the one scenario: it runs once, for whichever of them was selected)
    return {("test_fabric_strategy_a_ddp_fabric_after_it_trains_without_teardown",
             "test_fabric_strategy_kept_optimizer_state_reads_the_moments_by_parameter"): {
                "second Fabric": (_second_fabric_worker, ())},
            "test_fabric_strategy_zero_checkpoints_resume_under_fabrics_ddp_and_back": {
                "checkpoints": (_checkpoint_worker, (str(tmp_path_factory.mktemp("fabric_checkpoints")),))}}


register(_jobs, seconds=300)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    return shared_launch(request, tmp_path_factory)
