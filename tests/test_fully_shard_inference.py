"""``fully_shard`` in inference and generation loops, against torch's FSDP2 on the same model,
the same wrapping and the same inputs (2 gloo ranks).

What is checked (Note [forward without gradients] in fusedist/fsdp/state.py):

* a token-by-token generation loop of forwards under ``no_grad`` (or ``inference_mode``)
  gives FSDP2's tokens and logits, with no more all-gathers than FSDP2 -- each unit gathered
  once per loop where it keeps its parameters (``reshard_after_forward=False``,
  ``set_reshard_after_forward(False)``, an explicit ``unshard()``, the root under ``None``),
  once per forward where it does not -- the same units stay gathered afterwards, and after
  ``reshard()`` of every module nothing gathered is left (``memory_stats()``);
* training interleaved with evaluations (evaluation after the optimizer step, the usual place)
  follows FSDP2's trajectory exactly, with no more all-gathers;
* the stale cases: an evaluation between a backward and the optimizer step leaves units
  gathered across the step. FSDP2 then keeps computing with the pre-step parameters; fusedist
  reshards at the step, so it follows FSDP2 with the gathered copies freed by hand after each
  step (``reshard()`` of every module: the sound schedule). Loading a state dict into a gathered
  model, and an optimizer step after a forward that raised, are covered too.

Inputs are fresh random draws (the seed is in every failure message). Tolerance: fp32 runs
compare bit for bit -- both implementations run the same forward ops on the same gathered
values, and their gradient reductions (one sum of two ranks' terms, one division by the world
size) round the same way (as in tests/test_fully_shard_api_parity.py); the bf16 generation
computes in bf16 on the same bf16 casts of the same values, so it is bit for bit as well.
"""

from __future__ import annotations

import copy
import random

import torch
import torch.nn.functional as F
from torch import nn

import models
from fusedist.testing import run_distributed
from fusedist.testing.gathers import counting_gathers

EXACT = dict(rtol=0.0, atol=0.0)
VOCAB = 23


class LM(nn.Module):
    def __init__(self, d: int = 16, n: int = 3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(models.ResidualBlock(d, width=2) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x)).flatten(0, 1)  # 2-D: FSDP2 warns of a view output


def _seed() -> int:
    return random.SystemRandom().randrange(2 ** 31)


def _ids(seed: int, rank: int, step: int, length: int = 5):
    g = torch.Generator().manual_seed(seed * 7919 + rank * 101 + step)
    return torch.randint(0, VOCAB, (3, length), generator=g), torch.randint(0, VOCAB, (3, length), generator=g)


def _mesh(ws):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (ws,))


def _pair(mesh, seed: int, block_kw: dict, mp_policy=None):
    """The same fresh LM sharded by torch's FSDP2 (ref) and by fusedist (ours): blocks with
    ``block_kw``, the root with ``reshard_after_forward=None`` (torch's default: the root keeps
    its parameters after forward)."""
    import fusedist
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(seed)
    ref = LM()
    ours = copy.deepcopy(ref)
    for shard, model, policy in ((torch_fully_shard, ref, MixedPrecisionPolicy),
                                 (fusedist.fully_shard, ours, fusedist.MixedPrecisionPolicy)):
        kw = {"mp_policy": policy(param_dtype=mp_policy)} if mp_policy is not None else {}
        for b in model.blocks:
            shard(b, mesh=mesh, **block_kw, **kw)
        shard(model, mesh=mesh, reshard_after_forward=None, **kw)
    return ref, ours


def _modules(model) -> list:
    return [model, *model.blocks]


def _gathered(model) -> list:
    """Which of the root and the blocks hold gathered parameters now (FSDP2's or fusedist's)."""
    from fusedist.fsdp.state import state_of

    out = []
    for m in _modules(model):
        st = state_of(m)
        if st is not None:
            out.append(st.unit.is_unsharded or st.unit.gather_in_flight)
        else:
            out.append(m._get_fsdp_state()._fsdp_param_group.is_unsharded)
    return out


def _generate(model, prompt, steps: int, mode):
    """Greedy token-by-token generation: one whole forward per new token."""
    ids, logits = prompt, []
    with mode():
        for _ in range(steps):
            last = model(ids).view(ids.shape[0], ids.shape[1], VOCAB)[:, -1]
            logits.append(last.float())
            ids = torch.cat([ids, last.argmax(-1, keepdim=True)], dim=1)
    return ids, torch.stack(logits)


def _reshard_all(model) -> None:
    for m in _modules(model):
        m.reshard()


