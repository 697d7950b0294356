"""The rest of FSDP2's ``FSDPModule`` methods on fusedist's ``fully_shard`` -- the all-reduce
hook, unused-parameter reduction, the reduce-scatter buffer cap, recovery with
``reset_iter_state``, the post-optimizer event, ``_set_unshard_async_op``, and the
communication settings fusedist records or refuses -- against torch's FSDP2, same model,
same data, 2 gloo ranks.

Inputs are fresh random draws: each test picks a new seed (shown in every failure message).
Tolerances as in test_fully_shard_api_parity.py: fp32 results bit for bit (same ops on the same
values, one sum of two terms, one division); an fp16 ``reduce_dtype`` with a divide factor
one fp16 rounding apart in the gradients (the division left after the sum), while what the
all-reduce hook sees -- the sum before that division -- is bit for bit.

The hook's tensor holds the same elements as FSDP2's in another order (each library's shard
layout), so the tests compare what the ranks' hook tensors together say about each whole
parameter.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import models
from phased_launches import launch_phase
from shared_rank_launch import results_of
from test_fully_shard_api_parity import (EXACT, FP16, _check_grads, _check_params, _gathering, _ids, _loss,
                                         _mesh, _optimizers, _pair, _seed, _train_step, _units)


def _names(model) -> dict:
    return {id(m): n for n, m in model.named_modules()}


# ---------------------------------------------------------------------- all-reduce hook
def _whole_from_torch(module, outputs: list, ws: int) -> dict:
    """Each parameter of an FSDP2 module's group, whole, from the ranks' hook tensors: FSDP2's
    reduce-scatter output is, per parameter in group order, the rank's dim-0 chunk padded to
    ceil(rows / world size) rows."""
    group = module._get_fsdp_state()._fsdp_param_group
    whole, offset = {}, 0
    for fp in group.fsdp_params:
        shape = fp._orig_size
        rows = -(-shape[0] // ws)
        chunk = rows * shape[1:].numel()
        parts = [out[offset:offset + chunk].view(rows, *shape[1:]) for out in outputs]
        whole[fp._param_fqn] = torch.cat(parts)[:shape[0]]
        offset += chunk
    assert offset == outputs[0].numel(), "FSDP2's hook tensor holds more than its parameters"
    return whole


def _whole_from_ours(module, outputs: list, prefix: str) -> dict:
    """The same from fusedist's hook tensors: together the gathered trainable section."""
    from fusedist.fsdp.state import state_of

    unit = state_of(module).unit
    sec = unit.layout.sections[0]
    flat = torch.cat(outputs)
    return {prefix + unit.fqns[i]: flat[s.offset:s.offset + s.numel].view(s.shape)
            for i, s in zip(sec.indices, sec.layout.slots)}


def _hook_calls(model) -> dict:
    """Install a recording hook on each unit of ``model``: {module: [tensor per call]}."""
    calls = {}
    for m in _units(model):
        calls[m] = []
        m.set_all_reduce_hook(lambda t, seen=calls[m]: seen.append(t.detach().clone()))
    return calls


def _compare_hook_calls(ref, ours, ref_calls, our_calls, ws, what) -> None:
    """Same number of calls per unit, same dtype, and the same whole parameters from the ranks'
    hook tensors, exactly."""
    ref_names, our_names = _names(ref), _names(ours)
    for (rm, rc), (om, oc) in zip(ref_calls.items(), our_calls.items()):
        name = our_names[id(om)]
        assert ref_names[id(rm)] == name
        assert len(oc) == len(rc), f"{what}: unit '{name}': {len(oc)} hook calls, FSDP2 {len(rc)}"
        for k, (r, o) in enumerate(zip(rc, oc)):
            assert o.dtype == r.dtype and o.dim() == r.dim() == 1, f"{what}: '{name}' call {k}: {o.dtype}, {r.dtype}"
            r_all, o_all = [None] * ws, [None] * ws
            dist.all_gather_object(r_all, r)
            dist.all_gather_object(o_all, o)
            expected = _whole_from_torch(rm, r_all, ws)
            got = _whole_from_ours(om, o_all, f"{name}." if name else "")
            assert got.keys() == expected.keys(), f"{what}: '{name}': {sorted(got)} != {sorted(expected)}"
            for fqn, t in expected.items():
                torch.testing.assert_close(got[fqn], t, **EXACT, msg=lambda m: f"{what}: hook call {k}: {fqn}: {m}")


