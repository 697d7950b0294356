"""A torchtitan-style training recipe run end to end with ``fusedist.fully_shard`` and with
torch's FSDP2 ``fully_shard`` side by side, 2 gloo ranks; torch's run is the reference.

The recipe: a small GPT-like model (token embedding, learned positions, MLP blocks with
LayerNorm, a final norm, an output head tied to the embedding) built on the meta device, each
block wrapped in torch's non-reentrant ``checkpoint_wrapper`` (and, in one variant, compiled:
``torch.compile(block, fullgraph=True)`` with the ``aot_eager`` backend, no C++ toolchain
needed) and sharded, then the root; ``to_empty`` and the library's initialization (fusedist:
``init_parameters``; its equality with the unsharded init is tests/test_fully_shard_meta_init.py's),
then one whole initial state dict loaded into both with ``set_model_state_dict(full_state_dict=
True)`` -- from rank 0 only (``broadcast_from_rank0``) in the bf16 variant -- since torch's own
init draws the same numbers on every rank of a CPU mesh, so the two could not otherwise start
equal. AdamW with a LambdaLR warmup, 2 micro-batches per step (no gradient sync on the first),
the global norm clipped at 1.0 (``fusedist.clip_grad_norm_`` vs torch's on DTensors, returned
norms compared; the norm is above 1 in most steps, below in the last), a validation forward
under ``torch.no_grad()`` in eval mode after every step, and at step SAVE_AT a
``dcp.async_save`` of ``get_state_dict(model, opt)`` plus the scheduler, on a gloo group of its
own, while training goes on to STEPS. A second launch (fresh processes) rebuilds every run on
meta, loads its step-SAVE_AT checkpoint with ``dcp.load`` + ``set_state_dict`` and trains to
STEPS -- and fusedist models (both optimizers) load torch's checkpoint too. The compiled variant saves and loads
the optimizer state flattened (``flatten_optimizer_state_dict=True``), as torchtitan does.

Tolerances. The two libraries gather the same values, run the same ops and average two partial
gradients (a + b, then / 2: exact either way); without clipping their runs are equal bit for bit
in fp32 and in bf16. What differs is the global norm's summation order (torch adds per-parameter
norms, fusedist sums squares over its flat shards), so the clip factor's last bit:
* fp32: losses, norms and weights within FP32_TOL = 2e-6 (observed <= 5e-7: a last-bit change
  of the clip factor carried through 4 Adam steps; a wrong row, a missed micro-batch or a step
  at the wrong learning rate is off by > 1e-3);
* bf16 params, fp32 reduce: the last-bit change of an fp32 master weight flips a bf16 rounding
  now and then (8 mantissa bits, ~4e-3 relative), and the flips grow over the steps, so the
  runs are as close as bf16 lets them be: losses and norms within 1e-3 relative (observed
  5e-5), no weight a whole Adam step (LR) apart, and the mean weight difference under half of
  what bf16 itself changes (torch's bf16 run against its fp32 run: observed 1e-6 against 6e-4;
  a systematic error -- a gradient reduced in bf16, a micro-batch dropped -- moves the run at
  least as far as bf16 does);
* ``fusedist.optim.FusedAdamW`` against torch.optim.AdamW: the same formula evaluated fused
  (clip factor folded in), last-bit differences, the same bounds;
* a compiled block (aot_eager) against the eager run of the same library: FP32_TOL;
* resumed against uninterrupted, same library: the same operations on the same values, bit
  for bit; fusedist resumed from torch's checkpoint against torch uninterrupted: the bounds of
  the cross-library comparison.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fusedist.testing import run_distributed

WS = 2
VOCAB, DIM, SEQ, N_BLOCKS = 48, 32, 8, 3
MICRO = 2            # micro-batches per step
LOCAL_BATCH = 2      # sequences per rank per micro-batch
STEPS, SAVE_AT = 4, 2  # saved mid-warmup: a resume that lost the scheduler steps at 2/3 LR after
LR, WARMUP = 2e-2, 3   # (and LR large enough for the clip to act in 3 steps of 4, not in the last)
SEED = 7
VALIDATION_STEP = 99  # the held-out batch: one no training step draws

FP32_TOL = 2e-6
BF16_RTOL = 1e-3
BF16_MAX = LR
BF16_MEAN_OF_BF16_EFFECT = 0.5

KINDS = ("torch", "ours", "ours_fused")   # torch FSDP2, fusedist + torch AdamW, fusedist + FusedAdamW
VARIANTS = ("fp32", "bf16", "fp32_compiled")


# ----------------------------------------------------------------------------------- the model
class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(N_BLOCKS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied: both in the root's unit, as torch requires

    def forward(self, idx):
        x = self.tok(idx) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def _initial_state() -> dict:
    """The whole initial weights both libraries load: random everywhere (LayerNorm affines and
    positions too, so no parameter starts at a value that hides a wrong row), large enough
    that the clip at 1.0 acts in most steps."""
    torch.manual_seed(SEED)
    model = TinyGPT()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("norm.weight") else 0.0))
    return {k: v.clone() for k, v in model.state_dict().items()}


def _batch(step: int, micro: int, rank: int):
    """This rank's slice of the global micro-batch (inputs, next-token targets)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, VOCAB, (WS * LOCAL_BATCH, SEQ + 1), generator=g)
    mine = tokens[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]
    return mine[:, :-1], mine[:, 1:]


