"""A Lightning recipe trained with Lightning's own ``strategy="ddp"`` and with
``FusedistStrategy`` on 2 gloo ranks, compared step by step: losses, gradient norms (before
the clip), weights, learning rates, validation losses, and at the end the optimizer,
LR-scheduler and GradScaler state.

The recipe is what users set: two parameter groups, AdamW or SGD with momentum, a per-step LR
scheduler, ``accumulate_grad_batches=2`` (an epoch that ends inside a window included),
``gradient_clip_val`` by norm or by value, bf16 or fp16 mixed precision, 64-true, the same
written out in manual optimization, a validation loop every few steps, ``ModelCheckpoint`` and
a resume from one of its checkpoints in a fresh Trainer, which must continue the uninterrupted
run exactly (and a ``strategy="ddp"`` checkpoint must continue as Lightning's DDP does); and the
strategy's own options: ZeRO stages 1 and 2, fused optimizers, communication hooks.

Each rank is a process of :func:`fusedist.testing.run_distributed`; the process group exists
before the Trainer, and the torchelastic variables tell Lightning that it was launched already
(it then neither spawns workers nor creates a group).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from torch import nn

import test_lightning_launch

IN, HIDDEN, OUT = 8, 16, 3
BATCH = 4           # per rank and micro-batch
SAMPLES = 64        # 8 micro-batches per rank and epoch (2 ranks): 4 optimizer steps with accumulation 2
EPOCHS = 2
HOOK_SAMPLES = 32   # the communication-hook runs: 4 micro-batches per rank and epoch (val_check_interval)


def _module_class():
    import lightning as L

    class Recipe(L.LightningModule):
        """A small regressor; every loss and learning rate it sees is logged for the comparison."""

        def __init__(self, optimizer: str, manual: bool = False):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
            self.optimizer_name = optimizer
            self.automatic_optimization = not manual
            self.log_ = {"loss": [], "val": []}

        def training_step(self, batch, batch_idx):
            x, y = batch
            # Summed: gradient norms of a few units, so the clip at 0.5 bites.
            loss = nn.functional.mse_loss(self.net(x).float(), y, reduction="sum")
            self.log_["loss"].append(loss.item())
            if not self.automatic_optimization:
                self._manual_step(loss, batch_idx)
            return loss

        def _manual_step(self, loss, batch_idx):
            """What automatic optimization does, written out: accumulate 2, clip, step, schedule."""
            opt, sched = self.optimizers(), self.lr_schedulers()
            self.manual_backward(loss)
            if (batch_idx + 1) % 2 == 0:
                self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
                opt.step()
                opt.zero_grad()
                sched.step()

        def validation_step(self, batch, _):
            x, y = batch
            self.log_["val"].append(nn.functional.mse_loss(self.net(x).float(), y).item())

        def configure_optimizers(self):
            decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
            rest = [p for n, p in self.named_parameters() if not n.endswith("weight")]
            groups = [{"params": decay, "weight_decay": 0.05}, {"params": rest, "weight_decay": 0.0}]
            if self.optimizer_name == "sgd":
                opt = torch.optim.SGD(groups, lr=0.02, momentum=0.9)
            else:
                opt = torch.optim.AdamW(groups, lr=1e-2)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.5 * s))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Recipe


def _recorder():
    import lightning as L

    class Recorder(L.Callback):
        """Per optimizer step: the gradient norm before the clip (all parameters' gradients;
        None where a sharded optimizer keeps none), the weights and learning rates after it."""

        def __init__(self):
            self.records = {"norm": [], "weights": [], "lr": []}
            self.start = 0

        def on_train_start(self, trainer, module):
            self.start = trainer.global_step  # a resumed run starts at its checkpoint's step

        def on_before_optimizer_step(self, trainer, module, optimizer):
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            self.records["norm"].append(torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g.float()) for g in grads])).item() if grads else None)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step > len(self.records["weights"]) + self.start:  # a step was taken
                self.records["weights"].append(_flat(module))
                self.records["lr"].append([g["lr"] for g in trainer.optimizers[0].param_groups])

    return Recorder()


def _flat(module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in module.parameters()])


def _data(seed: int, n: int = SAMPLES):
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=g)
    y = torch.sin(2 * x[:, :OUT]) + 0.1 * torch.randn(n, OUT, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def _launched_env(rank: int, world: int) -> None:
    """The torchelastic variables: Lightning takes the ranks from them and starts no workers."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


