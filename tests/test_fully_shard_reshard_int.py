"""``fully_shard(..., reshard_after_forward=k)`` with an int ``k`` (torch FSDP2's signature): after
forward each rank keeps its 1/k of a unit, shared with a run of k consecutive ranks, and the
backward all-gather runs within that run (Note [resharding to a smaller group after forward] in
fusedist/fsdp/post_forward.py).

World 4 on gloo, k = 2 (runs {0, 1} and {2, 3}). References: torch's FSDP2 with the same int
(losses, eval outputs and weights within fp32 / bf16 tolerance: the two libraries reduce in
different layouts, so AdamW steps differ by roundings), and fusedist with
``reshard_after_forward=True``, which must be bitwise equal -- the parts gathered back are the
same bytes in the same places.
"""

from __future__ import annotations

import copy
import time
import warnings

import pytest
import torch
import torch.distributed.tensor
import torch.nn.functional as F
from torch import nn

import fusedist
import models
from fusedist.testing import run_distributed

WORLD, K, D = 4, 2, 16
FP32 = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=2 ** -7, atol=1e-5)
# weights after AdamW steps: its update is nearly invariant to a gradient's scale, so a rounding
# apart in a near-zero gradient can move a weight by a fraction of lr (1e-2)
STEPPED = dict(rtol=1e-4, atol=1e-4)
# a bf16 forward after such steps: weights that far apart may cast to neighbouring bf16 values
BF16_STEPPED = dict(rtol=2 ** -5, atol=5e-3)


class Net(nn.Module):
    def __init__(self, blocks: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(models.ResidualBlock(D, width=4) for _ in range(blocks))
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, D, generator=g), torch.randn(6, 3, generator=g)


def _shard(model, shard_fn, mesh, raf, **kw):
    for b in model.blocks:
        shard_fn(b, mesh=mesh, reshard_after_forward=raf, **kw)
    shard_fn(model, mesh=mesh, **kw)  # the root under the default None: kept gathered
    return model


def _full(model) -> dict:
    if isinstance(next(model.parameters()), torch.distributed.tensor.DTensor):  # torch's FSDP2
        return {n: p.full_tensor() for n, p in model.named_parameters()}
    return fusedist.fsdp.full_state_dict(model)


