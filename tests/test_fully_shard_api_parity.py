"""The FSDP2 methods beyond the core of ``fully_shard`` -- gradient divide factor, forced-sum
reductions, the all-reduce and last-backward switches, ``set_unshard_in_backward`` and
``register_fsdp_forward_method`` -- against torch's FSDP2, same model, same data, 2 gloo ranks.

Inputs are fresh random draws: each test picks a new seed (shown in every failure message).

Tolerances. In fp32 both implementations run the same forward and backward ops on the same
values and reduce the same way: the two ranks' gradients are summed once (a + b, one
rounding, commutative) and divided once by the same factor (torch's forced-sum path and
fusedist both divide the sum, in fp32). So fp32 results are compared bit for bit. With an
fp16 ``reduce_dtype`` the pre-division (by a power of two), the fp16 sum and the cast are the
same too, but FSDP2 divides by the remaining factor in fp16 and fusedist in the fp32 shard
(Note [fp16 reduction] in fsdp/grads.py): one fp16 rounding apart, at most 2^-11 relative, so
``rtol=2^-10`` (``atol`` 2^-24 for fp16 subnormals), checked after one backward (accumulated
over two, the terms' roundings may meet in a sum that cancels). bf16 likewise: one bf16
rounding, but bf16 keeps 8 significant bits, so that is up to 2^-8 relative (a value just above
a power of two, rounded by half its ulp), and ``rtol=2^-7`` (no subnormals in reach): 2^-8
itself left no room for the fp32 rounding of fusedist's division on top (a ratio up to
1 + 2^-16 of it), and random gradients reached 0.66 of it in 60 draws. A wrong factor (2
for 3) is 50% off, 64 times that. Where the factor leaves nothing to divide after the sum
(1.0, and fp16 at world size 2 by default), fp16 is bit for bit too.

FSDP2 on gloo cannot run its default reduction for a factor other than the world size (a
PreMulSum, which gloo lacks), so its reference there runs with
``set_force_sum_reduction_for_comms(True)``: sum, then divide -- fusedist's reduction for
such a factor either way.
"""

from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import models
from fusedist.testing import run_distributed

EXACT = dict(rtol=0.0, atol=0.0)
FP16 = dict(rtol=2.0 ** -10, atol=2.0 ** -24)
BF16 = dict(rtol=2.0 ** -7, atol=0.0)  # one bf16 rounding (2^-8), twice: module docstring


