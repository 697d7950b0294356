"""FusedistFabricStrategy against Lightning Fabric's own ``strategy="ddp"`` on the same loop:
``fabric.setup`` with an LR scheduler, gradient accumulation under ``no_backward_sync``, a
clip by norm (its returned norm too), ``fabric.save`` / ``fabric.load`` and training on, for
ZeRO stages 0-2 and each mixed precision, on two gloo ranks.

Ranks are processes of :func:`fusedist.testing.run_distributed` with the torchelastic
variables set, so Fabric starts no workers of its own. Tolerances as in
test_lightning_drop_in.py: fp32 1e-5 (fused kernels and bucketed all-reduces against torch's
foreach ops and all-reduce, an ulp or two per step over a dozen steps); bf16 / fp16 autocast
1e-3 (the same autocast matmuls on weights an ulp apart can round to the neighbouring
half-precision value). The failures these tests exist for (an unsynchronized or unclipped
step, a scheduler driving a discarded optimizer, a lost optimizer state) move the weights by
1e-2 or more.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from shared_rank_launch import results_of
from test_e2e_lightning_recipe import _launched_env
from test_lightning_launch import register, shared_launch

TOL = {"32-true": 1e-5, "bf16-mixed": 1e-3, "16-mixed": 1e-3}
STEPS, SAVED_AT, ACCUMULATE = 6, 3, 2


def _fabric(side: str, precision: str, zero_stage: int):
    import lightning as L
    from lightning.fabric.plugins.precision import MixedPrecision

    plugins = None
    if precision == "16-mixed":  # Fabric turns "16-mixed" into bf16 on a CPU; the plugin keeps fp16 and its scaler
        precision, plugins = None, [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", 2.0**8))]
    if side == "ddp":
        strategy = "ddp"
    else:
        from fusedist.integrations.fabric import FusedistFabricStrategy

        strategy = FusedistFabricStrategy(zero_stage=zero_stage)
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy,
                      precision=precision, plugins=plugins)
    fabric.launch()
    return fabric


def _model_and_optimizer(with_scheduler: bool = True, optimizer_cls=torch.optim.AdamW):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = optimizer_cls(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step)) if with_scheduler else None
    return model, optimizer, scheduler


def _set_up(fabric):
    model, optimizer, scheduler = _model_and_optimizer()
    return fabric.setup(model, optimizer, scheduler=scheduler)


def _batch(rank: int, step: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randn(4, 8, generator=g)
    return x, torch.sin(2 * x[:, :3])


def _train(fabric, model, optimizer, scheduler, steps, first, norms):
    for step in range(first, steps):
        for micro in range(ACCUMULATE):
            x, y = _batch(fabric.global_rank, step, micro)
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATE - 1):
                fabric.backward(nn.functional.mse_loss(model(x).float(), y) / ACCUMULATE)
        norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=0.05)))
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


def _run(side, precision, zero_stage, directory):
    """Train STEPS steps, saving at SAVED_AT; then load that checkpoint into a fresh setup and
    train to STEPS again. Returns the weights and norms of both, and the learning rates."""
    fabric = _fabric(side, precision, zero_stage)
    model, optimizer, scheduler = _set_up(fabric)
    if side == "fusedist":  # (what runs is fusedist's, not torch's)
        import fusedist

        kinds = {0: fusedist.optim.FusedAdamW, 1: fusedist.ZeroRedundancyOptimizer, 2: fusedist.ZeroRedundancyOptimizer}
        assert isinstance(model._forward_module, fusedist.DistributedDataParallel)
        assert isinstance(optimizer.optimizer, kinds[zero_stage])
    norms = []
    _train(fabric, model, optimizer, scheduler, SAVED_AT, 0, norms)
    path = os.path.join(directory, f"{side}.ckpt")
    fabric.save(path, {"model": model, "optimizer": optimizer, "scheduler": scheduler})
    _train(fabric, model, optimizer, scheduler, STEPS, SAVED_AT, norms)
    straight = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    lrs = [group["lr"] for group in optimizer.param_groups]

    model, optimizer, scheduler = _set_up(fabric)
    fabric.load(path, {"model": model, "optimizer": optimizer, "scheduler": scheduler})
    resumed_norms = norms[:SAVED_AT]
    _train(fabric, model, optimizer, scheduler, STEPS, SAVED_AT, resumed_norms)
    resumed = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    return straight, resumed, norms, resumed_norms, lrs


def _compare(rank, world, precision, zero_stage, directory):
    _launched_env(rank, world)
    ours = _run("fusedist", precision, zero_stage, directory)
    theirs = _run("ddp", precision, zero_stage, directory)
    tol = TOL[precision]
    for name, a, b in (("weights", ours[0], theirs[0]), ("resumed weights", ours[1], theirs[1])):
        assert (a - b).abs().max().item() <= tol, (name, (a - b).abs().max().item())
    assert (ours[1] - ours[0]).abs().max().item() <= tol  # the resumed run continues the straight one
    for a, b in ((ours[2], theirs[2]), (ours[3], theirs[3])):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=tol, atol=tol), (a, b)
    assert ours[4] == theirs[4]  # the scheduler drives the optimizer that steps


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_fabric_loop_trains_resumes_and_clips_as_fabrics_ddp(zero_stage, launched):
    results_of(launched, f"32-true, ZeRO {zero_stage}")


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_fabric_mixed_precision_with_zero2_trains_as_fabrics_ddp(precision, launched):
    results_of(launched, f"{precision}, ZeRO 2")


def _refusals_and_names(rank, world):
    _launched_env(rank, world)
    import lightning as L

    import fusedist
    import fusedist.integrations.fabric  # noqa: F401 (registers the names)

    # the strategy by name, as Fabric's own ("ddp") are named
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy="fusedist_zero2")
    fabric.launch()
    model, optimizer = _model_and_optimizer()[:2]
    model, optimizer = fabric.setup(model, optimizer)
    assert isinstance(optimizer.optimizer, fusedist.ZeroRedundancyOptimizer) and optimizer.optimizer.stage == 2
    assert type(optimizer.optimizer).__name__ == "AdamW"  # the class the user wrote (Note [the optimizer's name])
    x, y = _batch(rank, 0, 0)
    fabric.backward(nn.functional.mse_loss(model(x), y))
    with pytest.raises(ValueError, match="cannot be applied with zero_stage=2"):
        fabric.clip_gradients(model, optimizer, clip_val=0.1)

    # one ZeRO optimizer per module: a second is refused by name, before anything is wrapped
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy="fusedist_zero1")
    fabric.launch()
    module = nn.Linear(3, 3)
    first = torch.optim.AdamW([module.weight])
    second = torch.optim.SGD([module.bias], lr=0.1)
    with pytest.raises(ValueError, match="shards one optimizer over all the module's trainable parameters"):
        fabric.setup(module, first, second)

    # an optimizer that has stepped carries its state over (Note [an optimizer that stepped
    # before the strategy] in _optimizer_swap.py; trained against Fabric's DDP in
    # test_fabric_strategy_setup_again_teardown_and_prewarmed.py)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy="fusedist")
    fabric.launch()
    module, stepped = _model_and_optimizer()[:2]
    module(torch.randn(2, 8)).sum().backward()
    stepped.step()
    moments = [stepped.state[p]["exp_avg"].clone() for p in module.parameters()]
    wrapped, optimizer = fabric.setup(module, stepped)
    assert all(torch.equal(optimizer.optimizer.state[p]["exp_avg"], m) for p, m in zip(module.parameters(), moments))

    # Fabric's DDP takes fabric.setup_optimizers before fabric.setup_module; stage 2 is built on
    # the module's wrapper, so that order is refused naming the calls to make (ZeRO's own refusal
    # advised to "wrap the model"), and the same objects then set up in order train as stage 2
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy="fusedist_zero2")
    fabric.launch()
    module, optimizer = _model_and_optimizer()[:2]
    with pytest.raises(ValueError, match=r"zero_stage=2\): the AdamW .* 4 parameter\(s\) \(shapes \[\(16, 8\).*"
                                         r"call fabric.setup_module\(model\) before fabric.setup_optimizers"):
        fabric.setup_optimizers(optimizer)
    model = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(optimizer)
    assert isinstance(optimizer.optimizer, fusedist.ZeroRedundancyOptimizer) and optimizer.optimizer.stage == 2
    fabric.backward(nn.functional.mse_loss(model(_batch(rank, 0, 0)[0]), _batch(rank, 0, 0)[1]))
    optimizer.step()


def test_fabric_strategy_names_and_refusals(launched):
    results_of(launched, "names and refusals")


def _scheduler_built_around_setup(side, precision, zero_stage, overflow_first, after, optimizer_cls=torch.optim.AdamW):
    """A scheduler built on the optimizer (an ``optimizer_cls``) before ``fabric.setup_optimizers``
    (or, ``after``, on that same optimizer after it), which Fabric is not given: its torch
    step-order warnings and learning rates (Note [a scheduler built on the returned optimizer])."""
    import warnings

    fabric = _fabric(side, precision, zero_stage)
    model, original, scheduler = _model_and_optimizer(with_scheduler=not after, optimizer_cls=optimizer_cls)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(original)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if after:
            scheduler = torch.optim.lr_scheduler.LambdaLR(original, lambda step: 1.0 / (1 + step))
        for step in range(3):
            x, y = _batch(fabric.global_rank, step, 0)
            loss = nn.functional.mse_loss(model(x).float(), y)
            fabric.backward(loss * 1e30 if overflow_first and step == 0 else loss)  # fp16: inf, skipped
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
    messages = [str(w.message)[:60] for w in caught if "lr_scheduler" in str(w.message)]
    return messages, [group["lr"] for group in optimizer.param_groups]


def _scheduler_warnings(rank, world):
    from fusedist.optim import FusedAdamW

    _launched_env(rank, world)
    for after in (False, True):
        for precision, overflow_first in (("32-true", False), ("16-mixed", True)):
            ref = _scheduler_built_around_setup("ddp", precision, 0, overflow_first, after)
            assert bool(ref[0]) == overflow_first, ref  # torch warns after a skipped first step only
            # (a user's FusedAdamW too, which the strategy shards at stage 2)
            for zero_stage, optimizer_cls in ((0, torch.optim.AdamW), (2, torch.optim.AdamW), (2, FusedAdamW)):
                ours = _scheduler_built_around_setup("fusedist", precision, zero_stage, overflow_first, after,
                                                     optimizer_cls)
                assert ours == ref, (after, precision, zero_stage, optimizer_cls.__name__, ours, ref)


def test_fabric_scheduler_built_before_or_after_setup_warns_as_fabrics_ddp(launched):
    """torch's step-order check read the flag of the optimizer the scheduler was built on, which
    the strategy had swapped: it warned "lr_scheduler.step() before optimizer.step()" at every
    first scheduler step, though the swapped optimizer had stepped -- for a scheduler built on
    that optimizer before setup, and one built on it after setup (and, for a user's FusedAdamW
    the strategy sharded, still after the first fix: a fused optimizer's flag recorded the link to
    the sharded one's as False); it now warns where torch's does, after a first step skipped for
    an fp16 overflow."""
    results_of(launched, "scheduler built around setup")


def _saved_through_the_given_optimizer(side, zero_stage, directory):
    """``fabric.save`` / ``fabric.load`` of the optimizer object passed to ``fabric.setup`` (the one
    Fabric's DDP steps) rather than the one setup returned: (straight weights, resumed weights)."""
    fabric = _fabric(side, "32-true", zero_stage)

    def train(model, optimizer, steps):
        for step in steps:
            x, y = _batch(fabric.global_rank, step, 0)
            fabric.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()

    path = os.path.join(directory, f"given-{side}-{zero_stage}.ckpt")
    model, given = _model_and_optimizer()[:2]
    model, optimizer = fabric.setup(model, given)
    train(model, optimizer, range(3))
    fabric.save(path, {"model": model, "optimizer": given})
    train(model, optimizer, range(3, 6))
    straight = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    model, given = _model_and_optimizer()[:2]
    model, optimizer = fabric.setup(model, given)
    fabric.load(path, {"model": model, "optimizer": given})
    train(model, optimizer, range(3, 6))
    return straight, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _given_optimizer_saves(rank, world, directory):
    _launched_env(rank, world)
    ref = _saved_through_the_given_optimizer("ddp", 0, directory)
    assert torch.equal(ref[0], ref[1])
    for zero_stage in (1, 2):
        straight, resumed = _saved_through_the_given_optimizer("fusedist", zero_stage, directory)
        for a, b in ((straight, ref[0]), (resumed, ref[1]), (resumed, straight)):
            assert (a - b).abs().max().item() <= TOL["32-true"], (zero_stage, (a - b).abs().max().item())


def test_fabric_save_of_the_optimizer_given_to_setup_holds_the_whole_zero_state(launched):
    """Saving the optimizer object given to ``fabric.setup`` (Fabric's DDP steps that very
    object) saved rank 0's ZeRO shard -- the swapped optimizer's state_dict without the
    consolidation Fabric runs for a ZeroRedundancyOptimizer -- which ``fabric.load`` refused;
    it now holds the whole state, and the run resumes as Fabric's DDP does."""
    results_of(launched, "save through the given optimizer")


def _stepped_through_the_given_optimizer(rank, world):
    """A loop that steps and zeroes the optimizer it passed to ``fabric.setup``, not the one setup
    returned: weights after 4 steps, against Fabric's DDP (where it is the optimizer that steps)."""
    _launched_env(rank, world)
    weights = {}
    for side, zero_stage in (("ddp", 0), ("fusedist", 0), ("fusedist", 2)):
        fabric = _fabric(side, "32-true", zero_stage)
        model, given = _model_and_optimizer()[:2]
        model, _ = fabric.setup(model, given)
        for step in range(4):
            x, y = _batch(fabric.global_rank, step, 0)
            fabric.backward(nn.functional.mse_loss(model(x), y))
            given.step()
            given.zero_grad()
        weights[side, zero_stage] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for key in (("fusedist", 0), ("fusedist", 2)):
        diff = (weights[key] - weights["ddp", 0]).abs().max().item()
        assert diff <= TOL["32-true"], (key, diff)


def test_fabric_loop_stepping_the_optimizer_given_to_setup_trains_as_fabrics_ddp(launched):
    """The given optimizer steps the swapped one (Note [the returned optimizer]): it used to step
    as a separate torch optimizer with its own state, which on ZeRO stage 2 (no p.grad) did
    nothing at all."""
    results_of(launched, "step through the given optimizer")


def _separate_setup_half_precision(rank, world, zero_stage):
    """``fabric.setup_module`` then ``fabric.setup_optimizers`` (the order sharded strategies ask
    for) takes the same conversion as ``fabric.setup``; under "bf16-true" the fused optimizer
    keeps FP32 master weights (a bf16 AdamW loses updates below half a bf16 ulp), and its steps
    match torch's AdamW on FP32 copies of the weights, fed the same averaged gradients."""
    _launched_env(rank, world)
    import lightning as L

    import fusedist
    from fusedist.integrations.fabric import FusedistFabricStrategy

    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=FusedistFabricStrategy(zero_stage=zero_stage),
                      precision="bf16-true")
    fabric.launch()
    model, optimizer = _model_and_optimizer()[:2]
    masters = [p.detach().clone().requires_grad_() for p in model.parameters()]
    reference = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(optimizer)
    inner = optimizer.optimizer
    assert isinstance(inner, fusedist.ZeroRedundancyOptimizer if zero_stage else fusedist.optim.FusedAdamW)
    assert (inner.optim if zero_stage else inner).defaults["master_weights"] is True
    for step in range(4):
        # the reference gradient: every rank's loss on a copy of the bf16 module, averaged
        copy = [p.detach().clone().requires_grad_() for p in model.parameters()]
        total = sum(nn.functional.mse_loss(torch.func.functional_call(
            model.module, dict(zip([n for n, _ in model.module.named_parameters()], copy)),
            (_batch(r, step, 0)[0].bfloat16(),)).float(), _batch(r, step, 0)[1]) for r in range(world)) / world
        for master, g in zip(masters, torch.autograd.grad(total, copy)):
            master.grad = g.float()
        reference.step()
        x, y = _batch(rank, step, 0)
        fabric.backward(nn.functional.mse_loss(model(x).float(), y))
        optimizer.step()
        optimizer.zero_grad()
        # bf16 weights are their FP32 masters rounded: the reference's, within a bf16 ulp or two
        # (gradients summed in another order round to neighbouring bf16 values)
        for p, master in zip(model.parameters(), masters):
            assert torch.allclose(p.float(), master.detach().bfloat16().float(), rtol=2 ** -6, atol=1e-3), step


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_fabric_separate_setup_with_bf16_true_keeps_fp32_masters(zero_stage, launched):
    results_of(launched, f"separate setup, bf16-true, ZeRO {zero_stage}")


def _jobs(tmp_path_factory):
    """The checks of this file's selected tests, in the launch shared with the other Lightning
    and Fabric files (test_lightning_launch.py); each runs in the ranks as it ran in a launch of
    its own, its assertions included. 600 s: the eight launches they replaced had 1620 s
    together; they take 30-60 s on a loaded 2-core machine."""
    root = tmp_path_factory.mktemp("fabric")

    def compare(precision, zero_stage):
        directory = root / f"{precision}-{zero_stage}"
        directory.mkdir()
        return {f"{precision}, ZeRO {zero_stage}": (_compare, (precision, zero_stage, str(directory)))}

    jobs = {"test_fabric_loop_trains_resumes_and_clips_as_fabrics_ddp": {
                k: v for stage in (0, 1, 2) for k, v in compare("32-true", stage).items()},
            "test_fabric_mixed_precision_with_zero2_trains_as_fabrics_ddp": {
                k: v for precision in ("bf16-mixed", "16-mixed") for k, v in compare(precision, 2).items()},
            "test_fabric_strategy_names_and_refusals": {"names and refusals": (_refusals_and_names, ())},
            "test_fabric_save_of_the_optimizer_given_to_setup_holds_the_whole_zero_state": {
                "save through the given optimizer": (_given_optimizer_saves, (str(root),))},
            "test_fabric_loop_stepping_the_optimizer_given_to_setup_trains_as_fabrics_ddp": {
                "step through the given optimizer": (_stepped_through_the_given_optimizer, ())},
            "test_fabric_scheduler_built_before_or_after_setup_warns_as_fabrics_ddp": {
                "scheduler built around setup": (_scheduler_warnings, ())},
            "test_fabric_separate_setup_with_bf16_true_keeps_fp32_masters": {
                f"separate setup, bf16-true, ZeRO {stage}": (_separate_setup_half_precision, (stage,))
                for stage in (0, 2)}}
    return jobs


register(_jobs, seconds=600)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    return shared_launch(request, tmp_path_factory)