def _train(model, rank, steps=3, eval_at=1):
    """AdamW steps; after step ``eval_at``'s optimizer step, a no_grad eval forward (whose
    parts the next training forward gathers from). Returns losses, eval output."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, evals = [], None
    for step in range(steps):
        x, y = _batch(rank, step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().float())
        if step == eval_at:
            with torch.no_grad():
                evals = model(_batch(rank, 99)[0]).float()
    return torch.stack(losses), evals


def _parity(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    hsdp = init_device_mesh("cpu", (1, ws), mesh_dim_names=("dp_replicate", "dp_shard"))
    results = {}
    for what, m, mp in [("fp32", mesh, None), ("bf16", mesh, torch.bfloat16), ("hsdp", hsdp, None)]:
        torch.manual_seed(0)
        base = Net()
        ref, ref_true, ours, ours_true = base, copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
        # (reduced in fp32: a bf16 sum in the two libraries' orders would differ by bf16 roundings)
        tkw = dict(mp_policy=TorchMP(param_dtype=mp, reduce_dtype=torch.float32)) if mp else {}
        okw = dict(mp_policy=fusedist.MixedPrecisionPolicy(param_dtype=mp, reduce_dtype=torch.float32)) if mp else {}
        _shard(ref, torch_fully_shard, m, K, **tkw)
        _shard(ref_true, torch_fully_shard, m, True, **tkw)
        _shard(ours, fusedist.fully_shard, m, K, **okw)
        _shard(ours_true, fusedist.fully_shard, m, True, **okw)
        l_ref, e_ref = _train(ref, rank)
        l_ref_true, e_ref_true = _train(ref_true, rank)
        l_ours, e_ours = _train(ours, rank)
        l_true, e_true = _train(ours_true, rank)
        # (collectives: before any check)
        f_ref, f_ref_true, f_ours, f_true = _full(ref), _full(ref_true), _full(ours), _full(ours_true)
        tol = BF16 if mp else FP32
        torch.testing.assert_close(l_ours, l_ref, **tol, msg=lambda m, w=what: f"{w}: losses\n{m}")
        torch.testing.assert_close(e_ours, e_ref, **(BF16_STEPPED if mp else FP32),
                                   msg=lambda m, w=what: f"{w}: eval\n{m}")
        # bitwise against True, in each library: the post-forward parts are the gathered bytes
        assert torch.equal(l_ours, l_true) and torch.equal(e_ours, e_true), what
        assert torch.equal(l_ref, l_ref_true) and torch.equal(e_ref, e_ref_true), what
        for n in f_ref:
            torch.testing.assert_close(f_ours[n], f_ref[n], **STEPPED, msg=lambda m, w=what, n=n: f"{w}: {n}\n{m}")
            assert torch.equal(f_ours[n], f_true[n]), f"{what}: {n}"
            assert torch.equal(f_ref[n], f_ref_true[n]), f"{what}: {n} (torch)"
        results[what] = True
    # CPU offload: the shards on the host, the parts on the compute device; same numbers as True
    torch.manual_seed(0)
    base = Net()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    _shard(a, fusedist.fully_shard, mesh, K, offload_policy=fusedist.fsdp.CPUOffloadPolicy(pin_memory=False))
    _shard(b, fusedist.fully_shard, mesh, True, offload_policy=fusedist.fsdp.CPUOffloadPolicy(pin_memory=False))
    la, ea = _train(a, rank)
    lb, eb = _train(b, rank)
    assert torch.equal(la, lb) and torch.equal(ea, eb)
    fa, fb = _full(a), _full(b)
    assert all(torch.equal(fa[n], fb[n]) for n in fa)
    results["offload"] = True
    # Shard(1) weights (shard_placement_fn): the parts are the gathered bytes too, so bitwise
    # True's run (True's against FSDP2: test_fully_shard_placement.py). torch 2.13's FSDP2 is no
    # reference here: with an int it cuts a Shard(1) piece's post-forward view along dim 0 (an
    # embedding of 23 rows at k = 2 fails with "setStorage ... out of bounds").
    from torch.distributed.tensor import Shard

    def dim1(p):
        return Shard(1) if p.ndim == 2 else None

    a, b = copy.deepcopy(base), copy.deepcopy(base)
    _shard(a, fusedist.fully_shard, mesh, K, shard_placement_fn=dim1)
    _shard(b, fusedist.fully_shard, mesh, True, shard_placement_fn=dim1)
    (la, ea), (lb, eb) = _train(a, rank), _train(b, rank)
    assert torch.equal(la, lb) and torch.equal(ea, eb)
    fa, fb = _full(a), _full(b)
    assert all(torch.equal(fa[n], fb[n]) for n in fa)
    results["Shard(1)"] = True
    return results


def test_int_matches_fsdp2_and_true():
    """fp32, bf16 param_dtype and a (1, 4) HSDP mesh: torch FSDP2 with k = 2, and fusedist with
    True bitwise, over AdamW steps with a no_grad eval forward between them; CPU offload and
    Shard(1) weights too."""
    out = run_distributed(_parity, WORLD, timeout=240)
    assert out == [{"fp32": True, "bf16": True, "hsdp": True, "offload": True, "Shard(1)": True}] * WORLD


def _counting(comm, counts: dict, key: str):
    """Count ``comm``'s all-gathers under ``counts[key]`` (instance attribute; the class's stays)."""
    inner = comm.all_gather

    def all_gather(*args, **kwargs):
        counts[key] = counts.get(key, 0) + 1
        return inner(*args, **kwargs)

    comm.all_gather = all_gather
    return inner


def _memory_and_gathers(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    base = Net()
    model = _shard(copy.deepcopy(base), fusedist.fully_shard, mesh, K)
    ref = _shard(copy.deepcopy(base), fusedist.fully_shard, mesh, True)
    # (made before any forward: a root left gathered by a no_grad forward lists its unsharded parameters)
    opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    units = [b._fs_state().unit for b in model.blocks]
    root = model._fs_state().unit
    out = {}
    pf = units[0].post_forward
    # the runs: consecutive ranks of the shard group, one group made once and reused
    out["run"] = (pf.ranks, pf.rank, pf.comm.world_size)
    out["reused"] = all(u.post_forward.comm is pf.comm for u in units) and \
        ref.blocks[0]._fs_state().unit.post_forward is None
    for m in (model, ref):  # a first step: the root's first forward checks the wrapping across ranks
        F.mse_loss(m(_batch(rank, 5)[0]), _batch(rank, 5)[1]).backward()
    counts: dict = {}
    restore = [(pf.comm, _counting(pf.comm, counts, "run")), (root.comm, _counting(root.comm, counts, "group"))]
    try:
        x, y = _batch(rank, 0)
        loss = F.mse_loss(model(x), y)
        # between forward and backward: each block holds 1/k of itself, its gathered buffer freed
        stats = model.memory_stats()
        blocks_full = sum(u.unsharded_bytes for u in units)
        out["held"] = [(u.post_forward_bytes * K == u.unsharded_bytes,
                        u.full.untyped_storage().nbytes() == 0) for u in units]
        out["stats"] = (stats["post_forward_bytes"] * K == blocks_full,
                        stats["gathered_bytes"] == root.unsharded_bytes + blocks_full // K)
        out["forward_gathers"] = dict(counts)
        counts.clear()
        loss.backward()
        # backward: one gather per block within the run, none over the shard group
        out["backward_gathers"] = dict(counts)
        out["after_backward"] = (model.memory_stats()["post_forward_bytes"], all(not u.is_unsharded for u in units))
        F.mse_loss(ref(x), y).backward()
        out["grads"] = all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())
                           if p.grad is not None)

        # an explicit unshard() of a unit holding its part gathers within the run; reshard() frees
        counts.clear()
        with torch.no_grad():
            model(x)
        blk = model.blocks[1]
        h = blk.unshard(async_op=True)
        h.wait()
        out["unshard"] = (counts.get("run", 0), blk._fs_state().unit.is_unsharded,
                          blk._fs_state().unit.post_forward_bytes)
        blk.reshard()
        out["resharded"] = blk._fs_state().unit.full.untyped_storage().nbytes()

        # an optimizer step drops the parts an eval left (stale, Note [gathered copies and the
        # optimizer step]): the next forward gathers the stepped values, equal to True's run
        with torch.no_grad():
            model(x), ref(x)
        held = model.memory_stats()["post_forward_bytes"]
        opt.step(), opt_ref.step()
        out["stale"] = (held > 0, model.memory_stats()["post_forward_bytes"])
        # explicit prefetch lists still drive the gathers
        for i in range(1, len(model.blocks)):
            model.blocks[i - 1].set_modules_to_forward_prefetch([model.blocks[i]])
            model.blocks[i].set_modules_to_backward_prefetch([model.blocks[i - 1]])
        x2, y2 = _batch(rank, 1)
        l1, l2 = F.mse_loss(model(x2), y2), F.mse_loss(ref(x2), y2)
        l1.backward(), l2.backward()
        out["after_step"] = torch.equal(l1, l2) and all(
            torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()) if p.grad is not None)

        # set_reshard_after_forward: a bool only (FSDP2's); True then reshards fully
        try:
            model.set_reshard_after_forward(2)
            out["set_int"] = None
        except ValueError as e:
            out["set_int"] = str(e)
        model.set_reshard_after_forward(True)
        model(x)
        out["set_true"] = (model.memory_stats()["post_forward_bytes"], units[0].post_forward)
        model.reshard()
    finally:
        for comm, inner in restore:
            comm.all_gather = inner
    return out


def test_memory_subgroup_gathers_and_interactions():
    out = run_distributed(_memory_and_gathers, WORLD, timeout=180)
    for rank, o in enumerate(out):
        run = (0, 1) if rank < 2 else (2, 3)
        assert o["run"] == (run, rank % 2, K), o["run"]
        assert o["reused"]
        assert o["held"] == [(True, True)] * 3
        assert o["stats"] == (True, True)
        # forward: 4 units over the shard group, nothing within the run
        assert o["forward_gathers"] == {"group": 4}, o["forward_gathers"]
        assert o["backward_gathers"] == {"run": 3}, o["backward_gathers"]
        assert o["after_backward"] == (0, True)
        assert o["grads"]
        assert o["unshard"] == (1, True, 0), o["unshard"]
        assert o["resharded"] == 0
        assert o["stale"] == (True, 0)
        assert o["after_step"] is True, o["after_step"]
        assert "should be a bool" in o["set_int"]
        assert o["set_true"] == (0, None)


def _validation(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for value in (0, 3, 5, -2, 2.0, "2"):
        m = nn.Linear(4, 4)
        try:
            fusedist.fully_shard(m, mesh=mesh, reshard_after_forward=value)
            out[repr(value)] = None
        except ValueError as e:
            out[repr(value)] = str(e)
        assert not isinstance(m, fusedist.FSDPModule)  # refused before the module changes
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        one = fusedist.fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=1)
    out["1"] = (one._fs_state().unit.reshard_after_forward, one._fs_state().unit.post_forward,
                any("world size 1" in str(w.message) for w in caught))
    four = fusedist.fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=ws)
    out["4"] = (four._fs_state().unit.reshard_after_forward, four._fs_state().unit.post_forward)
    # HSDP (2, 2): k is checked against the shard dim's size, 2
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    try:
        fusedist.fully_shard(nn.Linear(4, 4), mesh=hsdp, reshard_after_forward=4)
        out["hsdp 4"] = None
    except ValueError as e:
        out["hsdp 4"] = str(e)
    # an explicit int on the root is honoured (only None keeps the root gathered)
    root = fusedist.fully_shard(nn.Linear(4, 8), mesh=mesh, reshard_after_forward=K)
    root(torch.randn(2, 4)).sum().backward()
    with torch.no_grad():
        root(torch.randn(2, 4))
    out["root"] = root.memory_stats()["post_forward_bytes"] * K == root._fs_state().unit.unsharded_bytes
    return out


def test_values_as_fsdp2():
    """Torch's rules: a non-divisor (0, 3, 5, negative) or a non-int is a ValueError naming the
    value and the group size; 1 is False (warned), the group size is True; on HSDP the shard
    dim's size counts; an int on the root applies."""
    out = run_distributed(_validation, WORLD, timeout=120)
    for o in out:
        for value in ("0", "3", "5", "-2"):
            assert "factor of the shard group's size 4" in o[value] and f"not {value}" in o[value], o[value]
        for value in ("2.0", "'2'"):
            assert "should be a bool or an int" in o[value] and value in o[value], o[value]
        assert o["1"] == (False, None, True)
        assert o["4"] == (True, None)
        assert "factor of the shard group's size 2, not 4" in o["hsdp 4"]
        assert o["root"] is True


