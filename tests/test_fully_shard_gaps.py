"""Corners of ``fully_shard`` against torch's FSDP2, same model, same data, 2 gloo ranks:
conversions under ``swap_module_params_on_conversion``, a unit whose output reaches the loss
on some ranks only, the step after a backward that raised, and ``share_comm_ctx``.

Inputs are fresh random draws: each test picks a new seed (shown in every failure message).
Tolerances: fp32 throughout, and both implementations run the same ops on the same values
and reduce with one sum of two terms (commutative, one rounding) and one division by the
world size, so gradients and parameters are compared bit for bit (as in
test_fully_shard_api_parity.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from phased_launches import launch_phase
from shared_rank_launch import results_of, under_env
from test_fully_shard_api_parity import EXACT, _check_grads, _check_params, _ids, _loss, _mesh, _pair, _seed
from test_fully_shard_module_methods import _Boom


def _both(fn, ref, ours):
    for model in (ref, ours):
        fn(model)


def _step(ref, ours, opts, batch, what: str) -> None:
    """One training step of both models on ``batch``, gradients then parameters compared."""
    for model in (ref, ours):
        _loss(model, *batch).backward()
    _check_grads(ref, ours, EXACT, what)
    for opt in opts:
        opt.step()
        opt.zero_grad()
    _check_params(ref, ours, f"{what}, after the step")


def _adamw(*models) -> list:
    return [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]


# ------------------------------------------------------ conversions under the swap flag
def _full_state(model) -> dict:
    import fusedist

    if isinstance(model, fusedist.FSDPModule):
        return fusedist.fsdp.full_state_dict(model)
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def _load_full(model, state: dict) -> None:
    import fusedist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if isinstance(model, fusedist.FSDPModule):
        fusedist.fsdp.load_full_state_dict(model, state)
    else:
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def _swap_flag(rank, ws, seed):
    mesh = _mesh(ws)
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        ref, ours = _pair(mesh)
        state = _full_state(ours)
        _both(lambda m: m.to("cpu"), ref, ours)
        _both(lambda m: m.to(device="cpu", dtype=torch.float32), ref, ours)
        opts = _adamw(ref, ours)
        _step(ref, ours, opts, _ids(seed, rank, 0), f"seed {seed}: after to()")
        # to_empty drops the values: both reload the same full state dict
        _both(lambda m: m.to_empty(device="cpu"), ref, ours)
        _both(lambda m: _load_full(m, {k: v.clone() for k, v in state.items()}), ref, ours)
        opts = _adamw(ref, ours)
        _step(ref, ours, opts, _ids(seed, rank, 1), f"seed {seed}: after to_empty() and a reload")
        assert torch.__future__.get_swap_module_params_on_conversion(), "the user's flag was not restored"
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    return True


def test_conversions_under_swap_module_params_on_conversion_match_fsdp2(launched, seeds):
    """With set_swap_module_params_on_conversion(True), to() and to_empty() (then a reload)
    leave a model that trains as FSDP2's does under the flag; the flag is left as it was."""
    seed = seeds["swap flag"]
    assert results_of(launched, "swap flag") == [True, True], f"seed {seed}"


def _converted(rank, ws, seed):
    mesh = _mesh(ws)
    ref, ours = _pair(mesh)
    _both(lambda m: m.double(), ref, ours)
    opts = _adamw(ref, ours)
    for step in range(2):
        _step(ref, ours, opts, _ids(seed, rank, step), f"seed {seed}: step {step} after double()")
    return True


def test_a_dtype_conversion_after_sharding_reduces_in_the_new_dtype(launched, seeds):
    """model.double() after fully_shard: the gradients are reduce-scattered in fp64, as by
    FSDP2 (they were reduced in the dtype the model was sharded in, fp32: off in the 8th digit)."""
    seed = seeds["converted"]
    assert results_of(launched, "converted") == [True, True], f"seed {seed}"


def _dtensor_entries(rank, ws, seed):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    mesh = _mesh(ws)
    ref, ours = _pair(mesh)
    opts = _adamw(ref, ours)
    _step(ref, ours, opts, _ids(seed, rank, 0), f"seed {seed}: the first step")
    # FSDP2's state dicts hold DTensors; so does a full one once torch's loader has used it
    model_sd, optim_sd = ref.state_dict(), get_optimizer_state_dict(ref, opts[0])
    full = get_model_state_dict(ref, options=StateDictOptions(full_state_dict=True))
    set_model_state_dict(_pair(mesh)[0], full, options=StateDictOptions(full_state_dict=True))
    assert all(type(v).__name__ == "DTensor" for v in [*model_sd.values(), *full.values()])
    for sd in (model_sd, full):
        ref2, ours2 = _pair(mesh)
        for model in (ref2, ours2):
            model.load_state_dict(dict(sd))
        opts2 = _adamw(ref2, ours2)
        for model, opt in zip((ref2, ours2), opts2):  # (copies: a load may keep the tensors it is given)
            set_optimizer_state_dict(model, opt, {**optim_sd, "state": {
                k: {n: v.clone() for n, v in st.items()} for k, st in optim_sd["state"].items()}})
        _step(ref2, ours2, opts2, _ids(seed, rank, 1), f"seed {seed}: after loading DTensor entries")
    _step(ref, ours, opts, _ids(seed, rank, 1), f"seed {seed}: the second step")
    _check_params(ref, ours2, f"seed {seed}: loaded against uninterrupted")
    return True