class LM(nn.Module):
    """Embedding, blocks, norm and head, with a greedy ``generate`` that reads the head's
    weights directly instead of calling ``forward`` (as generation code does)."""

    def __init__(self, vocab: int = 23, d: int = 16, n: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(models.ResidualBlock(d, width=2) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def hidden(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.norm(x)

    def forward(self, ids):
        return self.head(self.hidden(ids).flatten(0, 1))  # 2-D: FSDP2 warns of a view output

    def generate(self, ids, steps: int):
        for _ in range(steps):
            logits = F.linear(self.hidden(ids)[:, -1], self.head.weight, self.head.bias)
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        return ids, logits


def _seed() -> int:
    return random.SystemRandom().randrange(2 ** 31)


def _ids(seed: int, rank: int, step: int, vocab: int = 23):
    g = torch.Generator().manual_seed(seed * 7919 + rank * 101 + step)
    return torch.randint(0, vocab, (3, 6), generator=g), torch.randint(0, vocab, (3, 6), generator=g)


def _loss(model, ids, target, scale: float = 1.0):
    return F.cross_entropy(model(ids), target.flatten()) * scale


def _pair(mesh, wrap_embed: bool = False, ref_kw: dict | None = None, our_kw: dict | None = None):
    """The same fresh LM sharded by torch's FSDP2 (ref) and by fusedist (ours), blocks first."""
    import fusedist
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    ref = LM()
    ours = copy.deepcopy(ref)
    for shard, model, kw in ((torch_fully_shard, ref, ref_kw), (fusedist.fully_shard, ours, our_kw)):
        kw = kw or {}
        if wrap_embed:
            shard(model.embed, mesh=mesh, **kw)
        for b in model.blocks:
            shard(b, mesh=mesh, **kw)
        shard(model, mesh=mesh, **kw)
    return ref, ours


def _mesh(ws):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (ws,))


def _units(model) -> list:
    """The model's fully_shard modules (torch's or fusedist's), in a fixed order."""
    return [m for m in model.modules() if hasattr(m, "set_reshard_after_backward")]


def _check_grads(ref, ours, tol: dict, what: str) -> None:
    """This rank's gradient pieces equal the same elements of FSDP2's whole gradients."""
    from fusedist.fsdp.owners import owner_of

    whole = {n: p.grad.full_tensor() if p.grad is not None else None for n, p in ref.named_parameters()}
    for name, p in ours.named_parameters():
        assert (p.grad is None) == (whole[name] is None), f"{what}: {name}: gradient presence differs"
        if p.grad is None:
            continue
        unit, i = owner_of(p)
        a, b = unit.element_range(i)
        expected = whole[name].reshape(-1)[a:b].view(p.shape)
        torch.testing.assert_close(p.grad, expected, **tol, msg=lambda m: f"{what}: {name}: {m}")


def _check_params(ref, ours, what: str) -> None:
    import fusedist

    got = fusedist.fsdp.full_state_dict(ours)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v.full_tensor(), **EXACT, msg=lambda m: f"{what}: {k}: {m}")


def _train_step(models_opts, batch) -> None:
    for model, opt in models_opts:
        _loss(model, *batch).backward()
        opt.step()
        opt.zero_grad()


def _optimizers(*models):
    return [(m, torch.optim.AdamW(m.parameters(), lr=1e-2)) for m in models]


def _gathering(module) -> bool:
    from fusedist.fsdp.state import state_of

    unit = state_of(module).unit
    return unit.is_unsharded or unit.gather_in_flight


# ------------------------------------------------------------------------------ divide factor
def _deprecation_warnings(module, factor) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module.set_reduce_scatter_divide_factor(factor)
    return [(w.category, str(w.message)) for w in caught]


def _check_argument_validation(model) -> None:
    for bad in ("1", 0, None):
        for setter in (model.set_is_last_backward, model.set_unshard_in_backward,
                       model.set_requires_all_reduce, model.set_force_sum_reduction_for_comms):
            with pytest.raises(TypeError, match="must be a bool"):
                setter(bad)
    for bad, err in (("2", TypeError), (True, TypeError), (0.0, ValueError), (-2.0, ValueError),
                     (float("inf"), ValueError), (float("nan"), ValueError)):
        with pytest.raises(err, match="factor must be"):
            model.set_gradient_divide_factor(bad)


def _divide_factor(rank, ws, seed):
    import fusedist
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    mesh = _mesh(ws)
    cases = [  # reduce_dtype, factor, force_sum (fusedist's), tolerance
        (None, None, False, EXACT), (None, None, True, EXACT), (None, 1.0, False, EXACT),
        (None, 3.0, False, EXACT),
        (torch.float16, None, False, EXACT), (torch.float16, 1.0, False, EXACT),
        (torch.float16, 3.0, False, FP16), (torch.bfloat16, 3.0, False, BF16),
    ]
    for reduce_dtype, factor, force_sum, tol in cases:
        what = f"seed {seed}, reduce_dtype={reduce_dtype}, factor={factor}, force_sum={force_sum}"
        ref, ours = _pair(mesh, ref_kw=dict(mp_policy=TorchMP(reduce_dtype=reduce_dtype)),
                          our_kw=dict(mp_policy=fusedist.MixedPrecisionPolicy(reduce_dtype=reduce_dtype)))
        # FSDP2 on gloo has no PreMulSum: its reference for another factor is the forced sum.
        ref_forced = force_sum or (factor not in (None, ws) and reduce_dtype != torch.float16)
        for model, forced in ((ref, ref_forced), (ours, force_sum)):
            for m in _units(model):
                if factor == 3.0 and reduce_dtype is None:  # FSDP2's deprecated alias, on both
                    assert _deprecation_warnings(m, factor)
                elif factor is not None:
                    m.set_gradient_divide_factor(factor)
                m.set_force_sum_reduction_for_comms(forced)
        # A second backward adds to the first's gradients; only where the result is exact:
        # two terms one rounding apart each may cancel, leaving no relative bound on the sum.
        for step in range(2 if tol is EXACT else 1):
            batch = _ids(seed, rank, step)
            for model in (ref, ours):
                _loss(model, *batch).backward()
            _check_grads(ref, ours, tol, f"{what}, backward {step}")
    assert _deprecation_warnings(ref, 2.0) == _deprecation_warnings(ours, 2.0)
    _check_argument_validation(ours)


# ------------------------------------------------------------------------ forward method
def _forward_method(rank, ws, seed):
    import fusedist

    mesh = _mesh(ws)
    ref, ours = _pair(mesh)
    fusedist.register_fsdp_forward_method(ref, "generate")  # torch's module: handed to torch's
    fusedist.register_fsdp_forward_method(ours, "generate")
    with pytest.raises(ValueError, match="does not have a method"):
        fusedist.register_fsdp_forward_method(ours, "sample")
    plain = LM()
    fusedist.register_fsdp_forward_method(plain, "generate")  # not sharded: a no-op
    assert "generate" not in vars(plain)
    # torch's function is a no-op on a module fusedist sharded (not torch's FSDPModule): the refusal of
    # the root's module called on its own names the function to use instead.
    _, by_torch = _pair(mesh)
    torch.distributed.fsdp.register_fsdp_forward_method(by_torch, "generate")
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"embed' \(Embedding\) was called on its own(.|\n)*"
                                        r"register it with fusedist\.register_fsdp_forward_method"):
        by_torch.generate(_ids(seed, 0, 100)[0][:, :2], 1)

    pairs = _optimizers(ref, ours)
    _train_step(pairs, _ids(seed, rank, 0))
    assert not _gathering(ours), "the root should be resharded after backward"
    prompt = _ids(seed, 0, 100)[0][:, :2]  # the same prompt on both ranks
    with torch.no_grad():
        ref_ids, ref_logits = ref.generate(prompt, 3)
        our_ids, our_logits = ours.generate(prompt, 3)
    assert torch.equal(our_ids, ref_ids), f"seed {seed}: {our_ids} != {ref_ids}"
    torch.testing.assert_close(our_logits, ref_logits, **EXACT, msg=lambda m: f"seed {seed}: logits: {m}")
    # The root under the default reshard_after_forward=None keeps its parameters after a forward,
    # with or without gradients, as FSDP2's does (Note [forward without gradients]).
    theirs = ref._get_fsdp_state()._fsdp_param_group.is_unsharded
    assert _gathering(ours) == theirs, \
        f"after generate under no_grad: root gathered {_gathering(ours)}, FSDP2's {theirs}"
    for step in (1, 2):
        _train_step(pairs, _ids(seed, rank, step))
    _check_params(ref, ours, f"seed {seed}: training after generate")