# ------------------------------------------------------------------ generation loops
def _generation(rank, ws, seed):
    mesh = _mesh(ws)
    steps, n_units = 6, 4
    cases = {
        # name: (block kwargs, preparation, fusedist's grad mode, param dtype)
        "blocks reshard": (dict(reshard_after_forward=True), None, torch.no_grad, None),
        "blocks keep": (dict(reshard_after_forward=False), None, torch.no_grad, None),
        "blocks keep, bf16": (dict(reshard_after_forward=False), None, torch.no_grad, torch.bfloat16),
        "blocks keep, inference_mode": (dict(reshard_after_forward=False), None, torch.inference_mode, None),
        "set_reshard_after_forward(False)": (
            dict(reshard_after_forward=True), lambda m: [b.set_reshard_after_forward(False) for b in m.blocks],
            torch.no_grad, None),
        "explicit unshard, blocks reshard": (
            dict(reshard_after_forward=True), lambda m: [x.unshard() for x in _modules(m)], torch.no_grad, None),
        "explicit unshard, blocks keep": (
            dict(reshard_after_forward=False), lambda m: [x.unshard() for x in _modules(m)], torch.no_grad, None),
    }
    for name, (block_kw, prepare, mode, dtype) in cases.items():
        what = f"seed {seed}, {name}"
        ref, ours = _pair(mesh, seed, block_kw, dtype)
        prompt = _ids(seed, rank, 0)[0]
        with counting_gathers() as counts:
            if prepare is not None:
                prepare(ref), prepare(ours)
            # FSDP2 cannot run its first forward under inference_mode: its reference runs under no_grad
            ref_ids, ref_logits = _generate(ref, prompt, steps, torch.no_grad)
            our_ids, our_logits = _generate(ours, prompt, steps, mode)
        assert torch.equal(our_ids, ref_ids), f"{what}: tokens {our_ids.tolist()} != {ref_ids.tolist()}"
        torch.testing.assert_close(our_logits, ref_logits, **EXACT, msg=lambda m: f"{what}: logits: {m}")
        assert counts["fusedist"] <= counts["fsdp2"], f"{what}: all-gathers {counts}"
        assert counts["fusedist"] == counts["fsdp2"], f"{what}: all-gathers {counts} (fewer than FSDP2's?)"
        kept = block_kw["reshard_after_forward"] is False or name.startswith("set_")
        if kept:  # each unit gathered once for the whole loop
            assert counts["fusedist"] == n_units, f"{what}: all-gathers {counts}, expected one per unit"
        assert _gathered(ours) == _gathered(ref), f"{what}: gathered after the loop {_gathered(ours)} != " \
                                                  f"FSDP2's {_gathered(ref)}"
        stats = ours.memory_stats()
        held = sum(x.unit.unsharded_bytes for x in (_state(m) for m in _modules(ours)) if x.unit.is_unsharded)
        assert stats["gathered_bytes"] == held > 0, f"{what}: {stats}, units gathered: {held} bytes"
        _reshard_all(ref), _reshard_all(ours)
        assert not any(_gathered(ref)) and not any(_gathered(ours)), what
        stats = ours.memory_stats()
        assert stats["gathered_bytes"] == 0, f"{what}: after reshard(): {stats}"
        from fusedist.fsdp.owners import owner_of

        assert all(owner_of(p) is not None for p in ours.parameters()), \
            f"{what}: the modules should hold the pieces again"
    return True


def _state(module):
    from fusedist.fsdp.state import state_of

    return state_of(module)


def test_generation_loops_gather_as_fsdp2_and_reshard_to_the_sharded_size():
    """Token-by-token generation (6 forwards) under no_grad / inference_mode, bf16 too, with
    blocks resharding or keeping their parameters, set at wrapping, at run time or by an
    explicit unshard(): tokens and logits equal FSDP2's bit for bit, all-gathers equal FSDP2's
    (one per unit for the loop where parameters are kept, not one per forward), the same units
    stay gathered, and reshard() of every module returns the memory to the shards."""
    seed = _seed()
    assert run_distributed(_generation, 2, seed) == [True, True], f"seed {seed}"


# ------------------------------------------------------------------ training with evaluations
def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _loss(model, ids, target):
    return F.cross_entropy(model(ids), target.flatten())


def _check_params(ref, ours, what: str) -> None:
    import fusedist

    got = fusedist.fsdp.full_state_dict(ours)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v.full_tensor(), **EXACT, msg=lambda m: f"{what}: {k}: {m}")


