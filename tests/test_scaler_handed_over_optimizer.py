"""``fusedist.amp.GradScaler`` given the optimizer a strategy handed over to a fused or sharded one
(``hand_over`` in fusedist/integrations/_optimizer_swap.py; a Fabric loop that kept its optimizer
and scales it itself): the scaler's decision reaches the optimizer that steps (Note [the protocol
of a handed-over optimizer] in fusedist/optim/_scaler_protocol.py), and the first iteration's
deferred step under ``found_inf_group`` keeps the hand-over's step-flag link (Note [a deferred
step keeps the hand-over's flag] in fusedist/amp/found_inf_group.py); the step hooks registered
on it run (Note [the returned optimizer's step hooks] in _optimizer_swap.py).

References: torch.optim.AdamW + torch.amp.GradScaler (and torch DDP for ZeRO stage 2) on the same
fresh random gradients, the seed in every failure message. Tolerance: fp32 AdamW in another
summation order, 1e-6 (the scales are powers of two, so the unscaled gradients are equal);
learning rates and scheduler messages exactly.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from fusedist.amp import GradScaler
from fusedist.integrations._optimizer_swap import convert_optimizer, hand_over
from fusedist.optim import FusedAdamW
from shared_rank_launch import results_of
from test_lightning_launch import register, shared_launch

SHAPES = [(5,), (3, 4)]
OVERFLOW_AT = 1


def _params(seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _iterate(scaler, stepping, params, seed, unscale_first, steps=4):
    for step in range(steps):
        gen = torch.Generator().manual_seed(seed * 100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 4.0  # (as if scaled by init_scale 4)
        if step == OVERFLOW_AT:
            params[0].grad.view(-1)[0] = float("inf")
        scaler.scale(torch.zeros(()))
        if unscale_first:
            scaler.unscale_(stepping)
        scaler.step(stepping)
        scaler.update()
    return scaler.get_scale()


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step only", "unscale_ first"])
def test_scaler_step_on_a_handed_over_fused_optimizer_matches_torch(unscale_first):
    """A user's FusedAdamW handed over: the scale and the overflow flag landed on it, and its step
    (the new optimizer's) applied the scaled gradients and the overflowed step (weights nan)."""
    seed = random.randrange(2**31)
    theirs = _params(seed)
    ref = torch.optim.AdamW(theirs, lr=1e-2)
    want = _iterate(torch.amp.GradScaler("cpu", init_scale=4.0), ref, theirs, seed, unscale_first)
    ours = _params(seed)
    original, new = FusedAdamW(ours, lr=1e-2), FusedAdamW(ours, lr=1e-2)
    hand_over(original, new, [])
    got = _iterate(GradScaler("cpu", init_scale=4.0), original, ours, seed, unscale_first)
    assert got == want, f"seed {seed}"
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m: f"seed {seed}: {m}")


def _hooked_iterations(scaler, stepping, params, seed, register):
    """Step hooks' calls (which hook, at which iteration, whether it saw ``stepping``) and the
    weights after a scaler loop with an overflow at OVERFLOW_AT; ``register(hook_maker)`` adds
    the hooks."""
    calls, now = [], [0]

    def make(tag):
        return lambda opt, args, kwargs: calls.append((tag, now[0], opt is stepping and args[0] is stepping))

    register(make)
    for step in range(4):
        now[0] = step
        gen = torch.Generator().manual_seed(seed * 100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 4.0
        if step == OVERFLOW_AT:
            params[0].grad.view(-1)[0] = float("inf")
        scaler.scale(torch.zeros(()))
        scaler.step(stepping)
        scaler.update()
    return calls


@pytest.mark.parametrize("original_cls", [torch.optim.AdamW, FusedAdamW], ids=["AdamW", "FusedAdamW"])
def test_step_hooks_of_a_handed_over_optimizer_run_as_torch(original_cls):
    """Hooks registered on the optimizer the program kept (before or after the hand-over) never
    ran: its forwarding step replaced the class's step, which runs them. They now run around the
    new optimizer's step, and not on a step the scaler skips, as torch's."""
    seed = random.randrange(2**31)
    theirs = _params(seed)
    ref = torch.optim.AdamW(theirs, lr=1e-2)

    def on_ref(make):
        ref.register_step_pre_hook(make("pre before"))
        ref.register_step_post_hook(make("post before"))
        ref.register_step_post_hook(make("post after"))

    want = _hooked_iterations(torch.amp.GradScaler("cpu", init_scale=4.0), ref, theirs, seed, on_ref)
    assert [c[1] for c in want if c[0] == "pre before"] == [0, 2, 3], want  # (torch skips the overflow)
    ours = _params(seed)
    original = original_cls(ours, lr=1e-2)

    def on_ours(make):
        original.register_step_pre_hook(make("pre before"))
        original.register_step_post_hook(make("post before"))
        hand_over(original, FusedAdamW(ours, lr=1e-2), [])
        original.register_step_post_hook(make("post after"))

    got = _hooked_iterations(GradScaler("cpu", init_scale=4.0), original, ours, seed, on_ours)
    assert got == want, f"seed {seed}"
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m: f"seed {seed}: {m}")


