"""Gradient clipping and loss scaling across pipeline stages, against torch on the whole model.

* torchtitan's ``clip_grad_norm_(..., pp_mesh=...)`` (``get_total_norm`` of the stage's
  ``p.grad``, combined over the pipeline group in place, then ``clip_grads_with_norm_``) on
  stages of fusedist DDP, ZeRO-1, ZeRO-2 and ``fully_shard`` over a 2 (pp) x 2 (dp) gloo mesh:
  the norm it returns and the clipped SGD step equal torch's ``clip_grad_norm_`` over every
  stage's parameters in one process (Note [torchtitan's clip across pipeline stages of stage 2]
  in fusedist/optim/torch_clip.py; a ZeRO-2 stage keeps no ``p.grad``, and used to clip by its
  own norm).
* ``GradScaler(found_inf_group=...)``: an inf in one stage's gradients skips every stage's step
  and backs the scale off on every rank, as torch's scaler over the whole model does (Note
  [found_inf over the pipeline stages] in fusedist/amp/grad_scaler.py).
* DDP stages whose data-parallel peers diverged in a step (one ran an extra forward) raise at that
  step's end on every rank, before any optimizer step (Note [the step check's verdict read at the
  step's end] in fusedist/pipelining/step_verdict.py): 1F1B, interleaved 1F1B and one-rank pipelines.

The clip runs after a 1F1B step of ``fusedist.pipelining.PipelineStage`` stages (the reference:
the whole model on the global batch); the scaler's stages run their own losses (what a schedule
leaves for it), the reference the sum of those losses on one model.
Tolerances: fp32 sums in other orders (1e-6 relative on norms, 1e-6 on weights); a stage
clipped by its own norm, or stepping through an overflow, is 1e-4 to 1e-2 away.
"""

from __future__ import annotations

import gc
import math
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shared_rank_launch import launch_for_selected, results_of, under_env

WIDTH, STAGES = 8, 2


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))


def _titan_clip(parameters, max_norm, norm_type, pp_group):
    """torchtitan's ``clip_grad_norm_`` with a pipeline mesh (torchtitan/distributed/utils.py)."""
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm(grads, norm_type)
    if math.isinf(norm_type):
        dist.all_reduce(total_norm, op=dist.ReduceOp.MAX, group=pp_group)
    else:
        total_norm **= norm_type
        dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=pp_group)
        total_norm **= 1.0 / norm_type
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm)
    return total_norm


def _stage(kind: str, seed: int, mesh):
    """This rank's stage (module to run, module whose weights to compare, optimizer)."""
    import fusedist

    model = _model(seed)
    if kind == "fully_shard":
        fusedist.fully_shard(model, mesh=mesh["dp"])
        return model, model, torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = fusedist.DistributedDataParallel(model, process_group=mesh["dp"].get_group())
    if kind == "ddp":
        return ddp, model, torch.optim.SGD(ddp.parameters(), lr=0.1)
    opt = fusedist.ZeroRedundancyOptimizer(list(ddp.parameters()), torch.optim.SGD,
                                           process_group=mesh["dp"].get_group(), stage=int(kind[-1]), lr=0.1)
    return ddp, model, opt


def _weights(kind: str, model) -> list:
    if kind != "fully_shard":
        return [p.detach() for p in model.parameters()]
    from fusedist.fsdp import full_state_dict

    state = full_state_dict(model)
    return [state[name] for name, _ in model.named_parameters()]