def _hook_fp32(rank, ws, seed) -> None:
    ref, ours = _pair(_mesh(ws), wrap_embed=True)
    ref_calls, our_calls = _hook_calls(ref), _hook_calls(ours)
    pairs = _optimizers(ref, ours)
    for step in range(2):
        _train_step(pairs, _ids(seed, rank, step))
    _compare_hook_calls(ref, ours, ref_calls, our_calls, ws, f"seed {seed}: fp32")
    assert all(len(c) == 2 for c in our_calls.values()), "one call per unit and backward"
    _check_params(ref, ours, f"seed {seed}: fp32 hooks")
    # Micro-batches: no hook without a reduction; one per unit at the synchronized backward.
    for calls in (ref_calls, our_calls):
        for c in calls.values():
            c.clear()
    for mb in range(2):
        for model in (ref, ours):
            model.set_requires_gradient_sync(mb == 1)
            _loss(model, *_ids(seed, rank, 10 + mb), scale=0.5).backward()
        assert all(len(c) == mb for c in our_calls.values()), f"seed {seed}: micro-batch {mb}"
    _compare_hook_calls(ref, ours, ref_calls, our_calls, ws, f"seed {seed}: accumulated")
    _check_grads(ref, ours, EXACT, f"seed {seed}: accumulated")


def _hook_in_place_and_removed(rank, ws, seed) -> None:
    """A hook that scales its tensor in place changes that unit's gradients as FSDP2's does;
    ``None`` removes it."""
    ref, ours = _pair(_mesh(ws), wrap_embed=True)
    for model in (ref, ours):
        model.blocks[0].set_all_reduce_hook(lambda t: t.mul_(2.0))
    batch = _ids(seed, rank, 0)
    for model in (ref, ours):
        _loss(model, *batch).backward()
    _check_grads(ref, ours, EXACT, f"seed {seed}: in-place hook")
    calls = []
    ours.blocks[0].set_all_reduce_hook(calls.append)
    ours.blocks[0].set_all_reduce_hook(None)
    _loss(ours, *batch).backward()
    assert calls == [], "a removed hook should not be called"
    with pytest.raises(TypeError, match="callable"):
        ours.set_all_reduce_hook(3)


def _hook_fp16(rank, ws, seed) -> None:
    """fp16 reduction with a factor that leaves a division after the sum: the hook sees the
    sum before it, as FSDP2's."""
    import fusedist
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    ref, ours = _pair(_mesh(ws), ref_kw=dict(mp_policy=TorchMP(reduce_dtype=torch.float16)),
                      our_kw=dict(mp_policy=fusedist.MixedPrecisionPolicy(reduce_dtype=torch.float16)))
    for model in (ref, ours):
        for m in _units(model):
            m.set_gradient_divide_factor(3.0)
    ref_calls, our_calls = _hook_calls(ref), _hook_calls(ours)
    batch = _ids(seed, rank, 0)
    for model in (ref, ours):
        _loss(model, *batch).backward()
    _compare_hook_calls(ref, ours, ref_calls, our_calls, ws, f"seed {seed}: fp16, factor 3")
    assert all(c[0].dtype == torch.float16 for c in our_calls.values())
    _check_grads(ref, ours, FP16, f"seed {seed}: fp16, factor 3")