# -- multi-rank scenarios, one launch -------------------------------------------------------------

class _Strategy:
    """What Fabric's and Lightning's strategies do with their wrapper's step at 32-bit precision:
    step the optimizer (Lightning's passes a closure to run first)."""

    def optimizer_step(self, optimizer, closure=None, **kwargs):
        if closure is not None:
            closure()
        return optimizer.step(**kwargs)


def _wrapped(optimizer, through):
    """``optimizer`` as the scaler is given it: itself, or Fabric's or Lightning's wrapper of it."""
    if through == "fabric":
        from lightning.fabric.wrappers import _FabricOptimizer

        return _FabricOptimizer(optimizer, _Strategy())
    if through == "lightning":
        from lightning.pytorch.core.optimizer import LightningOptimizer

        wrapper = LightningOptimizer(optimizer)
        wrapper._strategy = _Strategy()
        return wrapper
    return optimizer


def _zero2_handed_over(rank, world, original_name, unscale_first, seed, through="kept"):
    """A strategy's ZeRO stage 2 behind the user's AdamW or FusedAdamW, stepped by the scaler
    through the user's optimizer (``through``: itself, or Fabric's or Lightning's wrapper of it),
    against torch DDP + AdamW + torch's scaler (an overflow on rank 1 only). Returns the largest
    weight difference and both scales."""
    import copy

    import fusedist

    torch.manual_seed(seed)
    net = torch.nn.Linear(6, 4)
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(net))
    model = fusedist.DistributedDataParallel(net)
    cls = {"AdamW": torch.optim.AdamW, "FusedAdamW": FusedAdamW}[original_name]
    original = cls(model.parameters(), lr=1e-2)
    new = convert_optimizer(original, fused_optimizer=True, zero_stage=2, master_weights=False,
                            strategy="test", fresh_from="test")
    hand_over(original, new, [])
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    sides = ((model, _wrapped(original, through), GradScaler("cpu", init_scale=2.0**8)),
             (ref, ref_opt, torch.amp.GradScaler("cpu", init_scale=2.0**8)))
    for step in range(4):
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(seed + 10 * step + rank))
        for module, optimizer, scaler in sides:
            module.zero_grad()
            loss = module(x).pow(2).sum()
            if step == OVERFLOW_AT and rank == 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            if unscale_first:
                scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
    new.wait_for_params()
    diff = max(float((a - b).detach().abs().max()) for a, b in zip(net.parameters(), ref.module.parameters()))
    return diff, sides[0][2].get_scale(), sides[1][2].get_scale()


def _deferred_step_flag(rank, world, original_name, overflow_first, scheduler_before_update, seed):
    """The scheduler's step-order messages and learning rates under ``found_inf_group``, whose
    first iteration's step waits for ``update()``: a scheduler built on the user's optimizer
    before the hand-over (the strategy not given it), stepped between ``step()`` and ``update()``
    or after ``update()``; against torch's AdamW and scaler."""
    import torch.distributed as dist

    out = {}
    for side in ("torch", "ours"):
        params = _params(seed)
        if side == "torch":
            stepping = torch.optim.AdamW(params, lr=1e-2)
            scheduler = torch.optim.lr_scheduler.LambdaLR(stepping, lambda s: 1.0 / (1 + s))
            scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        else:
            cls = {"AdamW": torch.optim.AdamW, "FusedAdamW": FusedAdamW}[original_name]
            stepping = cls(params, lr=1e-2)
            scheduler = torch.optim.lr_scheduler.LambdaLR(stepping, lambda s: 1.0 / (1 + s))
            hand_over(stepping, FusedAdamW(params, lr=1e-2), [])
            scaler = GradScaler("cpu", init_scale=4.0, found_inf_group=dist.group.WORLD)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                gen = torch.Generator().manual_seed(seed * 100 + step)
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen) * 4.0
                if overflow_first and step == 0:
                    params[0].grad.view(-1)[0] = float("inf")
                scaler.scale(torch.zeros(()))
                scaler.step(stepping)
                if scheduler_before_update:
                    scheduler.step()
                    scaler.update()
                else:
                    scaler.update()
                    scheduler.step()
        messages = [str(w.message).split(".")[0] for w in caught if "lr_scheduler" in str(w.message)]
        out[side] = (messages, [g["lr"] for g in stepping.param_groups], [p.detach().clone() for p in params])
    return out