def test_state_dicts_of_dtensors_load(launched, seeds):
    """FSDP2's model state dict and its optimizer's (through torch's helpers; DTensor values),
    and a full state dict torch's loader turned into DTensors, load into fusedist's model and
    optimizer on every rank alike (Note [DTensor entries loaded]); the model's used to abort
    one rank and hang the other."""
    seed = seeds["dtensor entries"]
    assert results_of(launched, "dtensor entries") == [True, True], f"seed {seed}"


# ------------------------------------------ a unit's output in the loss on some ranks only
class Branchy(nn.Module):
    """Three blocks of different widths (a reduce-scatter paired with another unit's would fail
    loudly, not mix values); the middle one runs on every rank, its output is added to the
    loss only where ``use`` is true."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 5), nn.Linear(5, 7), nn.Linear(5, 3)

    def forward(self, x, use: bool, zero_branch: bool = False):
        h = torch.tanh(self.a(x))
        y = self.b(h)
        out = self.c(h).square().mean()
        if use:
            return out + y.square().mean()
        return out + 0 * y.square().mean() if zero_branch else out


def _branchy_pair(mesh, reduce_unused: bool, reshard_after_forward: bool = True):
    """Branchy sharded per block and at the root by FSDP2 (ref) and fusedist (ours)."""
    import copy

    import fusedist
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    ref = Branchy()
    ours = copy.deepcopy(ref)
    for shard, model in ((torch_fully_shard, ref), (fusedist.fully_shard, ours)):
        for block in (model.a, model.b, model.c):
            shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
        shard(model, mesh=mesh)
        model.set_reduce_scatter_unused_params(reduce_unused)
    return ref, ours


def _branch_uses(seed, step, ws) -> list:
    """Which ranks add the branch at ``step``: the same draw on every rank, never all of them
    (FSDP2 would need nothing special then)."""
    g = torch.Generator().manual_seed(seed * 31 + step)
    uses = (torch.rand(ws, generator=g) < 0.5).tolist()
    if all(uses):
        uses[step % ws] = False
    return uses


def _partial_branch(rank, ws, seed, steps=3):
    import fusedist

    mesh = _mesh(ws)
    for reshard in (True, False):  # the unit regathered in backward (prefetched), or kept
        ref, ours = _branchy_pair(mesh, reduce_unused=True, reshard_after_forward=reshard)
        opts = _adamw(ref, ours)
        for step in range(steps):
            use = _branch_uses(seed, step, ws)[rank]
            g = torch.Generator().manual_seed(seed * 7 + rank * 101 + step)
            x = torch.randn(4, 6, generator=g)
            ref(x, use, zero_branch=True).backward()  # FSDP2 only with the branch in every rank's loss
            ours(x, use).backward()
            what = (f"seed {seed}, reshard_after_forward={reshard}, step {step}, rank {rank} "
                    f"{'adds' if use else 'skips'} the branch")
            _check_grads(ref, ours, EXACT, what)
            for opt in opts:
                opt.step()
                opt.zero_grad()
            _check_params(ref, ours, what)
    # Without set_reduce_scatter_unused_params FSDP2 hangs (one rank reduce-scatters the unit,
    # the other does not); fusedist reduces it on every rank and reports the differing
    # gradient sets at the next forward, naming FSDP2's remedy.
    _, plain = _branchy_pair(mesh, reduce_unused=False)
    x = torch.randn(4, 6)
    plain(x, rank == 0).backward()
    with pytest.raises(fusedist.RankMismatchError, match="set_reduce_scatter_unused_params"):
        plain(x, True)
    return True


def test_unit_output_in_loss_on_some_ranks_matches_fsdp2(launched, seeds):
    """A unit that runs on every rank but reaches the loss on some only (a data-dependent
    branch), under set_reduce_scatter_unused_params(True), resharded after forward or not: the
    gradients and parameters, over three steps, of FSDP2 on the same data with ``0 * branch`` added where it is skipped.
    FSDP2 itself cannot run the branch as is: its root's final callback reduces the unit
    after the others on the ranks that skipped it, so its reduce-scatters pair with other
    units' (a crash or hang with these distinct sizes, mixed gradients with equal ones);
    fusedist reduces in one order on every rank. Without the setting (FSDP2 hangs) fusedist
    raises a RankMismatchError naming it."""
    seed = seeds["partial branch"]
    assert results_of(launched, "partial branch") == [True, True], f"seed {seed}"


# ------------------------------------------------------ the step after an aborted backward
class Interrupt(BaseException):
    """A KeyboardInterrupt-like error: not an Exception."""


def _aborting_loss(model, batch, how: str):
    """The loss of ``model`` on ``batch`` whose backward raises midway -- after the last block's
    reduce-scatter was issued, before the first block's and the root's -- from a hook on the
    first block's output, or inside an autograd function there."""
    blocks = model.blocks[0]
    if how == "hook":
        def interrupt(_module, _args, out):
            out.register_hook(lambda g: (_ for _ in ()).throw(Interrupt()))
        handle = blocks.register_forward_hook(interrupt)
    else:
        handle = blocks.register_forward_hook(lambda _m, _a, out: _Boom.apply(out))
    try:
        return _loss(model, *batch)
    finally:
        handle.remove()