# --------------------------------------------------------------------------------- the recipe
def _fully_shard(kind):
    if kind == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from fusedist import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def _build(kind: str, variant: str, init_sd: dict | None):
    """Meta, activation checkpointing (and compile), fully_shard per block then the root,
    to_empty, the library's init, then ``init_sd`` when given (on rank 0 only in bf16)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist

    fully_shard, MixedPrecisionPolicy = _fully_shard(kind)
    bf16 = variant.startswith("bf16")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    mesh = init_device_mesh("cpu", (WS,))
    with torch.device("meta"):
        model = TinyGPT()
    for i, block in enumerate(model.blocks):
        block = checkpoint_wrapper(block, preserve_rng_state=False)
        if variant.endswith("compiled"):
            block = torch.compile(block, backend="aot_eager", fullgraph=True)
        fully_shard(block, mesh=mesh, mp_policy=mp)
        model.blocks[i] = block
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device="cpu")
    if kind != "torch":
        fusedist.fsdp.init_parameters(model)
    else:
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
    if init_sd is not None:
        # (a copy: torch's helper puts its distributed values into the dict it is given)
        sd = {} if bf16 and dist.get_rank() != 0 else dict(init_sd)
        set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=bf16))
    return model


def _optimizer(kind, model):
    import fusedist

    cls = fusedist.optim.FusedAdamW if kind == "ours_fused" else torch.optim.AdamW
    opt = cls(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
    return opt, sched


def _clip(kind, model) -> float:
    import fusedist

    if kind == "torch":
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    return float(fusedist.clip_grad_norm_(model.parameters(), 1.0))


def _global_mean(value: torch.Tensor) -> float:
    dist.all_reduce(value)
    return value.item() / WS


@torch.no_grad()
def _validate(model, rank) -> float:
    """A validation forward on a held-out batch (eval mode, no autograd), between steps."""
    model.eval()
    x, y = _batch(VALIDATION_STEP, 0, rank)
    loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
    model.train()
    return _global_mean(loss)


def _step(model, opt, sched, kind, rank, step) -> tuple[float, float, float]:
    """One optimizer step over MICRO micro-batches, then a validation forward:
    (global mean loss, pre-clip norm, validation loss)."""

    total = torch.zeros(())
    for micro in range(MICRO):
        model.set_requires_gradient_sync(micro == MICRO - 1)
        x, y = _batch(step, micro, rank)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()) / MICRO
        loss.backward()
        total += loss.detach()
    norm = _clip(kind, model)
    opt.step()
    sched.step()
    opt.zero_grad()
    return _global_mean(total), norm, _validate(model, rank)


def _full(model) -> dict:
    """Whole weights (fp32), by torch's helper (both libraries answer it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().float().clone() for k, v in sd.items()}


CURVES = ("losses", "norms", "evals")


def _record(curves: list, model) -> dict:
    """The per-step curves (CURVES, from ``_step``'s triples) and the final whole weights."""
    out = {name: [c[i] for c in curves] for i, name in enumerate(CURVES)}
    out["weights"] = _full(model)
    return out


