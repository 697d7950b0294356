"""Checkpoint saves over many steps, failed and given-up saves, and ZeRO built from an optimizer
factory, found by probing and kept as regression tests (2 gloo ranks, tiny models): the store
keys of ``save``'s I/O barriers, the per-process beat after a failed save, a Checkpointer after
a save given up on a hanging disk (Note [a save given up on] in fusedist/checkpoint/_writer.py),
and ``optimizer_class`` given as a lambda."""

import datetime
import time

import torch
from torch import nn

from fusedist.testing import run_distributed


def _zero_model(seed: int, factory):
    from fusedist.zero import ZeroRedundancyOptimizer

    torch.manual_seed(seed)
    model = nn.Linear(6, 4)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=factory, lr=1e-2)
    return model, opt


def _save_worker(rank, world_size, directory):
    import warnings

    from fusedist import checkpoint
    from fusedist.checkpoint import CheckpointError, _writer
    from fusedist.reliability.stall_report import default_store

    warnings.simplefilter("ignore")  # (the lambda's elementwise warning)
    out = {}
    # A lambda factory (not a class, not a partial): save and load as its class, AdamW, does.
    model, opt = _zero_model(0, lambda groups, **kw: torch.optim.AdamW(groups, **kw))
    ref_model = nn.Linear(6, 4)
    ref_model.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    for _ in range(2):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(7))
        for m, o in ((model, opt), (ref_model, ref_opt)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    shard = opt.shard_state_dict()
    out["shard_names"] = (shard["optimizer_class"], shard["algorithm"])
    opt.consolidate_state_dict(0)
    out["consolidated"] = sorted(opt.state_dict()["state"][0]) if rank == 0 else ["exp_avg", "exp_avg_sq", "step"]
    checkpoint.save(directory, model, opt, extra={"step": 2})
    torch_model = nn.Linear(6, 4)
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-2)
    checkpoint.load(directory, torch_model, torch_opt)
    got, want = torch_opt.state_dict()["state"], ref_opt.state_dict()["state"]
    out["state_matches_torch"] = all(torch.allclose(got[i][k], want[i][k], atol=1e-6) for i in want for k in want[i])
    other_model, other_opt = _zero_model(1, lambda groups, **kw: torch.optim.AdamW(groups, **kw))
    checkpoint.load(directory, other_model, other_opt)
    out["model_loaded"] = all(torch.equal(a, b) for a, b in zip(other_model.parameters(), model.parameters()))
    sgd_model, sgd = _zero_model(1, lambda groups, **kw: torch.optim.SGD(groups, **kw))
    try:
        checkpoint.load(directory, sgd_model, sgd)
        out["sgd"] = "loaded"
    except CheckpointError as exc:
        out["sgd"] = str(exc)

    # Many saves: the store holds no more keys after them than after the first. Each count is
    # taken between two barriers: a rank gone on to its next save would add that save's keys.
    store = default_store()
    torch.distributed.barrier()
    before = store.num_keys()
    torch.distributed.barrier()
    for step in range(5):
        checkpoint.save(directory, model, opt, extra={"step": step})
    torch.distributed.barrier()
    out["keys_added"] = store.num_keys() - before
    torch.distributed.barrier()
    out["checkpointer_keys"] = _checkpointer_key_counts(directory, model, opt, store)

    # A save failing on rank 1 before its file is written: every rank is told at once, and
    # the beat of each process stops with the save.
    if rank == 1:
        def broken():
            raise RuntimeError("the parameters' all-gather failed")
        opt.wait_for_params = broken
    started = time.monotonic()
    try:
        checkpoint.save(directory, model, opt)
        out["failed_save"] = "saved"
    except CheckpointError as exc:
        out["failed_save"] = str(exc)
    out["failed_in_s"] = time.monotonic() - started
    out["beat_running"] = _writer._Beat.stop is not None
    torch.distributed.barrier()
    return out


def _checkpointer_key_counts(directory, model, opt, store) -> dict:
    """The store's key count after each save of a Checkpointer keeping two checkpoints, saving in the
    training thread and in the background, each count taken between two barriers."""
    from fusedist import checkpoint

    counts = {}
    for kind, async_save in (("keep=2", False), ("async", True)):
        saver = checkpoint.Checkpointer(f"{directory}-{kind}", keep=2, async_save=async_save)
        saver.restore(model, opt)
        counts[kind] = []
        for step in range(1, 5):
            saver.save(step)
            saver.wait()
            torch.distributed.barrier()
            counts[kind].append(store.num_keys())
            torch.distributed.barrier()
        saver.close()
    return counts


def test_save_store_keys_beat_and_a_lambda_optimizer_factory(tmp_path):
    results = run_distributed(_save_worker, 2, str(tmp_path / "ckpt"), timeout=90)
    for out in results:
        assert out["state_matches_torch"] and out["model_loaded"]
        assert out["shard_names"] == ("AdamW", "AdamW") and out["consolidated"] == ["exp_avg", "exp_avg_sq", "step"]
        assert "AdamW" in out["sgd"] and "SGD" in out["sgd"]
        assert out["keys_added"] == 0
        # a Checkpointer keeps the I/O barrier keys of its last two saves only: no key is left per save
        for kind, counts in out["checkpointer_keys"].items():
            assert counts[1:] == [counts[1]] * len(counts[1:]), (kind, counts)
        assert "rank 1" in out["failed_save"] and "all-gather failed" in out["failed_save"]
        assert out["failed_in_s"] < 5.0
        assert not out["beat_running"]


def _given_up_worker(rank, world_size, root):
    from fusedist import checkpoint
    from fusedist.checkpoint import CheckpointError, _writer, api

    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = checkpoint.Checkpointer(root, keep=None, async_save=False)
    ckpt.restore(model, opt)
    # A hanging disk, scaled down: the cap on a wait for a peer's writes is 1 s here, and rank
    # 1's file of step 2 takes 2.5 s (its process stays alive, beating).
    _writer.collective_timeout = lambda: datetime.timedelta(seconds=1)
    _writer.IO_LIMIT_S = 0.5
    real = api._write

    def slow(path, name, *args, **kwargs):
        if rank == 1 and path.endswith("step-00000002"):
            time.sleep(2.5)
        return real(path, name, *args, **kwargs)

    api._write = slow
    out = {}
    with torch.no_grad():
        model.weight.add_(1.0)
    try:
        ckpt.save(2)
        out["step 2"] = "saved"
    except CheckpointError as exc:
        out["step 2"] = str(exc)
    with torch.no_grad():
        model.weight.add_(1.0)
    for attempt in range(6):  # each raises on every rank until the slow write has ended
        try:
            ckpt.save(3)
            break
        except CheckpointError as exc:
            assert "given up" in str(exc), exc
    out["attempts"] = attempt
    ckpt.save(4)
    ckpt.close()
    loaded = nn.Linear(6, 4)
    checkpoint.load(f"{root}/step-00000004", loaded)
    out["loaded"] = torch.equal(loaded.weight, model.weight)
    return out


def test_a_checkpointer_saves_again_after_a_save_given_up_on_a_hanging_disk(tmp_path):
    results = run_distributed(_given_up_worker, 2, str(tmp_path / "root"), timeout=90)
    for out in results:
        assert "storage seems to hang" in out["step 2"] and "given up" in out["step 2"]
        assert out["loaded"]