def _strategy(side: str, options: dict):
    if side == "ddp":
        return "ddp"
    from fusedist.integrations.lightning import FusedistStrategy

    return FusedistStrategy(**options)


def _trainer(side, cfg, root, extra_callbacks=(), **kwargs):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.precision import MixedPrecision

    precision, plugins = cfg.get("precision", "32-true"), None
    if precision == "16-mixed":
        # Lightning turns precision="16-mixed" into bf16 on a CPU; the plugin keeps fp16 and its scaler.
        precision, plugins = None, [MixedPrecision("16-mixed", "cpu")]
    recorder = _recorder()
    callbacks = [recorder, *extra_callbacks]
    if root is not None:
        # At the end of each epoch: Lightning resumes a mid-epoch checkpoint from the start of
        # its epoch's data (for its own DDP too), so only an epoch boundary continues exactly.
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(root, side), every_n_epochs=1, save_top_k=-1,
                                         save_on_train_epoch_end=True, filename="{epoch}"))
    trainer = L.Trainer(
        strategy=_strategy(side, cfg.get("fusedist", {})), accelerator="cpu", devices=2, num_nodes=1,
        precision=precision, plugins=plugins, max_epochs=EPOCHS,
        accumulate_grad_batches=1 if cfg.get("manual") else cfg.get("accumulate", 2),
        gradient_clip_val=None if cfg.get("manual") else cfg.get("clip", 0.5),
        gradient_clip_algorithm=cfg.get("clip_by", "norm"), val_check_interval=4, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=root is not None, callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False, deterministic=True, use_distributed_sampler=True,
        sync_batchnorm=bool(cfg.get("sync_bn")) and side == "fusedist", **kwargs)
    return trainer, recorder


def _with_batch_norm(net, side):
    """``net`` with a BatchNorm after its first layer. Lightning's DDP converts it to torch's
    SyncBatchNorm, which refuses CPU tensors, so its side gets the reference of the DDP recipe
    test: batch norm over the batch gathered from every rank (what SyncBatchNorm computes).
    The layer before it has no bias, as usual: the norm cancels a bias, whose gradient is then
    rounding noise that AdamW turns into whole steps of either sign, different on each side,
    and the running means (validation) with them."""
    from test_e2e_ddp_recipe import _GatheredBatchNorm

    first = nn.Linear(IN, HIDDEN, bias=False)
    first.weight = net[0].weight
    norm = (_GatheredBatchNorm if side == "ddp" else nn.BatchNorm1d)(HIDDEN)
    return nn.Sequential(first, norm, *net[1:])


def _fit(side, cfg, seed, root=None, ckpt_path=None):
    torch.manual_seed(0)
    module = _module_class()(cfg.get("optimizer", "adamw"), manual=cfg.get("manual", False))
    if cfg.get("sync_bn"):
        module.net = _with_batch_norm(module.net, side)
    trainer, recorder = _trainer(side, cfg, root)
    trainer.fit(module, _data(seed, cfg.get("samples", SAMPLES)), _data(seed + 1, 16), ckpt_path=ckpt_path)
    return trainer, module, dict(recorder.records, **module.log_)


def _final_state(trainer) -> dict:
    """The optimizer state as a checkpoint holds it (consolidated on rank 0 for ZeRO), the
    scheduler's and the scaler's."""
    ckpt = trainer._checkpoint_connector.dump_checkpoint()
    opt = ckpt["optimizer_states"][0]
    state = {i: {k: torch.as_tensor(v).float() for k, v in s.items()} for i, s in opt.get("state", {}).items()}
    sched = {k: v for k, v in ckpt["lr_schedulers"][0].items() if k != "lr_lambdas"}
    return {"opt": state, "sched": sched, "precision": ckpt.get("MixedPrecision"),
            "global_step": trainer.global_step, "optimizer": type(trainer.optimizers[0]).__name__}