def _options(variant: str):
    """The compiled variant saves as torchtitan does (the optimizer state flattened to one key
    per parameter and state name); the others with the helpers' defaults."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=variant.endswith("compiled"))


def _ckpt_state(model, opt, sched, variant) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt, options=_options(variant))
    return {"model": msd, "optim": osd, "sched": sched.state_dict()}


def _load_ckpt(model, opt, sched, variant, where) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _ckpt_state(model, opt, sched, variant)
    dcp.load(state, checkpoint_id=where)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_options(variant))
    sched.load_state_dict(state["sched"])


def _train_worker(rank, ws, init_sd, where):
    """Every (variant, kind) trained STEPS steps, saved asynchronously at SAVE_AT."""
    import torch.distributed.checkpoint as dcp

    ckpt_group = dist.new_group(backend="gloo")
    out = {}
    for variant in VARIANTS:
        for kind in KINDS:
            model = _build(kind, variant, init_sd)
            opt, sched = _optimizer(kind, model)
            curves, future = [], None
            for step in range(STEPS):
                if step == SAVE_AT:
                    future = dcp.async_save(_ckpt_state(model, opt, sched, variant),
                                            checkpoint_id=os.path.join(where, variant, kind),
                                            process_group=ckpt_group)
                curves.append(_step(model, opt, sched, kind, rank, step))
            future.result()
            out[variant, kind] = _record(curves, model)
    return out


def _resume_worker(rank, ws, where):
    """Fresh processes: every run rebuilt on meta (its own init, no initial state), loaded from
    the step-SAVE_AT checkpoint and trained to STEPS; and a fusedist model from torch's."""
    out = {}
    for variant in VARIANTS:
        for kind, saved_by in [(k, k) for k in KINDS] + [("ours", "torch"), ("ours_fused", "torch")]:
            model = _build(kind, variant, None)
            opt, sched = _optimizer(kind, model)
            _load_ckpt(model, opt, sched, variant, os.path.join(where, variant, saved_by))
            curves = [_step(model, opt, sched, kind, rank, step) for step in range(SAVE_AT, STEPS)]
            out[variant, kind, saved_by] = _record(curves, model)
    return out


# ------------------------------------------------------------------------------------ the test
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    where = str(tmp_path_factory.mktemp("recipe"))
    trained = run_distributed(_train_worker, WS, _initial_state(), where, timeout=240)
    resumed = run_distributed(_resume_worker, WS, where, timeout=240)
    return trained, resumed


def _weight_diffs(a: dict, b: dict) -> tuple[float, float]:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    diffs = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    return diffs.max().item(), diffs.mean().item()


def _assert_close_runs(ref: dict, got: dict, variant: str, what, bf16_effect: float = 0.0):
    if not variant.startswith("bf16"):
        for name in CURVES:
            worst = max(abs(r - g) for r, g in zip(ref[name], got[name]))
            assert worst <= FP32_TOL, (what, name, ref[name], got[name])
        worst, _ = _weight_diffs(ref["weights"], got["weights"])
        assert worst <= FP32_TOL, (what, worst)
        return
    for name in CURVES:
        for r, g in zip(ref[name], got[name]):
            assert abs(r - g) <= BF16_RTOL * abs(r), (what, name, ref[name], got[name])
    worst, mean = _weight_diffs(ref["weights"], got["weights"])
    assert worst <= BF16_MAX and mean <= BF16_MEAN_OF_BF16_EFFECT * bf16_effect, (what, worst, mean, bf16_effect)


def _bf16_effect(trained_rank: dict) -> float:
    """Mean weight difference between torch's bf16 run and its fp32 run."""
    return _weight_diffs(trained_rank["fp32", "torch"]["weights"], trained_rank["bf16", "torch"]["weights"])[1]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", ["ours", "ours_fused"])
def test_fusedist_matches_torch_fsdp2(runs, variant, kind):
    trained, _ = runs
    for rank in range(WS):
        ref, got = trained[rank][variant, "torch"], trained[rank][variant, kind]
        assert all(math.isfinite(x) for x in ref["losses"])
        assert ref["losses"][-1] < ref["losses"][0]  # the recipe trains
        assert max(ref["norms"]) > 1.0 > ref["norms"][-1]  # the clip acts, and then not
        assert got["losses"][0] == ref["losses"][0]  # the same initial weights, the same batch
        _assert_close_runs(ref, got, variant, (rank, kind), _bf16_effect(trained[rank]))


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_blocks_match_eager(runs, kind):
    trained, _ = runs
    for rank in range(WS):
        _assert_close_runs(trained[rank]["fp32", kind], trained[rank]["fp32_compiled", kind], "fp32", (rank, kind))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", KINDS)
def test_resumed_run_equals_uninterrupted(runs, variant, kind):
    trained, resumed = runs
    for rank in range(WS):
        whole, again = trained[rank][variant, kind], resumed[rank][variant, kind, kind]
        for name in CURVES:
            assert again[name] == whole[name][SAVE_AT:], (rank, name, again[name], whole[name])
        worst, _ = _weight_diffs(whole["weights"], again["weights"])
        assert worst == 0.0, (rank, worst)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", ["ours", "ours_fused"])
def test_fusedist_resumes_from_torch_checkpoint(runs, variant, kind):
    trained, resumed = runs
    for rank in range(WS):
        whole, again = trained[rank][variant, "torch"], resumed[rank][variant, kind, "torch"]
        ref = {name: whole[name][SAVE_AT:] for name in CURVES} | {"weights": whole["weights"]}
        _assert_close_runs(ref, again, variant, (rank, kind), _bf16_effect(trained[rank]))