def _titan_clip_worker(rank, world_size, seed, kinds, norm_types):
    """Each stage kind and norm order under 1F1B: |norm - torch's| / torch's and the weights'
    largest difference from torch's clipped SGD step over the whole model on the global batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B

    from fusedist.pipelining import PipelineStage

    mesh = init_device_mesh("cpu", (STAGES, world_size // STAGES), mesh_dim_names=("pp", "dp"))
    stage, dp, dps = rank // mesh["dp"].size(), mesh["dp"].get_local_rank(), mesh["dp"].size()
    out = {}
    for kind in kinds:
        for norm_type in norm_types:
            g = torch.Generator().manual_seed(seed + len(out))
            xs, ys = ([torch.randn(4, WIDTH, generator=g) for _ in range(dps)] for _ in range(2))
            run, model, opt = _stage(kind, seed + stage, mesh)
            pipeline = PipelineStage(run, stage, STAGES, torch.device("cpu"), group=mesh["pp"].get_group())
            schedule = Schedule1F1B(pipeline, n_microbatches=2, loss_fn=lambda o, t: (o - t).square().mean())
            schedule.step(*([xs[dp]] if stage == 0 else []), **({"target": ys[dp]} if stage == STAGES - 1 else {}))
            refs = [_model(seed + k) for k in range(STAGES)]
            (refs[1](refs[0](torch.cat(xs))) - torch.cat(ys)).square().mean().backward()
            ref_params = [p for ref in refs for p in ref.parameters()]
            expected = torch.nn.utils.clip_grad_norm_(ref_params, 0.05, norm_type)
            torch.optim.SGD(ref_params, lr=0.1).step()
            norm = _titan_clip(run.parameters(), 0.05, norm_type, mesh["pp"].get_group())
            opt.step()
            weights = max(float((a - b).abs().max()) for a, b in zip(_weights(kind, model), refs[stage].parameters()))
            out[kind, norm_type] = (abs(float(norm) - float(expected)) / float(expected), weights)
            del run, model, opt, pipeline, schedule
            gc.collect()  # (one stage's optimizer alive at a time, as in a job)
    return out


TITAN_KINDS, TITAN_NORM_TYPES = ("zero2", "ddp", "zero1", "fully_shard"), (2.0, float("inf"))


def test_torchtitans_clip_across_stages_matches_torch_for_every_stage_kind(launched4):
    """torchtitan's clip over the pipeline group gives torch's whole-model norm and clipped
    step on every stage kind; ZeRO-2 stages (no ``p.grad``) clipped by their own norm before."""
    seed = launched4["seed"]
    per_rank = results_of(launched4, "titan clip")
    for rank, out in enumerate(per_rank):
        for (kind, norm_type), (norm, weights) in out.items():
            assert norm < 1e-6 and weights < 1e-6, (seed, rank, kind, norm_type, norm, weights)


def _titan_refused_worker(rank, world_size, seed, case):
    """torchtitan's clip where the norm cannot be right for a ZeRO-2 stage: over only some of its
    parameters, or of a stage made with torch's ``PipelineStage`` (whose optimizer fusedist cannot
    tell from any other): the error's text, None when nothing was raised."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage as TorchPipelineStage

    from fusedist.pipelining import PipelineStage

    mesh = init_device_mesh("cpu", (STAGES, world_size // STAGES), mesh_dim_names=("pp", "dp"))
    run, _, _ = _stage("zero2", seed, mesh)
    cls = TorchPipelineStage if case == "torch's stage" else PipelineStage
    stage = cls(run, rank // mesh["dp"].size(), STAGES, torch.device("cpu"), group=mesh["pp"].get_group())
    run(torch.randn(4, WIDTH)).square().mean().backward()  # (the gradients a schedule leaves)
    params = list(run.parameters())[:2] if case == "some parameters" else list(run.parameters())
    try:
        _titan_clip(params, 0.05, 2.0, mesh["pp"].get_group())
    except ValueError as e:
        return str(e)
    finally:
        del stage
    return None


REFUSED = [("some parameters", "exactly the parameters"), ("torch's stage", "fusedist.pipelining.PipelineStage")]


@pytest.mark.parametrize("case, expected", REFUSED)
def test_torchtitans_clip_a_zero2_stage_cannot_measure_is_refused(case, expected, launched4):
    """The norm of an empty ``p.grad`` list is the stage-2 optimizers' of fusedist's stages:
    clipping only some of their parameters by it, or a stage it did not measure, would not be
    torch's clip (before: each stage clipped by its own norm), so it is refused, naming the fix."""
    for message in results_of(launched4, f"titan refused {case}"):
        assert message is not None and "stage=2" in message and expected in message, message


def _scaler_worker(rank, world_size, seed, kind, lazy):
    """One stage per rank under ``GradScaler(found_inf_group=WORLD)``, an inf in the last
    stage's loss at steps 1 and 3, beside torch's scaler and SGD over the whole model: the
    weights' largest difference, both scales, and which steps were skipped."""
    import fusedist
    from fusedist.amp import GradScaler

    model, refs = _model(seed + rank), [_model(seed + k) for k in range(world_size)]
    run = model
    if kind == "fused":
        opt = fusedist.optim.FusedSGD(model.parameters(), lr=0.1)
    elif kind == "torch":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:  # a ZeRO-2 stage (data-parallel group of one rank)
        own = [dist.new_group([r]) for r in range(world_size)][rank]
        run = fusedist.DistributedDataParallel(model, process_group=own)
        opt = fusedist.ZeroRedundancyOptimizer(list(run.parameters()), torch.optim.SGD, process_group=own,
                                               stage=2, lr=0.1)
    ref_params = [p for ref in refs for p in ref.parameters()]
    ref_opt = torch.optim.SGD(ref_params, lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1, lazy_unscale=lazy,
                        found_inf_group=dist.group.WORLD)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
    g = torch.Generator().manual_seed(seed)
    skipped, scales = [], []
    for step in range(4):
        xs = [torch.randn(4, WIDTH, generator=g) for _ in range(world_size)]
        blowup = [float("inf") if step % 2 and k == world_size - 1 else 1.0 for k in range(world_size)]
        scaler.scale(run(xs[rank]).square().mean() * blowup[rank]).backward()
        ref_scaler.scale(sum(ref(x).square().mean() * b for ref, x, b in zip(refs, xs, blowup))).backward()
        if step % 2 == 0:  # unscale_ then step, and step alone
            scaler.unscale_(opt)
            ref_scaler.unscale_(ref_opt)
        scaler.step(opt)
        ref_scaler.step(ref_opt)
        scaler.update()
        ref_scaler.update()
        skipped.append(scaler.last_step_skipped)
        scales.append((scaler.get_scale(), ref_scaler.get_scale()))
        opt.zero_grad()
        ref_opt.zero_grad()
    weights = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), refs[rank].parameters()))
    return weights, scales, skipped