def _side_by_side_worker(rank, world, cfg, seed, root):
    _launched_env(rank, world)
    out = {}
    for side in ("ddp", "fusedist"):
        trainer, module, log = _fit(side, cfg, seed, root if cfg.get("resume") else None)
        out[side] = dict(log, **_final_state(trainer))
    if cfg.get("resume"):
        # Each strategy's checkpoint of the first epoch, resumed by fusedist's in a fresh Trainer.
        for side in ("fusedist", "ddp"):
            ckpt = os.path.join(root, side, "epoch=0.ckpt")
            trainer, module, log = _fit("fusedist", cfg, seed, ckpt_path=ckpt)
            out[f"resumed from {side}"] = dict(log, **_final_state(trainer))
        # And the other way: Lightning's DDP resumes this strategy's checkpoint.
        trainer, module, log = _fit("ddp", cfg, seed, ckpt_path=os.path.join(root, "fusedist", "epoch=0.ckpt"))
        out["ddp resumed from fusedist"] = dict(log, **_final_state(trainer))
    return out


# ----------------------------------------------------------------------------- comparisons
def _close(a, b, tol: float, scaled: bool = False) -> bool:
    """``|a - b| <= tol``; with ``scaled``, ``tol`` is for values of order 1 and grows with
    larger ones: ``|a - b| <= tol * max(1, |b|)``."""
    if a is None or b is None:
        return a is b
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if a.shape != b.shape or not torch.equal(a.isfinite(), b.isfinite()):
        return False
    # fp16 steps the scaler skips have non-finite gradients on both sides (inf, or nan once a
    # clip multiplied them by 0).
    fin = a.isfinite()
    allowed = tol * b[fin].abs().clamp_min(1.0) if scaled else tol
    return bool(((a[fin] - b[fin]).abs() <= allowed).all())


def _compare(ours: dict, ref: dict, tol, what: str, norms: bool = True, opt: bool = True) -> None:
    """``tol`` is one tolerance for everything, or a dict of them by key with a ``"state"``
    entry for the weights and the optimizer state and an ``"outputs"`` one for the rest.

    The tolerances are for values of order 1 (the weights, the optimizer state, the mean
    validation loss). The training loss is a sum over a micro-batch's 12 outputs and the
    gradient norm one of all gradients: values up to ~15, whose ulps are 8-16 times those of
    order 1, so the outputs' tolerance scales with the value (an fp32 loss of order 10 was 3 ulps,
    2.9e-6, apart, and an fp16-autocast one 2.0e-4 after an fp16 weight rounded the other way)."""
    tols = tol if isinstance(tol, dict) else {"state": tol, "outputs": tol}
    keys = ("loss", "val", "lr", "weights") + (("norm",) if norms else ())
    for key in keys:
        assert len(ours[key]) == len(ref[key]), f"{what}: {key}: {len(ours[key])} entries against {len(ref[key])}"
        key_tol = tols["state"] if key == "weights" else tols["outputs"]
        for i, (a, b) in enumerate(zip(ours[key], ref[key])):
            scaled = key != "weights"
            assert _close(a, b, key_tol, scaled), \
                (f"{what}: {key}[{i}] differ by more than {key_tol}{' x max(1, |value|)' if scaled else ''}:\n"
                 f" ours {a}\n ddp  {b}")
    assert ours["global_step"] == ref["global_step"], what
    if not opt:  # a ZeRO optimizer's state is consolidated on rank 0 only
        ref = dict(ref, opt={})
    assert ours["opt"].keys() == ref["opt"].keys(), \
        f"{what}: optimizer state of {ours['opt'].keys()} vs {ref['opt'].keys()}"
    for i, state in ref["opt"].items():
        for k, v in state.items():
            assert _close(ours["opt"][i][k], v, tols["state"]), f"{what}: optimizer state {i}.{k} differs"
    assert ours["sched"]["last_epoch"] == ref["sched"]["last_epoch"], what
    assert _close(ours["sched"]["_last_lr"], ref["sched"]["_last_lr"], 1e-12), what
    # fusedist's GradScaler state has torch's keys and a few of its own (hysteresis).
    mine = ours["precision"] and {k: ours["precision"].get(k) for k in ref["precision"] or {}}
    assert mine == ref["precision"], f"{what}: scaler {ours['precision']} vs {ref['precision']}"