def _drop_unsharded_grads(model) -> None:
    """Drop the aborted backward's unsharded gradients FSDP2's ``reset_iter_state`` keeps (those
    of units whose post-backward had not run, here the root's) and would add into the next
    reduction; its documented contract, and fusedist, drop them."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    if hasattr(fp, "_unsharded_param"):
                        fp._unsharded_param.grad = None
                    fp.unsharded_accumulated_grad = None


def _in_backward(model) -> bool:
    from fusedist.fsdp.state import state_of

    return state_of(model).ctx.watch.position()["in_backward"]


def _aborted_backward(rank, ws, seed):
    mesh = _mesh(ws)
    for case, (how, reset) in enumerate((("hook", True), ("function", True), ("hook", False), ("function", False))):
        what = f"seed {seed}: backward aborted by a {how}, reset_iter_state {'called' if reset else 'not called'}"
        ref, ours = _pair(mesh)
        opts = _adamw(ref, ours)
        _step(ref, ours, opts, _ids(seed, rank, 10 * case), what + ", first step")
        for model in (ref, ours):
            with pytest.raises((Interrupt, RuntimeError)):
                _aborting_loss(model, _ids(seed, rank, 10 * case + 1), how).backward()
        ref.reset_iter_state()  # FSDP2's contract after an exception
        _drop_unsharded_grads(ref)
        if reset:
            ours.reset_iter_state()
            assert not _in_backward(ours), f"{what}: the step watch still says it is in backward"
        for opt in opts:
            opt.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step(ref, ours, opts, _ids(seed, rank, 10 * case + 2), what + ", the step after")
        warned = any("did not finish" in str(w.message) for w in caught)
        assert warned != reset, f"{what}: warned {warned}"
        position = ours._fs_state().ctx.watch.position()
        assert position["fully_shard_backward"] == 2 and position["fully_shard_step"] == 2, f"{what}: {position}"
        assert not position["in_backward"], f"{what}: {position}"
        ours.check_consistency()
    return True


def test_step_after_aborted_backward_matches_fsdp2(launched, seeds):
    """A backward that raised midway (a BaseException from a hook, an error inside an autograd
    function's backward): with or without reset_iter_state, the next step gives the gradients
    and parameters of FSDP2 after reset_iter_state, and the step watch reports two completed
    backwards and not being in one."""
    seed = seeds["aborted backward"]
    assert results_of(launched, "aborted backward") == [True, True], f"seed {seed}"


# ------------------------------------------------------------------------- share_comm_ctx
def _torch_error(fn, arg):
    with pytest.raises(ValueError) as info:
        fn(arg)
    return str(info.value)


def _share_comm_ctx(rank, ws, seed):
    import fusedist
    import torch.distributed.fsdp as torch_fsdp

    mesh = _mesh(ws)
    ref, ours = _pair(mesh)
    assert fusedist.share_comm_ctx is fusedist.fsdp.share_comm_ctx
    for fn in (torch_fsdp.share_comm_ctx, fusedist.share_comm_ctx):
        fn([])  # nothing to share: a no-op
    plain = nn.Linear(2, 2)
    for bad in ([plain], [ours, plain]):
        expected = _torch_error(torch_fsdp.share_comm_ctx, [m if m is not ours else ref for m in bad])
        assert _torch_error(fusedist.share_comm_ctx, bad) == expected, f"seed {seed}"
    with pytest.raises(ValueError, match="torch's fully_shard"):
        fusedist.share_comm_ctx([ours, ref])
    fusedist.share_comm_ctx([ref.blocks[0], ref])  # torch's modules: torch's function
    torch_fsdp.share_comm_ctx([ref.blocks[1], ref])
    fusedist.share_comm_ctx([ours.blocks[0], ours.blocks[1], ours])
    opts = _adamw(ref, ours)
    for step in range(2):
        _step(ref, ours, opts, _ids(seed, rank, step), f"seed {seed}, step {step}")
    return True


def test_share_comm_ctx_matches_fsdp2(launched, seeds):
    """fusedist.share_comm_ctx validates as torch's (same errors), hands torch's modules to
    torch's, refuses a mix, and the models train as FSDP2's after it."""
    seed = seeds["share comm ctx"]
    assert results_of(launched, "share comm ctx") == [True, True], f"seed {seed}"


# ------------------------------------------------------- full state dict of a compiled model
def _compiled_keys(rank, ws, seed):
    import fusedist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    mesh = _mesh(ws)
    ref, ours = _pair(mesh)
    opts = _adamw(ref, ours)
    _step(ref, ours, opts, _ids(seed, rank, 0), f"seed {seed}")  # values other than the seed-0 init
    for model in (ref, ours):
        model.blocks[0] = torch.compile(model.blocks[0])  # a compiled submodule in place of the block
    ref_c, ours_c = torch.compile(ref), torch.compile(ours)  # wrapped, not run: no compilation
    expected = get_model_state_dict(ref_c, options=StateDictOptions(full_state_dict=True))
    got = fusedist.fsdp.full_state_dict(ours_c)
    assert list(got) == list(expected), f"seed {seed}: keys {list(got)}, FSDP2 {list(expected)}"
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, **EXACT, msg=lambda m: f"seed {seed}: {k}: {m}")
    prefixed = {k: v for k, v in zip(ours_c.state_dict(), got.values())}  # an earlier version's keys
    for state in (expected, prefixed):
        fusedist.fsdp.load_full_state_dict(ours_c, {k: torch.zeros_like(v) for k, v in state.items()})
        assert all(p.eq(0).all() for p in ours.parameters()), f"seed {seed}: not every piece loaded"
        fusedist.fsdp.load_full_state_dict(ours_c, state)
        for k, v in fusedist.fsdp.full_state_dict(ours_c).items():
            torch.testing.assert_close(v, expected[k], **EXACT, msg=lambda m: f"seed {seed}: reloaded {k}: {m}")
    return True


def test_full_state_dict_of_compiled_model_has_fsdp2_keys(launched, seeds):
    """full_state_dict of a torch.compile'd model (and of one with a compiled block inside)
    has the keys and values of FSDP2's full get_model_state_dict -- canonical names, without
    ``_orig_mod.`` -- and load_full_state_dict takes those keys, or the prefixed ones."""
    seed = seeds["compiled keys"]
    assert results_of(launched, "compiled keys") == [True, True], f"seed {seed}"


# ------------------------------------------------------- one launch of the ranks
@pytest.fixture(scope="module")
def seeds() -> dict:
    """A fresh seed per scenario (each failure message shows its own)."""
    return {name: _seed() for name in SCENARIOS}


SCENARIOS = {  # {scenario: (test, fn)}
    "swap flag": ("test_conversions_under_swap_module_params_on_conversion_match_fsdp2", _swap_flag),
    "converted": ("test_a_dtype_conversion_after_sharding_reduces_in_the_new_dtype", _converted),
    "dtensor entries": ("test_state_dicts_of_dtensors_load", _dtensor_entries),
    "partial branch": ("test_unit_output_in_loss_on_some_ranks_matches_fsdp2", _partial_branch),
    "aborted backward": ("test_step_after_aborted_backward_matches_fsdp2", _aborted_backward),
    "share comm ctx": ("test_share_comm_ctx_matches_fsdp2", _share_comm_ctx),
    "compiled keys": ("test_full_state_dict_of_compiled_model_has_fsdp2_keys", _compiled_keys),
}


@pytest.fixture(scope="module")
def launched(request, seeds):
    """The selected tests' scenarios in one launch (pg_timeout: a rank that waits for a
    reduce-scatter its peer never posts fails within it)."""
    by_test = {test: {name: (fn, (seeds[name],))} for name, (test, fn) in SCENARIOS.items()}
    by_test["test_state_dicts_of_dtensors_load"] = {
        "dtensor entries": (under_env, ({"FUSEDIST_TIMEOUT_S": "30"}, _dtensor_entries, seeds["dtensor entries"]))}
    return launch_phase(request, by_test, 2, timeout=300, pg_timeout=20)