# ---------------------------------------------------------------------- backward switches
def _count_gathers(module) -> list:
    from fusedist.fsdp.state import state_of

    unit, calls = state_of(module).unit, []
    gather_into = unit.gather_into

    def counted(*args, **kwargs):
        calls.append(1)
        return gather_into(*args, **kwargs)

    unit.gather_into = counted
    return calls


def _unshard_in_backward(rank, ws, seed, steps=3):
    mesh = _mesh(ws)
    gathers = {}
    for value in (True, False):
        ref, ours = _pair(mesh, wrap_embed=True)
        ref.embed.set_unshard_in_backward(value)
        ours.embed.set_unshard_in_backward(value)
        calls = _count_gathers(ours.embed)
        pairs = _optimizers(ref, ours)
        for step in range(steps):
            _train_step(pairs, _ids(seed, rank, step))
        gathers[value] = len(calls)  # before the check, whose full_state_dict gathers too
        _check_params(ref, ours, f"seed {seed}: unshard_in_backward={value}")
    # A unit whose backward reads its weights cannot skip the gather: it fails, not computes.
    _, ours = _pair(mesh)
    ours.blocks[1].set_unshard_in_backward(False)
    with pytest.raises(RuntimeError, match="storage of size 0"):
        _loss(ours, *_ids(seed, rank, 0)).backward()
    return gathers