_SEED = random.randrange(2**31)
_BY_TEST = {
    "test_zero2_behind_a_handed_over_optimizer_matches_torch": {
        f"zero2 {name} {'unscale_' if first else 'step'}": (_zero2_handed_over, (name, first, _SEED))
        for name in ("AdamW", "FusedAdamW") for first in (False, True)},
    "test_zero2_behind_a_wrapper_of_the_handed_over_optimizer_matches_torch": {
        f"zero2 AdamW {through} {'unscale_' if first else 'step'}": (_zero2_handed_over,
                                                                     ("AdamW", first, _SEED, through))
        for through in ("fabric", "lightning") for first in (False, True)},
    "test_a_deferred_first_step_keeps_the_handed_over_flag": {
        f"flag {name} {overflow} {before}": (_deferred_step_flag, (name, overflow, before, _SEED))
        for name in ("AdamW", "FusedAdamW") for overflow in (False, True) for before in (False, True)
        # (a scheduler stepped before update() after an overflowed deferred first step: torch's
        # warns, ours does not -- Note [the first iteration's steps wait for update()])
        if not (overflow and before)},
}


def _jobs(tmp_path_factory):
    """The scenarios, in the launch shared with the Lightning and Fabric files
    (test_lightning_launch.py): the wrapper cases import Lightning in the ranks."""
    return _BY_TEST


register(_jobs, seconds=120)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    return shared_launch(request, tmp_path_factory)


def test_zero2_behind_a_handed_over_optimizer_matches_torch(launched):
    """Before: with the user's FusedAdamW the scaled, overflowed gradients were stepped (nan);
    with the user's AdamW torch's path unscaled ``p.grad``, which stage 2 leaves None, and raised
    "No inf checks were recorded for this optimizer"."""
    for scenario in _BY_TEST["test_zero2_behind_a_handed_over_optimizer_matches_torch"]:
        for rank, (diff, ours, theirs) in enumerate(results_of(launched, scenario)):
            assert diff < 1e-6 and ours == theirs == 2.0**7, (scenario, _SEED, rank, diff, ours, theirs)


def test_zero2_behind_a_wrapper_of_the_handed_over_optimizer_matches_torch(launched):
    """Fabric's or Lightning's wrapper of the user's AdamW, handed over to a ZeRO stage 2 optimizer:
    the scaler kept its record under the ZeRO optimizer but took torch's path, which unscaled
    ``p.grad`` (None under stage 2) and raised "No inf checks were recorded for this optimizer"
    (Note [one chain of names] in fusedist/optim/_scaler_protocol.py)."""
    for scenario in _BY_TEST["test_zero2_behind_a_wrapper_of_the_handed_over_optimizer_matches_torch"]:
        for rank, (diff, ours, theirs) in enumerate(results_of(launched, scenario)):
            assert diff < 1e-6 and ours == theirs == 2.0**7, (scenario, _SEED, rank, diff, ours, theirs)


def test_a_deferred_first_step_keeps_the_handed_over_flag(launched):
    """Before: the deferred step's mark replaced the hand-over's link with False, so a scheduler
    stepped after ``update()`` warned "lr_scheduler.step() before optimizer.step()" although the
    step ran; on a user's FusedAdamW the link hid the mark, so one stepped before ``update()``
    warned too."""
    for scenario in _BY_TEST["test_a_deferred_first_step_keeps_the_handed_over_flag"]:
        for rank, out in enumerate(results_of(launched, scenario)):
            (want_msgs, want_lrs, want_p), (got_msgs, got_lrs, got_p) = out["torch"], out["ours"]
            assert got_msgs == want_msgs and got_lrs == want_lrs, (scenario, _SEED, rank, out)
            for a, b in zip(got_p, want_p):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m: f"{scenario} {_SEED}: {m}")