SCALER_KINDS = ["fused", "torch", "zero2"]


@pytest.mark.parametrize("kind", SCALER_KINDS)
def test_scaler_found_inf_group_skips_every_stage(kind, launched2):
    """An overflow in one stage skips the step of every stage and lowers the scale on every
    rank alike (torch's scaler over the whole model); before, only that stage skipped, and the
    other stage's scale grew away from it."""
    seed = launched2["seed"]
    for lazy in (False, True):
        for rank, (weights, scales, skipped) in enumerate(results_of(launched2, f"scaler {kind} {lazy}")):
            assert skipped == [False, True, False, True], (seed, kind, lazy, rank, skipped)
            assert all(ours == theirs for ours, theirs in scales), (seed, kind, lazy, rank, scales)
            assert weights < 1e-6, (seed, kind, lazy, rank, weights)


def _diverged_peers_worker(rank, world_size, seed, layout, kind="ddp"):
    """``kind`` stages ("ddp", "fully_shard") under ``layout`` -- 1F1B over a 2 (pp) x 2 (dp) mesh,
    interleaved 1F1B (two stages a rank) over it, or 1F1B on one-rank pipelines over a 1 x 4 mesh -- SGD
    stepped after each step; before the first step rank 1 runs one extra training forward of its (first) DDP
    stage module, or puts the Tanh of its (first) fully_shard stage module in eval mode (an extra forward
    there would pair its gathers with the peers' next). (the step that raised, the exception's type and
    text, the largest change of the rank's weights)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

    from fusedist.pipelining import PipelineStage

    pp = 1 if layout == "one-rank pipelines" else STAGES
    mesh = init_device_mesh("cpu", (pp, world_size // pp), mesh_dim_names=("pp", "dp"))
    local = [rank // mesh["dp"].size()] if layout != "interleaved" else [rank // mesh["dp"].size(), 2 + rank // 2]
    stages = len(local) * pp
    built = [_stage(kind, seed + index, mesh) for index in local]
    pipelines = [PipelineStage(run, index, stages, torch.device("cpu"), group=mesh["pp"].get_group())
                 for index, (run, _, _) in zip(local, built)]
    schedule = (ScheduleInterleaved1F1B(pipelines, n_microbatches=2, loss_fn=lambda o, t: (o - t).square().mean())
                if layout == "interleaved" else
                Schedule1F1B(pipelines[0], n_microbatches=2, loss_fn=lambda o, t: (o - t).square().mean()))
    before = [p.detach().clone() for _, model, _ in built for p in model.parameters()]
    first, last = 0 in local, stages - 1 in local
    g = torch.Generator().manual_seed(seed + rank)
    raised = None
    for step in range(2):
        x, y = torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)
        if rank == 1 and step == 0 and kind == "ddp":
            built[0][0](x)  # (a loss computed and dropped: the peers' forward counts now differ)
        elif rank == 1 and step == 0:
            built[0][1][1].eval()  # (the peers' modes now differ)
        try:
            schedule.step(*([x] if first else []), **({"target": y} if last else {}))
        except RuntimeError as e:
            raised = (step, type(e).__name__, str(e))
            break
        for _, _, opt in built:
            opt.step()
            opt.zero_grad()
    after = [p.detach().clone() for _, model, _ in built for p in model.parameters()]
    moved = max(float((p - q).abs().max()) if p.numel() else 0.0 for p, q in zip(after, before))
    del built, pipelines, schedule
    gc.collect()
    return raised, moved


DIVERGED_LAYOUTS = ("1F1B", "interleaved", "one-rank pipelines")
DIVERGED_KINDS = ("ddp", "fully_shard")


@pytest.mark.parametrize("stage_kind", DIVERGED_KINDS)
@pytest.mark.parametrize("layout", DIVERGED_LAYOUTS)
def test_peers_that_diverged_in_a_step_raise_at_its_end_before_the_optimizer_step(layout, stage_kind, launched4):
    """A stage's data-parallel peers at different points (one ran an extra forward) or that ran the step
    differently (a module in eval mode on one), DDP or fully_shard, are named at the step's end, on every rank
    of every pipeline, and no optimizer step applies; before, the step ended, every rank stepped its optimizer
    on gradients reduced across ranks that diverged, and the next step's first forward raised."""
    for rank, (raised, moved) in enumerate(results_of(launched4, f"diverged peers {layout} {stage_kind}")):
        assert raised is not None, (layout, stage_kind, rank, moved)
        step, kind, message = raised
        assert step == 0 and moved == 0.0, (layout, stage_kind, rank, step, moved, message)
        assert "ranks diverged" in message, (layout, stage_kind, rank, message)
        if stage_kind == "ddp":
            counts = re.search(r"forward: ranks \[0(?:, 2, 3)?\]: (\d+); ranks \[1\]: (\d+)", message)
            assert counts and int(counts[2]) == int(counts[1]) + 1, (layout, rank, message)
        else:
            assert re.search(r"modes: ranks \[0(?:, 2, 3)?\] \| ranks \[1\] ran in different modes", message), (
                layout, rank, message)
        assert "before any optimizer step" in message, (layout, stage_kind, rank, message)
        if layout == "one-rank pipelines" or rank // 2 == 0:  # a rank of stage 0: the check's own error
            assert kind == "RankMismatchError", (layout, rank, kind, message)
        else:  # the other stages' ranks: told by their pipeline's exchange
            assert kind == "RuntimeError" and "replicas of stage 0 diverged" in message, (layout, rank, kind, message)