def _last_backward_and_all_reduce(rank, ws, seed, micro=3):
    mesh = _mesh(ws)
    for last_flags in (False, True):  # False: set_is_last_backward(False) but on the last one
        for sync_each in (True, False):  # False: set_requires_gradient_sync(False) but on the last
            what = f"seed {seed}: last_flags={last_flags}, sync_each={sync_each}"
            ref, ours = _pair(mesh)
            for mb in range(micro):
                last = mb == micro - 1
                batch = _ids(seed, rank, mb)
                for model in (ref, ours):
                    model.set_is_last_backward(last or last_flags)
                    model.set_requires_gradient_sync(last or sync_each)
                    _loss(model, *batch, scale=1.0 / micro).backward()
            _check_grads(ref, ours, EXACT, what)
    for value in (True, False):  # a 1-D mesh has no all-reduce: no effect either way
        ref, ours = _pair(mesh)
        for model in (ref, ours):
            model.set_requires_all_reduce(value, recurse=True)
            _loss(model, *_ids(seed, rank, 0)).backward()
        _check_grads(ref, ours, EXACT, f"seed {seed}: requires_all_reduce={value}")


# -------------------------------------------------------------------------------- the tests
# One launch per test: starting the ranks costs seconds, the scenarios milliseconds each.
def _reduction_settings(rank, ws, seed):
    _divide_factor(rank, ws, seed)
    _last_backward_and_all_reduce(rank, ws, seed)
    return True


def test_reduction_settings_match_fsdp2():
    """set_gradient_divide_factor (1.0, 3.0, the world size; fp32, fp16 and bf16 reduce
    dtypes) and set_force_sum_reduction_for_comms give FSDP2's gradients, the deprecated
    alias warns as FSDP2's, bad arguments are refused; micro-batching with
    set_is_last_backward(False) on all but the last micro-batch (with and without gradient
    sync on those), and set_requires_all_reduce either way, give FSDP2's gradients."""
    seed = _seed()
    assert run_distributed(_reduction_settings, 2, seed) == [True, True], f"seed {seed}"


def _gather_settings(rank, ws, seed):
    _forward_method(rank, ws, seed)
    return _unshard_in_backward(rank, ws, seed)  # last: it ends with a failed backward


def test_forward_method_and_unshard_in_backward_match_fsdp2():
    """A generate() that reads the root's weights without forward, after the model is
    resharded, gives FSDP2's tokens and logits, and training afterwards still matches; an
    embedding unit set_unshard_in_backward(False) is gathered once per step, not twice, and
    trains as FSDP2 with the same setting (both values)."""
    seed = _seed()
    for gathers in run_distributed(_gather_settings, 2, seed):
        assert gathers == {True: 6, False: 3}, f"seed {seed}: {gathers}"


def test_signatures_match_fsdp2():
    """The methods take FSDP2's arguments (names, kinds, defaults), so calls written for
    torch's bind the same way; the module-level function is exported where fully_shard is."""
    import inspect

    import fusedist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import register_fsdp_forward_method as torch_register

    def shape(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    for name in ("set_gradient_divide_factor", "set_reduce_scatter_divide_factor",
                 "set_force_sum_reduction_for_comms", "set_is_last_backward",
                 "set_unshard_in_backward", "set_requires_all_reduce"):
        assert shape(getattr(fusedist.fsdp.FullyShardedModule, name)) == shape(getattr(FSDPModule, name)), name
    assert fusedist.register_fsdp_forward_method is fusedist.fsdp.register_fsdp_forward_method
    assert shape(fusedist.register_fsdp_forward_method) == shape(torch_register)