def _train_eval(rank, ws, seed):
    mesh = _mesh(ws)
    for keep in (False, True):
        for eval_at in ("after step", "before step"):
            what = f"seed {seed}, blocks reshard_after_forward={not keep}, evaluation {eval_at}"
            ref, ours = _pair(mesh, seed, dict(reshard_after_forward=not keep))
            opts = [(m, _optimizer(m)) for m in (ref, ours)]
            stale_at_step = []
            with counting_gathers() as counts:
                for step in range(3):
                    batch, probe = _ids(seed, rank, 10 + step), _ids(seed, rank, 50 + step)[0]
                    losses, evals = [], []
                    for model, opt in opts:
                        loss = _loss(model, *batch)
                        loss.backward()
                        losses.append(loss.detach())
                        if eval_at == "before step":
                            with torch.no_grad():  # the units it gathers are still gathered at the step
                                evals.append(model(probe))
                        if model is ours:
                            stale_at_step.append(any(_gathered(ours)))
                        opt.step()
                        opt.zero_grad()
                        if model is ref and eval_at == "before step":
                            _reshard_all(ref)  # FSDP2 would keep the stale copies: free them by hand
                        if eval_at == "after step":
                            with torch.no_grad():
                                evals.append(model(probe))
                    torch.testing.assert_close(losses[1], losses[0], **EXACT,
                                               msg=lambda m: f"{what}, step {step}: loss: {m}")
                    torch.testing.assert_close(evals[1], evals[0], **EXACT,
                                               msg=lambda m: f"{what}, step {step}: evaluation: {m}")
            assert counts["fusedist"] <= counts["fsdp2"], f"{what}: all-gathers {counts}"
            if eval_at == "before step":
                assert all(stale_at_step), f"{what}: the scenario should leave units gathered at the step"
            _check_params(ref, ours, what)
    return True


def test_training_with_evaluations_follows_fsdp2_and_never_uses_stale_parameters():
    """Three AdamW steps with an evaluation under no_grad after each step (FSDP2's trajectory,
    bit for bit, no more all-gathers) or between the backward and the step (units gathered
    across the step: fusedist gathers the stepped values, as FSDP2 does only when its gathered
    copies are freed by hand), for blocks resharding or keeping their parameters."""
    seed = _seed()
    assert run_distributed(_train_eval, 2, seed) == [True, True], f"seed {seed}"


# ------------------------------------------------------------------ stale gathers, aborted forwards
class _Boom(Exception):
    pass


def _stale_and_aborted(rank, ws, seed):
    mesh = _mesh(ws)
    for keep in (False, True):
        what = f"seed {seed}, blocks reshard_after_forward={not keep}"
        ref, ours = _pair(mesh, seed, dict(reshard_after_forward=not keep))
        opts = [(m, _optimizer(m)) for m in (ref, ours)]
        probe = _ids(seed, rank, 70)[0]

        # A state dict loaded while units are gathered: the next forward uses the loaded values.
        saved = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in (ref, ours)]
        with torch.no_grad():
            before = [m(probe) for m in (ref, ours)]
        for model, opt in opts:
            _loss(model, *_ids(seed, rank, 71)).backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                model(probe)  # gathers what the wrapping keeps
        assert any(_gathered(ours)), what
        for model, sd in zip((ref, ours), saved):
            model.load_state_dict(sd)
        with torch.no_grad():
            after = [m(probe) for m in (ref, ours)]
        for got, expected in zip(after, before):
            torch.testing.assert_close(got, expected, **EXACT, msg=lambda m: f"{what}: forward after a load: {m}")

        # An explicit unshard(), then an optimizer step: the next forward uses the stepped values.
        for model, opt in opts:
            _loss(model, *_ids(seed, rank, 72)).backward()
            for m in _modules(model):
                m.unshard()
            opt.step()
            opt.zero_grad()
            if model is ref:
                _reshard_all(ref)  # FSDP2 would keep the stale copies: free them by hand
        with torch.no_grad():
            out = [m(probe) for m in (ref, ours)]
        torch.testing.assert_close(out[1], out[0], **EXACT, msg=lambda m: f"{what}: forward after unshard, step: {m}")

        # A no_grad forward that raises in the second block: nothing stays half-gathered for the
        # next forward; an optimizer step in between reshards what it left; reshard() frees all.
        _loss(ours, *_ids(seed, rank, 73)).backward()
        _loss(ref, *_ids(seed, rank, 73)).backward()
        handle = ours.blocks[1].register_forward_hook(lambda *_: (_ for _ in ()).throw(_Boom()))
        try:
            with torch.no_grad():
                ours(probe)
            raise AssertionError(f"{what}: the forward should have raised")
        except _Boom:
            pass
        handle.remove()
        assert any(_gathered(ours)), what
        for model, opt in opts:
            opt.step()
            opt.zero_grad()
        assert not any(_gathered(ours)), f"{what}: the step should reshard what the aborted forward gathered"
        _reshard_all(ref)
        with torch.no_grad():
            out = [m(probe) for m in (ref, ours)]
        torch.testing.assert_close(out[1], out[0], **EXACT, msg=lambda m: f"{what}: forward after an aborted one: {m}")
        _check_params(ref, ours, what)
        _reshard_all(ours)
        assert ours.memory_stats()["gathered_bytes"] == 0, f"{what}: {ours.memory_stats()}"
    return True


def test_stale_gathers_and_aborted_forwards_are_correct():
    """Gathered units never serve stale values: after a state-dict load into a gathered model,
    after an optimizer step following an explicit unshard(), and after an optimizer step
    following a no_grad forward that raised midway (which leaves nothing gathered behind, and
    reshard() frees everything)."""
    seed = _seed()
    assert run_distributed(_stale_and_aborted, 2, seed) == [True, True], f"seed {seed}"