def _refusing_loss(o, t):
    if bool((t == 777).all()):
        raise ValueError("the target of micro-batch 0 is refused")
    return (o - t).square().mean()


def _retry_paired_with_a_late_peer_worker(rank, world_size, seed, kind="ddp"):
    """1F1B over a 2 (pp) x 2 (dp) mesh, ``kind`` stages ("ddp", "fully_shard"), the divergence probe off:
    pipeline 0's last stage refuses micro-batch 0 of the first step (the shape inference fails: the step
    counts as ended), pipeline 0 catches it and takes the next step at once, SGD stepped after each step that
    returns. (each step's error or None, the largest change of the rank's weights)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B

    from fusedist.pipelining import PipelineStage

    mesh = init_device_mesh("cpu", (STAGES, world_size // STAGES), mesh_dim_names=("pp", "dp"))
    stage, dp = rank // mesh["dp"].size(), mesh["dp"].get_local_rank()
    run, model, opt = _stage(kind, seed + stage, mesh)
    pipeline = PipelineStage(run, stage, STAGES, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(pipeline, n_microbatches=2, loss_fn=_refusing_loss)
    before = [p.detach().clone() for p in model.parameters()]
    g = torch.Generator().manual_seed(seed + dp)
    errors = []
    for step in range(2 if dp == 0 else 1):  # (pipeline 1 takes one step: the retry meets it)
        x, y = torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)
        if step == 0 and dp == 0:
            y[:2] = 777  # (micro-batch 0's rows)
        try:
            schedule.step(*([x] if stage == 0 else []), **({"target": y} if stage == STAGES - 1 else {}))
            opt.step()
            errors.append(None)
        except RuntimeError as e:
            errors.append((type(e).__name__, str(e)))
        opt.zero_grad()
    moved = max(float((p.detach() - q).abs().max()) if q.numel() else 0.0 for p, q in zip(model.parameters(), before))
    del run, model, opt, pipeline, schedule
    gc.collect()
    return errors, moved


@pytest.mark.parametrize("stage_kind", DIVERGED_KINDS)
def test_a_retry_paired_with_a_late_peers_first_attempt_raises_naming_both_steps(stage_kind, launched4):
    """Note [a retried step paired with a late peer's] (fusedist/pipelining/step_verdict.py), the divergence probe
    off, DDP or fully_shard stages: pipeline 0's retried step's reductions pair with pipeline 1's first step's.
    Before, both returned, every rank applied an optimizer step averaging pipeline 0's second batch with
    pipeline 1's first, and only the next forward named it; now that step raises at its end on every rank, no
    rank's weights move, and the error names each data-parallel rank's step (global rank 0 in step #2, global
    rank 1 in step #1)."""
    for rank, (errors, moved) in enumerate(results_of(launched4, f"retry paired with a late peer {stage_kind}")):
        assert moved == 0.0, (rank, moved, errors)
        if rank in (0, 2):  # pipeline 0: the failed first step, then the retry
            assert errors[0] is not None and "the target of micro-batch 0 is refused" in errors[0][1], (rank, errors)
        kind, message = errors[-1]
        assert "ranks diverged" in message and "before any optimizer step" in message, (rank, message)
        assert "pipeline steps of stage 0's data-parallel ranks differ: global rank 0: step #2; global rank 1: " \
            "step #1" in message, (rank, message)
        assert kind == ("RankMismatchError" if rank in (0, 1) else "RuntimeError"), (rank, kind, message)


# One launch per world size for the selected tests' cases, each on a fresh random seed; every
# case builds its own meshes, stages and optimizers, and frees them before the next.
@pytest.fixture(scope="module")
def launched4(request):
    seed = int(torch.randint(0, 10_000, ()).item())
    return {"seed": seed, **launch_for_selected(request, {
        "test_torchtitans_clip_across_stages_matches_torch_for_every_stage_kind": {
            "titan clip": (_titan_clip_worker, (seed, TITAN_KINDS, TITAN_NORM_TYPES))},
        "test_torchtitans_clip_a_zero2_stage_cannot_measure_is_refused": {
            f"titan refused {case}": (_titan_refused_worker, (5, case)) for case, _ in REFUSED},
        "test_peers_that_diverged_in_a_step_raise_at_its_end_before_the_optimizer_step": {
            f"diverged peers {layout} {kind}": (_diverged_peers_worker, (seed, layout, kind))
            for layout in DIVERGED_LAYOUTS for kind in DIVERGED_KINDS},
        "test_a_retry_paired_with_a_late_peers_first_attempt_raises_naming_both_steps": {  # (last: it fails a step)
            f"retry paired with a late peer {kind}": (under_env, ({"FUSEDIST_DIVERGENCE_PROBE_S": "0"},
                                                                  _retry_paired_with_a_late_peer_worker, seed, kind))
            for kind in DIVERGED_KINDS},
    }, 4, timeout=300)}


@pytest.fixture(scope="module")
def launched2(request):
    seed = int(torch.randint(0, 10_000, ()).item())
    return {"seed": seed, **launch_for_selected(request, {
        "test_scaler_found_inf_group_skips_every_stage": {
            f"scaler {kind} {lazy}": (_scaler_worker, (seed, kind, lazy)) for kind in SCALER_KINDS
            for lazy in (False, True)},
    }, 2, timeout=300)}