def _mismatched(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    from fusedist.fsdp import post_forward

    mesh = init_device_mesh("cpu", (ws,))
    cases = {
        "2 vs True": 2 if rank == 0 else True,  # rank 0's run partner would never meet it in new_group
        "2 vs 4": 2 if rank < 2 else 4,  # runs {0, 1} agree; ranks 2, 3 would gather over all four
        "False vs True": False if rank == 3 else True,  # rank 3 would skip the backward's gathers
    }
    out = {}
    for what, raf in cases.items():
        torch.manual_seed(0)
        model = _shard(Net(), fusedist.fully_shard, mesh, raf)
        made = len(post_forward._GROUPS)
        start = time.monotonic()
        try:
            model(_batch(rank, 0)[0])
            out[what] = None
        except fusedist.RankMismatchError as e:
            out[what] = (str(e), time.monotonic() - start, len(post_forward._GROUPS) - made)
    # agreeing ranks: the run's group is made at the first forward, after the check
    torch.manual_seed(0)
    model = _shard(Net(), fusedist.fully_shard, mesh, K)
    before = len(post_forward._GROUPS)
    F.mse_loss(model(_batch(rank, 0)[0]), _batch(rank, 0)[1]).backward()
    out["agreed"] = (before, len(post_forward._GROUPS))
    return out


def test_values_differing_across_ranks_fail_on_every_rank():
    """A unit given different ``reshard_after_forward`` values on different ranks: a
    RankMismatchError on every rank at the first forward, naming the unit and each rank's
    value, before any run's process group is made (a rank given an int used to wait in
    ``new_group`` for a partner that never came, until the store's timeout)."""
    out = run_distributed(_mismatched, WORLD, timeout=60)
    expected = {
        "2 vs True": ("ranks [0]: ", "reshard_after_forward=2", "ranks [1, 2, 3]: ", "reshard_after_forward=True"),
        "2 vs 4": ("ranks [0, 1]: ", "reshard_after_forward=2", "ranks [2, 3]: ", "reshard_after_forward=True"),
        "False vs True": ("ranks [0, 1, 2]: ", "reshard_after_forward=True", "ranks [3]: ",
                          "reshard_after_forward=False"),
    }
    for o in out:
        for what, parts in expected.items():
            assert o[what] is not None, f"{what}: no error"
            text, elapsed, made = o[what]
            assert "fully_shard wrapping of the model differs across ranks" in text, text
            assert "unit 'blocks.0'" in text, text
            first, first_value, second, second_value = parts
            assert f"{first}unit 'blocks.0'" in text and f"{second}unit 'blocks.0'" in text, text
            assert text.index(first_value) < text.index(second) < text.index(second_value), text
            assert elapsed < 10 and made == 0, (what, elapsed, made)
        assert o["agreed"] == (0, 1), o["agreed"]


class CheckpointedNet(Net):
    """The blocks under activation checkpointing: their recompute in backward gathers them
    from the post-forward parts."""

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False)
        return self.head(x)


def _tied_and_checkpointed(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    import models

    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    # a weight tied across units: the embedding's unit (k) lends it to the root's output layer
    torch.manual_seed(0)
    base = models.TiedLM()
    runs = []
    for raf in (K, True):
        m = copy.deepcopy(base)
        fusedist.fully_shard(m.embed, mesh=mesh, reshard_after_forward=raf)
        fusedist.fully_shard(m, mesh=mesh, reshard_after_forward=raf)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            tokens = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(10 * rank + step))
            loss = m(tokens).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        runs.append(torch.stack(losses))
    out["tied"] = torch.equal(*runs)
    runs = []
    for raf in (K, True):
        torch.manual_seed(0)
        m = _shard(CheckpointedNet(), fusedist.fully_shard, mesh, raf)
        l, e = _train(m, rank)
        runs.append(torch.cat([l, e.flatten()]))
    out["checkpointed"] = torch.equal(*runs)
    return out


def test_tied_weights_and_activation_checkpointing():
    """Bitwise as True: a weight tied across an int unit and the root; blocks recomputed under
    activation checkpointing."""
    out = run_distributed(_tied_and_checkpointed, WORLD, timeout=120)
    assert out == [{"tied": True, "checkpointed": True}] * WORLD


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