def _hook_with_collective(rank, ws, seed) -> None:
    """A hook that issues a collective on another group (as a hand-made all-reduce across
    replicas does) runs at the same point on every rank: no hang, FSDP2's sums."""
    group = dist.new_group(list(range(ws)))
    ref, ours = _pair(_mesh(ws), wrap_embed=True)
    sums = {}
    for model in (ref, ours):
        sums[model] = {}
        for name, m in model.named_modules():
            if m in _units(model):
                def hook(t, seen=sums[model].setdefault(name, [])):
                    total = t.sum().reshape(1)
                    dist.all_reduce(total, group=group)
                    seen.append(total)
                m.set_all_reduce_hook(hook)
    pairs = _optimizers(ref, ours)
    for step in range(3):
        _train_step(pairs, _ids(seed, rank, step))
    assert sums[ours].keys() == sums[ref].keys() and all(len(v) == 3 for v in sums[ours].values())
    for name, got in sums[ours].items():  # the same elements summed in another order
        torch.testing.assert_close(torch.cat(got), torch.cat(sums[ref][name]), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"seed {seed}: unit '{name}': {m}")
    _check_params(ref, ours, f"seed {seed}: collective in the hook")


def _all_reduce_hook(rank, ws, seed):
    _hook_fp32(rank, ws, seed)
    _hook_with_collective(rank, ws, seed)
    _hook_in_place_and_removed(rank, ws, seed)
    _hook_fp16(rank, ws, seed)
    return True


def test_all_reduce_hook_matches_fsdp2(launched, seeds):
    """set_all_reduce_hook: one call per unit and synchronized backward (none under
    set_requires_gradient_sync(False)), with a tensor in reduce_dtype whose elements over the
    ranks are FSDP2's exactly (fp32 average; fp16 sum before the division by the rest of the
    factor); an in-place change reaches the gradients as in FSDP2; a hook issuing a collective
    on another group runs without a hang; None removes the hook."""
    seed = seeds["all-reduce hook"]
    assert results_of(launched, "all-reduce hook") == [True, True], f"seed {seed}"


# ------------------------------------------------------- unused parameters, buffer cap
class Gate(nn.Module):
    """Two branches; the second runs only when asked (conditional control flow)."""

    def __init__(self, d: int):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x, use_b: bool):
        return x + torch.tanh(self.a(x)) + (self.b(x) if use_b else 0.0)