def _second_epoch(run: dict, batches: int) -> dict:
    """The uninterrupted run as the one resumed after the first epoch logs it (``batches``
    micro-batches per rank and epoch; every epoch validates alike)."""
    steps, vals = (batches + 1) // 2, len(run["val"]) // EPOCHS
    return dict(run, loss=run["loss"][batches:], val=run["val"][vals:],
                **{k: run[k][steps:] for k in ("norm", "weights", "lr")})


# Tolerances, by the dtype of the arithmetic:
# * fp32 (fp32 weights, fused AdamW/SGD kernels against torch's foreach ops, fusedist's bucketed
#   all-reduce against torch's): the same operations in another order, an ulp or two of values of
#   order 1 per step, compounded over 8 steps: 1e-5. A missed clip, scale or accumulation changes
#   the weights by 1e-3 or more.
# * bf16 / fp16 autocast: the matmuls round to 8 / 11 significant bits, but both sides run the
#   same autocast kernels on the same inputs, so the rounding is the same; what differs is the
#   fp32 order of the optimizer and the reduction, which a bf16 matmul can turn into a
#   neighbouring bf16 value (2^-8 relative) now and then: 1e-3 on values of order 1.
# * fp64: the fp32 argument with ulps of 2^-52 instead of 2^-23: 1e-12.
# * bf16-true with a fused optimizer: None, not compared with Lightning's DDP, which updates the
#   bf16 weights in place where the fused optimizer keeps FP32 masters (a different, intended
#   result); only the resume is checked, bit for bit, which needs the masters in the checkpoint.
# ``moved`` (default 1e-2): how far some weight must move from the first step to the last, so
# that the comparison is not of two runs that did not train (it must exceed the weights'
# tolerance several times over). AdamW moves a weight whose gradient keeps its sign by the
# sum of the learning rates, 0.026 here, whatever the data; SGD moves by the data's gradients
# and fp16 AdamW by as many steps as the GradScaler does not skip (2 or 3 of the first steps,
# by the data), so those cases set their own bound below the least movement measured over 60
# runs of random data.
CASES = {
    "fused AdamW, fp32, accumulate 2, clip": (dict(resume=True), 1e-5),
    # moved: 0.0148 at least (3 skipped steps); one more skip takes ~5e-3 off.
    "ZeRO 1, fused AdamW, fp16-mixed, clip": (dict(precision="16-mixed", fusedist=dict(zero_stage=1), resume=True,
                                                   moved=5e-3), 1e-3),
    # 7 micro-batches per rank and epoch: the last step of each epoch accumulates only one.
    # moved: 0.014 at least.
    "ZeRO 2, fused SGD, bf16-mixed, clip, odd epoch": (dict(precision="bf16-mixed", optimizer="sgd", samples=56,
                                                            fusedist=dict(zero_stage=2), resume=True,
                                                            moved=5e-3), 1e-3),
    "manual optimization, fused AdamW, bf16-mixed": (dict(manual=True, precision="bf16-mixed", resume=True), 1e-3),
    # The module clips before Lightning's fp16 unscale: the scaled gradients, so the steps are
    # ~1e-4 (Note [clipping before the unscale]); an unclipped step moves the weights by 5e-2.
    # Steps that small keep the FP32 weights and momenta within 1e-5 (so a missed clip or step
    # shows), while the losses, computed by fp16 matmuls, take the fp16 rule: a weight an ulp
    # away can round an fp16 output to its neighbour (2^-11 relative). moved: 8.2e-4 at least
    # (3 or 4 skipped steps), so 2e-4, 20 times the weights' tolerance.
    "manual optimization, ZeRO 1, fused SGD, fp16-mixed": (dict(manual=True, precision="16-mixed", optimizer="sgd",
                                                                fusedist=dict(zero_stage=1), moved=2e-4),
                                                           {"state": 1e-5, "outputs": 1e-3}),
    # Welford statistics against the reference's two-pass batch norm: an ulp (1e-7) in fp32.
    "sync_batchnorm, ZeRO 1, fused AdamW, fp32": (dict(sync_bn=True, fusedist=dict(zero_stage=1)), 1e-5),
    "fused AdamW, 64-true": (dict(precision="64-true"), 1e-12),
    "ZeRO 2, fused AdamW, bf16-true": (dict(precision="bf16-true", resume=True,
                                            fusedist=dict(zero_stage=2)), None),
    # moved: 0.0151 at least (3 skipped steps).
    "fused AdamW, fp16-mixed, clip by value": (dict(precision="16-mixed", clip_by="value", clip=0.05,
                                                    moved=5e-3), 1e-3),
    # moved: 0.0113 at least (each gradient element clipped to 0.05, steps of lr 0.02 or less).
    "ZeRO 1, fused SGD, fp32, clip by value": (dict(optimizer="sgd", clip_by="value", clip=0.05,
                                                    fusedist=dict(zero_stage=1), moved=2e-3), 1e-5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_lightning_recipe_matches_lightning_ddp(case, shared_launch):
    cfg, tol = CASES[case]
    seed, per_rank = shared_launch[case]
    for rank, res in enumerate(_outcome(per_rank, case)):
        what = f"{case}, rank {rank}, data seed {seed}"
        stage2 = cfg.get("fusedist", {}).get("zero_stage") == 2
        # The norms are of p.grad when the step begins: in manual optimization that is after the
        # module's clip, which ZeRO applies inside its step and not to p.grad.
        zero_manual = "zero_stage" in cfg.get("fusedist", {}) and cfg.get("manual")
        zero_elsewhere = rank != 0 and "zero_stage" in cfg.get("fusedist", {})
        if tol is not None:
            _compare(res["fusedist"], res["ddp"], tol, what, norms=not (stage2 or zero_manual), opt=not zero_elsewhere)
        batches = cfg.get("samples", SAMPLES) // (2 * BATCH)
        assert res["fusedist"]["global_step"] == EPOCHS * ((batches + 1) // 2), what
        moved = (res["fusedist"]["weights"][-1] - res["fusedist"]["weights"][0]).abs().max()
        assert moved > cfg.get("moved", 1e-2), what
        if cfg.get("resume"):
            # The same process, data and arithmetic as the uninterrupted run: bit for bit.
            _compare(res["resumed from fusedist"], _second_epoch(res["fusedist"], batches), 0.0,
                     f"{what}, resumed after epoch 1", norms=not (stage2 or zero_manual), opt=not zero_elsewhere)
            if tol is None:
                continue
            # Lightning's DDP checkpoint (torch's optimizer and GradScaler state) continues as
            # Lightning's DDP run does.
            _compare(res["resumed from ddp"], _second_epoch(res["ddp"], batches), tol,
                     f"{what}, resumed from strategy='ddp' after epoch 1", norms=not (stage2 or zero_manual),
                     opt=not zero_elsewhere)
            _compare(res["ddp resumed from fusedist"], _second_epoch(res["ddp"], batches), tol,
                     f"{what}, strategy='ddp' resumed after epoch 1", norms=not (stage2 or zero_manual))


def _stage2_clip_by_value_worker(rank, world, seed):
    _launched_env(rank, world)
    _fit("fusedist", dict(clip_by="value", fusedist=dict(zero_stage=2)), seed)


def test_clip_by_value_on_zero_stage_2_is_refused(shared_launch):
    """Stage 2 keeps no p.grad for torch's clip by value to clamp (Note [clipping by value on
    stage 2]): torch's clip used to fail on the empty list of gradients with an internal
    message; now every rank stops at the first clip with one that names the setting."""
    seed, per_rank = shared_launch["clip by value on stage 2"]
    for value in per_rank:
        assert isinstance(value, str) and "gradient_clip_algorithm='value'" in value, (seed, str(value)[-2000:])


def _comm_hook_worker(rank, world, seed):
    """Final weights with no hook, with torch's bf16 compress hook, with allreduce_hook in
    torch's bf16 compress wrapper, and in a wrapper of the user's own (run as a hook of torch's
    interface)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as d

    _launched_env(rank, world)
    runs = {"plain": {}, "hook": dict(ddp_comm_hook=d.bf16_compress_hook),
            "wrapped": dict(ddp_comm_hook=d.allreduce_hook, ddp_comm_wrapper=d.bf16_compress_wrapper)}
    # (half the recipe's data: 2 optimizer steps per epoch are enough to compare bits)
    out = {name: _fit("fusedist", dict(fusedist=options, samples=HOOK_SAMPLES), seed)[2]["weights"][-1]
           for name, options in runs.items()}
    calls = []

    def counting(hook):
        def counted(state, bucket):
            calls.append(bucket.index())
            return hook(state, bucket)
        return counted

    out["own wrapper"] = _fit("fusedist", dict(fusedist=dict(ddp_comm_hook=d.allreduce_hook,
                                                             ddp_comm_wrapper=counting), samples=HOOK_SAMPLES),
                              seed)[2]["weights"][-1]
    out["calls"] = len(calls)
    return out


def test_comm_hook_wrapper_is_applied(shared_launch):
    """``ddp_comm_wrapper`` used to be dropped: the hook ran unwrapped, without the bf16
    compression asked for (Note [communication hook wrappers]). Lightning's own DDP registers
    hooks on CUDA only, so the reference is fusedist with torch's bf16 compress hook."""
    seed, per_rank = shared_launch["communication hooks"]
    for rank, res in enumerate(_outcome(per_rank, "communication hooks")):
        what = f"rank {rank}, data seed {seed}"
        assert torch.equal(res["wrapped"], res["hook"]), what
        assert not torch.equal(res["wrapped"], res["plain"]), what  # the compression rounds
        # allreduce_hook divides by 2 before the sum as fusedist's own average does: the same bits.
        assert torch.equal(res["own wrapper"], res["plain"]) and res["calls"] > 0, what


# ----------------------------------------------------------------------------- one launch
# The jobs of the tests of this file that pytest runs go into the launch of 2 ranks shared with
# the other Lightning and Fabric files (test_lightning_launch.py), in sequence (each launch costs a
# process group and the imports of torch and Lightning in every rank); the refusal runs last of
# this file's, as its ranks stop inside a Trainer.
_FOCUSED = {"communication hooks": ("test_comm_hook_wrapper_is_applied", _comm_hook_worker),
            "clip by value on stage 2": ("test_clip_by_value_on_zero_stage_2_is_refused",
                                         _stage2_clip_by_value_worker)}
SEEDS = {job: random.randrange(2**31) for job in [*CASES, *_FOCUSED]}  # data seeds, fresh each run


def _job(rank, world, job, seed, root):
    """A recipe case (side by side, its own checkpoint folder) or a focused check."""
    if job in CASES:
        where = os.path.join(root, f"case{list(CASES).index(job)}")
        return _side_by_side_worker(rank, world, CASES[job][0], seed, where)
    return _FOCUSED[job][1](rank, world, seed)


def _jobs(tmp_path_factory):
    """Each recipe case as a test of its own (a case selected alone runs alone), then the
    focused checks."""
    root = str(tmp_path_factory.mktemp("lightning"))
    jobs = {f"test_lightning_recipe_matches_lightning_ddp[{case}]": {case: (_job, (case, SEEDS[case], root))}
            for case in CASES}
    return {**jobs, **{test: {job: (_job, (job, SEEDS[job], root))} for job, (test, _) in _FOCUSED.items()}}


test_lightning_launch.register(_jobs, seconds=600)


@pytest.fixture(scope="module")
def shared_launch(request, tmp_path_factory):
    """{job: (data seed, per-rank results: what the rank returned, or the traceback it raised)}
    for the jobs of the tests of this file that pytest runs."""
    launched = test_lightning_launch.shared_launch(request, tmp_path_factory)
    return {job: (SEEDS[job], [value for _, value in per_rank]) for job, per_rank in launched.items()}


def _outcome(per_rank: list, job: str) -> list:
    """The per-rank results of ``job``; a rank that raised fails the test with its traceback."""
    for rank, res in enumerate(per_rank):
        assert not isinstance(res, str), f"{job}, rank {rank} raised:\n{res}"
    return per_rank