class Gated(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.gates = nn.ModuleList(Gate(d) for _ in range(2))
        self.head = nn.Linear(d, 1)

    def forward(self, x, use_b: bool, skip_last: bool = False):
        for g in self.gates[:1] if skip_last else self.gates:
            x = g(x, use_b)
        return self.head(x).sum()


def _gated_pair(mesh):
    import copy

    torch.manual_seed(0)
    ref = Gated()
    ours = copy.deepcopy(ref)
    return models.shard_both(ref, ours, mesh, lambda model: model.gates)


def _unused_params(rank, ws, seed) -> None:
    mesh = _mesh(ws)
    g = torch.Generator().manual_seed(seed + rank)
    for flag, use_b in ((True, rank == 0), (True, False), (False, False)):
        what = f"seed {seed}: reduce_scatter_unused_params={flag}, b used on rank {rank}: {use_b}"
        ref, ours = _gated_pair(mesh)
        for model in (ref, ours):
            model.set_reduce_scatter_unused_params(flag)
        for step in range(2):
            x = torch.randn(4, 8, generator=g)
            for model in (ref, ours):
                model(x, use_b).backward()
        _check_grads(ref, ours, EXACT, what)
        got_b = ours.gates[0].b.weight.grad
        assert (got_b is not None) == flag, what
    # A whole unit skipped on every rank: FSDP2 reduces zeros for it once it has been gathered.
    for flag in (True, False):
        ref, ours = _gated_pair(mesh)
        for model in (ref, ours):
            model.set_reduce_scatter_unused_params(flag)
        for step, skip in enumerate((True, False, True)):
            x = torch.randn(4, 8, generator=g)
            for model in (ref, ours):
                model.zero_grad()
                model(x, True, skip_last=skip).backward()
            _check_grads(ref, ours, EXACT, f"seed {seed}: flag {flag}, last gate skipped: {skip}, step {step}")
        assert (ours.gates[1].a.weight.grad is not None) == flag
    # Without the flag, ranks that used different parameters are reported, not stepped apart.
    import fusedist

    _, ours = _gated_pair(mesh)
    ours(torch.randn(4, 8, generator=g), rank == 0).backward()
    with pytest.raises(fusedist.RankMismatchError, match="different set of parameters"):
        ours(torch.randn(4, 8, generator=g), True)


def _count_in_flight(model):
    """Record, at each reduce-scatter issued under ``model``, how many are in flight with it;
    returns the counts and a function that removes the recording."""
    from fusedist.fsdp.state import state_of

    st = state_of(model)
    comm, ctx, counts = st.unit.comm, st.ctx, []
    issue = comm.reduce_scatter

    def counted(*args, **kwargs):
        counts.append(len(ctx.pending) + 1)
        return issue(*args, **kwargs)

    comm.reduce_scatter = counted
    return counts, lambda: vars(comm).pop("reduce_scatter")


def _max_input_buffers(rank, ws, seed) -> None:
    mesh = _mesh(ws)
    for cap in (None, 1, 3):
        what = f"seed {seed}: max_input_buffers={cap}"
        ref, ours = _pair(mesh, wrap_embed=True)
        for model in (ref, ours):
            if cap is not None:  # before the first forward: FSDP2's root reads the caps then
                model.set_reduce_scatter_max_input_buffers(cap)
        pairs = _optimizers(ref, ours)
        _train_step(pairs, _ids(seed, rank, 0))
        counts, remove = _count_in_flight(ours)
        try:
            for step in (1, 2):
                _train_step(pairs, _ids(seed, rank, step))
        finally:
            remove()
        assert counts and max(counts) <= (cap or 2), f"{what}: in flight {counts}"
        if cap == 1:
            assert max(counts) == 1, f"{what}: in flight {counts}"
        _check_params(ref, ours, what)
    ref, ours = _pair(mesh)
    for bad in (True, 2.0, "2", 0, -1):
        errors = []
        for model in (ref, ours):
            try:
                model.set_reduce_scatter_max_input_buffers(bad)
            except (TypeError, ValueError) as e:
                errors.append((type(e), str(e)))
        assert len(errors) == 2 and errors[0] == errors[1], f"{bad!r}: {errors}"


def _reduction_controls(rank, ws, seed):
    _max_input_buffers(rank, ws, seed)
    _unused_params(rank, ws, seed)  # last: it ends with a rank mismatch
    return True


def test_unused_params_and_buffer_cap_match_fsdp2(launched, seeds):
    """set_reduce_scatter_unused_params(True) gives every trainable parameter FSDP2's
    gradient where ranks use different branches, and zeros where none uses one or a whole
    unit is skipped (once it has run: FSDP2's condition); without it an unused parameter
    keeps grad None as in FSDP2, and ranks that differ are reported.
    set_reduce_scatter_max_input_buffers bounds the reduce-scatters in flight (1: one at a
    time), trains as FSDP2 with the same cap, and refuses what FSDP2 refuses."""
    seed = seeds["reduction controls"]
    assert results_of(launched, "reduction controls") == [True, True], f"seed {seed}"


# ------------------------------------------------------------------- reset_iter_state
class _Boom(torch.autograd.Function):
    """Identity whose backward raises: an exception in the middle of a backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom in backward")


def _arm(model, armed: dict) -> None:
    """Failures on demand, raising "boom in ...": ``armed['forward']`` in blocks[1]'s forward
    (after its unit is gathered); ``armed['backward']`` in backward between blocks[1] and
    blocks[0] (the root's and blocks[1]'s reductions issued); ``armed['backward ']`` between
    the root's head and norm (the head's unsharded gradient in, the root not reduced)."""
    def pre(module, args):
        if armed.get("forward"):
            raise RuntimeError("boom in forward")

    def post(key):
        return lambda module, args, out: _Boom.apply(out) if armed.get(key) else out

    model.blocks[1].register_forward_pre_hook(pre)
    model.blocks[0].register_forward_hook(post("backward"))
    model.norm.register_forward_hook(post("backward "))


def _fail_and_reset(models_opts, armed, where: str, batch) -> None:
    armed[where] = True
    for model, opt in models_opts:
        with pytest.raises(RuntimeError, match=f"boom in {where.strip()}"):
            _loss(model, *batch).backward()
        model.reset_iter_state()
        opt.zero_grad()
    armed[where] = False


def _check_clean(model, what: str) -> None:
    from fusedist.fsdp.state import state_of

    for m in _units(model):
        assert not _gathering(m), f"{what}: {type(m).__name__} still gathered"
        assert all(u.grad is None for u in state_of(m).unit.unsharded), f"{what}: unsharded gradients kept"
    stats = model.memory_stats()
    assert stats["gathered_bytes"] == 0 and stats["scratch_bytes"] == 0, f"{what}: {stats}"


def _reset_iter_state(rank, ws, seed):
    ref, ours = _pair(_mesh(ws), wrap_embed=True)
    armed: dict = {}
    for model in (ref, ours):
        _arm(model, armed)
    ref_opt, our_opt = _optimizers(ref, ours)
    both = [ref_opt, our_opt]
    _train_step(both, _ids(seed, rank, 0))
    _fail_and_reset(both, armed, "forward", _ids(seed, rank, 1))
    _check_clean(ours, f"seed {seed}: after a failed forward")
    _train_step(both, _ids(seed, rank, 2))
    # FSDP2's reference for the backward failures is the run without those iterations (see
    # the test's docstring); fusedist fails and resets.
    _fail_and_reset([our_opt], armed, "backward", _ids(seed, rank, 3))
    _check_clean(ours, f"seed {seed}: after a failed backward")
    # A micro-batch sequence broken in its second backward, inside the root's unit: its
    # accumulated gradients and the head's unsharded one go too.
    ours.set_requires_gradient_sync(False)
    _loss(ours, *_ids(seed, rank, 4)).backward()
    _fail_and_reset([our_opt], armed, "backward ", _ids(seed, rank, 5))
    _check_clean(ours, f"seed {seed}: after a failed micro-batch")
    ours.set_requires_gradient_sync(True)
    for step in (6, 7):
        _train_step(both, _ids(seed, rank, step))
    _check_params(ref, ours, f"seed {seed}: training after resets")
    for model in (ref, ours):
        with pytest.raises(RuntimeError, match="reset_iter_state must be called on the root"):
            model.blocks[0].reset_iter_state()
    return True


def test_reset_iter_state_matches_fsdp2(launched, seeds):
    """After an exception in forward (a unit gathered, the root kept gathered), in backward
    (reductions issued or waiting) and in a micro-batch sequence (no-sync accumulators),
    reset_iter_state on the root and zero_grad, training goes on as if the failed iterations
    had not run; nothing stays gathered or allocated; a non-root refuses, as FSDP2's.

    The reference: FSDP2 with the same forward failure and reset, and without the failed
    backward iterations -- FSDP2's documented result ("the failed iteration's gradients are
    lost"). torch 2.13's own reset does not reach it there: it keeps the unsharded gradients
    of units whose post-backward had not run (the root's, whose inputs need no gradient; a
    no-sync accumulation) and adds them into the next reduction."""
    seed = seeds["reset iter state"]
    assert results_of(launched, "reset iter state") == [True, True], f"seed {seed}"


# --------------------------------------- post-optimizer event, async unshard, settings
def _event_and_async_unshard(rank, ws, seed) -> None:
    from fusedist.fsdp.state import state_of

    ref, ours = _pair(_mesh(ws))
    for model in (ref, ours):
        model.set_post_optim_event(torch.Event())  # before the first forward: the root keeps it
        model._set_unshard_async_op(True)
    assert all(state_of(m).unshard_async_op for m in _units(ours))
    pairs = _optimizers(ref, ours)
    for step in range(3):
        _train_step(pairs, _ids(seed, rank, step))
        assert ours._fs_state().ctx.post_optim_event is None, "the event is waited for once"
        assert ref._get_fsdp_state()._state_ctx.post_optim_event is None
        for model in (ref, ours):
            model.blocks[1].set_post_optim_event(torch.Event())  # any module, after the first forward
    _check_params(ref, ours, f"seed {seed}: post-optim event, async unshard")


def _comm_settings(rank, ws, seed) -> None:
    """The performance-only settings are recorded and change nothing (FSDP2 on gloo takes the
    first two; its symmetric memory needs NCCL); custom collectives are refused by name."""
    from fusedist.fsdp.state import state_of

    ref, ours = _pair(_mesh(ws))
    ref.set_separate_reduce_scatter_group()
    ref.set_allocate_memory_from_process_group_for_comm(True)
    ours.set_separate_reduce_scatter_group()
    ours.set_allocate_memory_from_process_group_for_comm(True)
    ours.set_symm_mem_for_comm()
    assert state_of(ours).comm_hints == {"separate_reduce_scatter_group": True,
                                         "allocate_memory_from_process_group": True, "symm_mem": "NCCL"}
    assert state_of(ours.blocks[0]).comm_hints == {"separate_reduce_scatter_group": True}
    with pytest.raises(ValueError, match="only the 'NCCL' backend"):
        ours.set_symm_mem_for_comm("GLOO")
    for name, alternative in (("set_custom_all_gather", "param_dtype"),
                              ("set_custom_reduce_scatter", "set_all_reduce_hook")):
        with pytest.raises(NotImplementedError, match=f"{name}(.|\n)*{alternative}"):
            getattr(ours, name)(object())
    pairs = _optimizers(ref, ours)
    for step in range(2):
        _train_step(pairs, _ids(seed, rank, step))
    _check_params(ref, ours, f"seed {seed}: communication settings")


def _schedule_settings(rank, ws, seed):
    _event_and_async_unshard(rank, ws, seed)
    _comm_settings(rank, ws, seed)
    return True


def test_post_optim_event_async_unshard_and_comm_settings(launched, seeds):
    """set_post_optim_event (before and after the first forward, on the root or a submodule)
    is consumed by the next forward as in FSDP2, and _set_unshard_async_op(True) reaches every
    unit, with FSDP2's training results; set_separate_reduce_scatter_group,
    set_allocate_memory_from_process_group_for_comm and set_symm_mem_for_comm are recorded
    and change no result; set_custom_all_gather / set_custom_reduce_scatter raise
    NotImplementedError naming the method and what to use instead."""
    seed = seeds["schedule settings"]
    assert results_of(launched, "schedule settings") == [True, True], f"seed {seed}"


# ------------------------------------------------------------------------ signatures
NEW_METHODS = ("set_all_reduce_hook", "set_post_optim_event", "reset_iter_state", "set_reduce_scatter_unused_params",
               "set_reduce_scatter_max_input_buffers", "set_separate_reduce_scatter_group",
               "set_allocate_memory_from_process_group_for_comm", "set_symm_mem_for_comm", "set_custom_all_gather",
               "set_custom_reduce_scatter", "_set_unshard_async_op")


def test_signatures_match_fsdp2():
    """Every method of torch's FSDPModule exists on fusedist's (so no AttributeError after the
    swap), and these take FSDP2's arguments: names, kinds, defaults."""
    import inspect

    import fusedist
    from torch.distributed.fsdp import FSDPModule

    def shape(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    ours = fusedist.fsdp.FullyShardedModule
    torch_only = {"_get_fsdp_state", "_orig_cls_mro_index"}  # FSDP2's internals
    missing = {n for n in dir(FSDPModule) if not n.startswith("__") and not hasattr(ours, n)}
    assert missing <= torch_only, sorted(missing - torch_only)
    for name in NEW_METHODS:
        assert shape(getattr(ours, name)) == shape(getattr(FSDPModule, name)), name


# ------------------------------------------------------------------ one launch of the ranks
SCENARIOS = {  # {scenario: (test, fn)}
    "all-reduce hook": ("test_all_reduce_hook_matches_fsdp2", _all_reduce_hook),
    "reduction controls": ("test_unused_params_and_buffer_cap_match_fsdp2", _reduction_controls),
    "reset iter state": ("test_reset_iter_state_matches_fsdp2", _reset_iter_state),
    "schedule settings": ("test_post_optim_event_async_unshard_and_comm_settings", _schedule_settings),
}


@pytest.fixture(scope="module")
def seeds() -> dict:
    """A fresh seed per scenario (each failure message shows its own)."""
    return {name: _seed() for name in SCENARIOS}


@pytest.fixture(scope="module")
def launched(request, seeds):
    return launch_phase(request, {test: {name: (fn, (seeds[name],))} for name, (test, fn) in SCENARIOS.items()},
                        2, timeout=400)
