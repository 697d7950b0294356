"""GPU tier at world size 2 over NCCL: the pipeline failure paths changed lately whose own tests run on gloo
only, each against the unpipelined model in the same run. Auto-skipped without room for two ranks: two GPUs,
or one shared through ``FUSEDIST_TEST_RANKS_PER_GPU=2`` (Note [several ranks on one GPU] in
fusedist/testing/shared_gpu.py), as benchmarks/gpu/run_checks.sh runs its multi-rank tier. A launch of its
own: a failure path that left a rank blocked would hold NCCL until the process group's timeout, and the
other sections (tests/test_gpu_pending_paths_ws2.py) would be lost with it.

* **A stage whose part ended in a failed step, put back on CUDA** (Note [a stage that ended in a step that
  raised] in fusedist/pipelining/step_failures.py), in the pipeline launch: two stages on the rank, pp 1 x dp 2;
  a plain stage's gradients and buffer are put back (the unpipelined model's gradients, ``1e-6``), a
  fully_shard stage refuses the next step.
* **Pipeline failures with several stages per rank over NCCL, own launch** (Note [a failure told
  at the step's end, several stages per rank] in fusedist/pipelining/schedule_step.py, Note [a
  failure told at the step's end] in fusedist/pipelining/step_status.py): two stages per rank
  (interleaved 1F1B, looped BFS) and one (1F1B) on CUDA; two good steps, the second after
  ``zero_grad(set_to_none=False)`` (the zeroed gradients measured on the device: Note
  [accumulating over synchronized pipeline steps] in fusedist/pipelining/__init__.py), give the
  unpipelined model's gradients within ``1e-6`` (fp32 micro-batch means summed in another
  order); then a stage's backward or forward raising at a later micro-batch fails every rank
  within 5 s (the process group's timeout is 30 s) with the same message naming stage, rank and
  micro-batch, the batched zeros completion leaves NCCL usable (an all-reduce after it), the
  weights and gradients stay as the step found them and the next step is refused. In the same
  launch, each rank a one-stage pipeline of its own on CUDA whose loss raises mid-step: the buffers
  are put back (Note [the buffers a failed step puts back] in fusedist/pipelining/step_failures.py:
  a count first updated in the failed step from its snapshot, kept in host memory for a CUDA
  buffer), and the next good step gives the unpipelined model's buffers and gradients (``1e-6``).
* **The step check's verdict at a pipeline step's end on CUDA** (Note [the step check's verdict read at the
  step's end] in fusedist/pipelining/step_verdict.py), the CPU cases of
  tests/test_pipeline_stages_clip_and_found_inf_group.py on CUDA over NCCL, DDP and fully_shard stages whose
  data-parallel peers diverged before the first step (rank 1 ran an extra forward, or put a module in eval
  mode). In the pipeline launch, one-rank pipelines (pp 1 x dp 2): no status exchange, and the verdict waits
  behind an event, so as documented the step ends (its SGD step applies) and the next forward raises the
  check's RankMismatchError on both ranks, naming the counts or modes. Its own launch of four ranks (2 pp x 2
  dp, 1F1B and interleaved 1F1B; run by the four-ranks-on-one-GPU group, skipped with room for two): the
  verdict rides the step's status all-reduce as a device flag, and the first step raises on every rank before
  any optimizer step (no weight moved), stage 0's ranks the check's own error, stage 1's a RuntimeError naming
  stage 0's replicas -- as on the host. The synchronizing CUDA calls of the steps that ended are printed.
"""

from __future__ import annotations

import copy
import random
import re
import time
import traceback

import pytest
import torch
from conftest import requires_rank_slots
from test_gpu_pending_paths_ws2 import _device, _raised
from torch import nn

from fusedist.testing import run_distributed

WORLD = 2
pytestmark = [pytest.mark.gpu, requires_rank_slots(WORLD)]


# ------------------------------------------------------------------ pipeline failures, own launch
# (schedule, failing stage, where, micro-batch); 1F1B: one stage per rank (the exchange at perform_reduce_grad)
_PIPELINE_CASES = [("ScheduleInterleaved1F1B", 2, "backward", 1), ("ScheduleLoopedBFS", 1, "forward", 3),
                   ("Schedule1F1B", 1, "backward", 2)]


def _pipeline_several_stages(rank, world_size, seed):
    from test_pipeline_step_failures import MICRO_BATCHES, WIDTH, _Breaking, _mse, _several_stages_step, _stage_indices
    from torch.distributed import pipelining

    from fusedist.pipelining import PipelineStage

    device = _device(rank)
    out = {}
    for schedule_name, bad_stage, where, chunk in _PIPELINE_CASES:
        single = schedule_name == "Schedule1F1B"
        torch.manual_seed(seed)
        whole = nn.Sequential(*[_Breaking() for _ in range(world_size if single else 2 * world_size)]).to(device)
        indices = [rank] if single else _stage_indices(schedule_name, rank, world_size)
        modules = {i: copy.deepcopy(whole[i]) for i in indices}
        stages = [PipelineStage(modules[i], i, len(whole), device) for i in sorted(modules)]
        schedule = getattr(pipelining, schedule_name)(stages[0] if single else stages, n_microbatches=MICRO_BATCHES,
                                                      loss_fn=_mse)
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(8, WIDTH, generator=g).to(device), torch.randn(8, WIDTH, generator=g).to(device)
        for xm, ym in zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES)):
            (_mse(whole(xm), ym) / MICRO_BATCHES).backward()

        def step():
            for module in modules.values():
                module.calls = 0
            return _several_stages_step(schedule, stages, x, y)

        def diff():
            return max(float((p.grad - q.grad).abs().max()) for i in indices
                       for p, q in zip(modules[i].parameters(), whole[i].parameters()))

        good = [_raised(step), diff()]
        for module in modules.values():
            module.zero_grad(set_to_none=False)
        good += [_raised(step), diff()]
        weights = [p.detach().clone() for m in modules.values() for p in m.parameters()]
        grads = [p.grad.clone() for m in modules.values() for p in m.parameters()]
        if bad_stage in modules:
            setattr(modules[bad_stage], "fail_forward" if where == "forward" else "fail_backward", chunk)
        began = time.monotonic()
        raised = _raised(step)
        seconds = time.monotonic() - began
        now = [p for m in modules.values() for p in m.parameters()]
        kept = all(torch.equal(a, p) and torch.equal(b, p.grad) for a, b, p in zip(weights, grads, now))
        total = torch.ones(1, device=device)
        torch.distributed.all_reduce(total)
        out[schedule_name] = dict(good=good, raised=raised, seconds=seconds, kept=kept, total=float(total),
                                  again=_raised(step))
    return out


def _pipeline_buffers_put_back(rank, world_size, seed):
    """Each rank a one-stage pipeline of its own on CUDA (GPipe over a one-rank group): a good step, the
    counts switched on, a step whose loss raises at micro-batch 2 (after every forward ran), a good step;
    the largest differences of the buffers (BatchNorm statistics, a count first updated in the failed step:
    put back from its snapshot, kept in host memory for a CUDA buffer) and gradients from the unpipelined
    model's on the good steps' micro-batches, and the count."""
    from test_pipeline_step_failures import MICRO_BATCHES, WIDTH, _counting_model, _cross_entropy
    from torch.distributed import pipelining

    from fusedist.pipelining import PipelineStage

    device = _device(rank)
    group = [torch.distributed.new_group([r]) for r in range(world_size)][rank]
    g = torch.Generator().manual_seed(seed + rank)
    batches = [(torch.randn(8, WIDTH, generator=g).to(device), torch.randint(0, WIDTH, (8,), generator=g).to(device))
               for _ in range(3)]
    model, reference = _counting_model(seed).to(device), _counting_model(seed).to(device)
    losses = {"calls": 0, "fail": None}

    def loss_fn(out, target):  # (no out-of-range target: on CUDA that is a device-side assert)
        losses["calls"] += 1
        if losses["calls"] - 1 == losses["fail"]:
            raise ValueError("the loss broke")
        return _cross_entropy(out, target)

    schedule = pipelining.ScheduleGPipe(PipelineStage(model, 0, 1, device, group=group),
                                        n_microbatches=MICRO_BATCHES, loss_fn=loss_fn)
    raised = []
    for i, (x, y) in enumerate(batches):
        losses["calls"], losses["fail"] = 0, 2 if i == 1 else None
        if i == 1:
            for m in (model, reference):
                m.zero_grad(set_to_none=True)
                m[0].counting = m[3].counting = True
        raised.append(_raised(lambda: schedule.step(x, target=y)))
        if i != 1:
            for xm, ym in zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES)):
                (_cross_entropy(reference(xm), ym) / MICRO_BATCHES).backward()
    stats = max(float((a.double() - b.double()).abs().max()) for a, b in zip(model.buffers(), reference.buffers()))
    grads = max(float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(), reference.parameters()))
    return dict(raised=raised, stats=stats, grads=grads, count=int(model[0].count),
                devices=sorted({b.device.type for b in model.buffers()}))


def _pipeline_ended_stage(rank, world_size, seed):
    """pp 1 x dp 2 on CUDA, two stages on the rank (interleaved 1F1B), the same batches on both ranks: a good
    step, then (accumulating) a step whose stage 0 raises in its backward of the last micro-batch, after stage
    1's part of the step ended, then a good step. Stage 1 plain or fusedist's fully_shard: what the failed and
    the next step raised; a plain stage's gradients' largest difference from the unpipelined model's on the
    good batches and its forwards counted by a device buffer; whether a sharded one's were left as they were."""
    from test_pipeline_step_failures import MICRO_BATCHES, WIDTH, _breaking_at, _count_forward, _model, _mse
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist
    from fusedist.pipelining import PipelineStage

    device = _device(rank)
    mesh = init_device_mesh(device.type, (1, world_size), mesh_dim_names=("pp", "dp"))
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(8, WIDTH, generator=g).to(device), torch.randn(8, WIDTH, generator=g).to(device))
               for _ in range(3)]
    out = {}
    for kind in ("plain", "fully_shard"):
        model = _model(seed).to(device)
        if kind == "plain":  # a buffer each forward of stage 1 updates (the failed step's are put back)
            model[2].register_buffer("forwards", torch.zeros((), dtype=torch.int64, device=device))
            model[2].register_forward_pre_hook(_count_forward)
        last = model[2:] if kind == "plain" else fusedist.fully_shard(model[2:], mesh=mesh["dp"])
        stages = [PipelineStage(m, i, 2, device, group=mesh["pp"].get_group()) for i, m in enumerate((model[:2], last))]
        schedule = pipelining.ScheduleInterleaved1F1B(stages, n_microbatches=MICRO_BATCHES, loss_fn=_mse)
        schedule.step(batches[0][0], target=batches[0][1])  # (its gradients kept: the failed step finds them)
        breaking = model[0].weight.register_hook(_breaking_at(MICRO_BATCHES - 1))  # stage 0's last backward
        failed = _raised(lambda: schedule.step(batches[1][0], target=batches[1][1]))
        breaking.remove()
        held = [None if p.grad is None else p.grad.clone() for p in model[2:].parameters()]
        following = _raised(lambda: schedule.step(batches[2][0], target=batches[2][1]))
        if kind == "plain":
            whole = _model(seed).to(device)
            for x, y in (batches[0], batches[2]):  # (equal micro-batches: the mean of their means)
                _mse(whole(x), y).backward()
            outcome = (max(float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(),
                                                                                  whole.parameters())),
                       int(model[2].forwards), model[2].forwards.device.type)
        else:
            outcome = all((a is None and p.grad is None) or (a is not None and torch.equal(a, p.grad))
                          for a, p in zip(held, model[2:].parameters()))
        out[kind] = (failed, following, outcome)
    return out


# ------------------------------------------------------------------ data-parallel peers that diverged
def _cuda_stage(kind, seed, mesh, device):
    """A stage module of ``kind`` ("ddp", "fully_shard") on ``device`` over the mesh's "dp" group, its
    weights' module and SGD (tests/test_pipeline_stages_clip_and_found_inf_group.py's stages, on CUDA)."""
    import fusedist
    from test_pipeline_stages_clip_and_found_inf_group import _model

    model = _model(seed).to(device)
    if kind == "fully_shard":
        fusedist.fully_shard(model, mesh=mesh["dp"])
        return model, model, torch.optim.SGD(model.parameters(), lr=0.1)
    kw = dict(device_ids=[device.index]) if device.type == "cuda" else {}
    run = fusedist.DistributedDataParallel(model, process_group=mesh["dp"].get_group(), **kw)
    return run, model, torch.optim.SGD(run.parameters(), lr=0.1)


def _chain(error):
    """The type names and texts of an exception and its causes (torch's stage wraps a forward's error)."""
    kinds, texts = [], []
    while error is not None:
        kinds.append(type(error).__name__)
        texts.append(str(error))
        error = error.__cause__ or error.__context__
    return kinds, "\n".join(texts)


_MESHES: dict = {}  # the meshes of this rank's process, by pipeline size


def _diverged_peers(rank, world_size, seed, layout, kind):
    """The CPU case of tests/test_pipeline_stages_clip_and_found_inf_group.py (``_diverged_peers_worker``) on
    CUDA over NCCL: ``kind`` stages under ``layout`` (1F1B or interleaved 1F1B over a 2 (pp) x 2 (dp) mesh, or
    one-rank pipelines over a 1 x ``world_size`` mesh), SGD after each step; before the first step rank 1 runs
    an extra training forward of its (first) DDP stage, or puts the Tanh of its fully_shard stage in eval mode.
    (the step that raised, the chain's types and text, the largest change of the weights, and the synchronizing
    CUDA calls of each schedule step that returned)."""
    from test_gpu_pending_paths_ws2 import _syncs_on
    from test_pipeline_stages_clip_and_found_inf_group import STAGES, WIDTH
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

    from fusedist.pipelining import PipelineStage

    device = _device(rank)
    pp = 1 if layout == "one-rank pipelines" else STAGES
    if pp not in _MESHES:  # (one per launch: each new group is one more NCCL communicator to set up)
        _MESHES[pp] = init_device_mesh(device.type, (pp, world_size // pp), mesh_dim_names=("pp", "dp"))
    mesh = _MESHES[pp]
    first_local = rank // mesh["dp"].size()
    local = [first_local] if layout != "interleaved" else [first_local, 2 + first_local]
    stages = len(local) * pp
    built = [_cuda_stage(kind, seed + index, mesh, device) for index in local]
    pipelines = [PipelineStage(run, index, stages, device, group=mesh["pp"].get_group())
                 for index, (run, _, _) in zip(local, built)]
    loss = lambda o, t: (o - t).square().mean()  # noqa: E731
    schedule = (ScheduleInterleaved1F1B(pipelines, n_microbatches=2, loss_fn=loss) if layout == "interleaved"
                else Schedule1F1B(pipelines[0], n_microbatches=2, loss_fn=loss))
    before = [p.detach().clone() for _, model, _ in built for p in model.parameters()]
    first, last = 0 in local, stages - 1 in local
    g = torch.Generator().manual_seed(seed + rank)
    raised, syncs = None, []
    for step in range(2):
        x, y = torch.randn(4, WIDTH, generator=g).to(device), torch.randn(4, WIDTH, generator=g).to(device)
        if rank == 1 and step == 0 and kind == "ddp":
            built[0][0](x)  # (a loss computed and dropped: the peers' forward counts now differ)
        elif rank == 1 and step == 0:
            built[0][1][1].eval()  # (the peers' modes now differ)
        try:
            _, count = _syncs_on(device, lambda: schedule.step(*([x] if first else []),
                                                               **({"target": y} if last else {})))
            syncs.append(count)
        except RuntimeError as e:
            raised = (step, *_chain(e))
            break
        for _, _, opt in built:
            opt.step()
            opt.zero_grad()
    moved = max(float((p.detach() - q).abs().max()) if q.numel() else 0.0
                for p, q in zip((p for _, model, _ in built for p in model.parameters()), before))
    return dict(raised=raised, moved=moved, syncs=syncs)


def _diverged_one_rank_pipelines(rank, world_size, seed):
    return {kind: _or_traceback(lambda: _diverged_peers(rank, world_size, seed, "one-rank pipelines", kind))
            for kind in ("ddp", "fully_shard")}


def _pipelines(rank, world_size, seed):
    torch.cuda.set_device(_device(rank))
    return {**_pipeline_several_stages(rank, world_size, seed), "buffers": _pipeline_buffers_put_back(
        rank, world_size, seed), "ended": _or_traceback(lambda: _pipeline_ended_stage(rank, world_size, seed)),
        "diverged": _diverged_one_rank_pipelines(rank, world_size, seed)}


def _or_traceback(call):
    """``call()``'s result, or ``{"error": its traceback}`` (the other cases of the launch still report)."""
    try:
        return call()
    except Exception:  # noqa: BLE001 - the case's test reports it
        return {"error": traceback.format_exc()}


@pytest.fixture(scope="module")
def pipelines():
    seed = random.randrange(2**20)
    return seed, run_distributed(_pipelines, WORLD, seed, backend="nccl", timeout=180, pg_timeout=30)


def test_pipeline_failure_with_several_stages_per_rank_over_nccl_fails_every_rank_at_once(pipelines):
    seed, results = pipelines
    for schedule_name, bad_stage, where, chunk in _PIPELINE_CASES:
        bad_rank = bad_stage % WORLD  # (interleaved and looped: stages r and r + 2 on rank r; 1F1B: stage r)
        part = "'s backward" if where == "backward" else ""
        broke = "the backward broke" if where == "backward" else "the stage module broke"
        told = (f"stage {bad_stage} (rank {bad_rank} of the pipeline's group) failed at micro-batch {chunk}{part}: "
                f"ValueError: {broke}")
        assert len({r[schedule_name]["raised"] for r in results}) == 1, (schedule_name, results)
        for rank, res in enumerate(results):
            r = res[schedule_name]
            where_ = f"seed {seed}, rank {rank}, {schedule_name}: {r}"
            assert r["good"][0] is None and r["good"][2] is None, where_
            assert r["good"][1] < 1e-6 and r["good"][3] < 1e-6, where_
            assert r["raised"] is not None and told in r["raised"], where_
            assert r["seconds"] < 5 and r["kept"] and r["total"] == WORLD, where_
            assert r["again"] is not None and "the previous step raised before its end" in r["again"], where_


def test_pipeline_failed_step_puts_back_cuda_buffers_from_host_snapshots(pipelines):
    """Note [the buffers a failed step puts back] (fusedist/pipelining/step_failures.py): a buffer not known to
    move is kept by a snapshot in host memory for a CUDA tensor; after the failed step its value comes back
    from there (the count), the BatchNorm statistics from their copy: the next good step's buffers and
    gradients are the unpipelined model's on the good steps' micro-batches (fp32: 1e-6; the count exact)."""
    seed, results = pipelines
    for rank, res in enumerate(results):
        r = res["buffers"]
        where = f"seed {seed}, rank {rank}: {r}"
        assert r["raised"][0] is None and r["raised"][2] is None, where
        assert r["raised"][1] is not None and "the loss broke" in r["raised"][1], where
        assert r["devices"] == [_device(rank).type] and r["count"] == 4, where
        assert r["stats"] < 1e-6 and r["grads"] < 1e-6, where


def test_pipeline_stage_that_ended_in_a_failed_step_is_put_back_on_cuda(pipelines):
    """Note [a stage that ended in a step that raised] (fusedist/pipelining/step_failures.py): two stages on the
    rank on CUDA, stage 0 raising in its backward of the last micro-batch after stage 1's part of the step had
    ended (its gradients reduced and divided). A plain stage 1 gets the good step's gradients back (set aside on
    the device) and its forwards count (a CUDA buffer), and the next step gives the unpipelined model's
    gradients of the two good batches (fp32, the same terms in another order: 1e-6); a fully_shard one refuses
    the next step, naming why, and leaves its gradients as they were."""
    from test_pipeline_step_failures import MICRO_BATCHES

    seed, results = pipelines
    for rank, res in enumerate(results):
        assert "error" not in res["ended"], f"seed {seed}, rank {rank}:\n{res['ended'].get('error')}"
        assert sorted(res["ended"]) == ["fully_shard", "plain"], (seed, rank, res["ended"])
        for kind, (failed, following, outcome) in res["ended"].items():
            where = f"seed {seed}, rank {rank}, {kind}: {failed}, {following}, {outcome}"
            assert failed is not None and "stage backward" in failed, where  # (torch's words)
            if kind == "plain":
                assert following is None and outcome[0] < 1e-6, where
                assert outcome[1:] == (2 * MICRO_BATCHES, _device(rank).type), where  # the good steps' forwards
                continue
            assert following is not None and "stage 1 (rank" in following, where
            assert "raised at another stage of this rank after this stage's part of it had ended" in following \
                and "cannot be put back" in following, where
            assert outcome, where


def test_one_rank_pipelines_whose_cuda_peers_diverged_raise_at_the_next_forward(pipelines):
    """Note [the step check's verdict read at the step's end] (fusedist/pipelining/step_verdict.py): a pipeline
    of one rank has no status exchange, and on CUDA its stage's verdict is not readable without the host
    waiting on the device, so it is read at the next forward, as before (on the host, tests/
    test_pipeline_stages_clip_and_found_inf_group.py, at the step's end). Each rank a one-rank pipeline of a DDP
    or fully_shard stage over NCCL, rank 1 diverging before the first step: that step ends on both ranks (its
    SGD step applies), and the next step's first forward raises the check's RankMismatchError on both, naming
    the forward counts or modes that differ."""
    seed, results = pipelines
    for rank, res in enumerate(results):
        for kind, r in res["diverged"].items():
            assert "error" not in r, f"seed {seed}, rank {rank}, {kind}:\n{r.get('error')}"
            where = f"seed {seed}, rank {rank}, {kind}: {r}"
            assert r["raised"] is not None and r["raised"][0] == 1, where
            _, kinds, text = r["raised"]
            assert "RankMismatchError" in kinds and "ranks diverged" in text, where
            assert "reported at the next training forward" in text, where
            if kind == "ddp":
                counts = re.search(r"forward: ranks \[0\]: (\d+); ranks \[1\]: (\d+)", text)
                assert counts and int(counts[2]) == int(counts[1]) + 1, where
            else:
                assert re.search(r"modes: ranks \[0\] \| ranks \[1\] ran in different modes", text), where
            assert r["moved"] > 0 and len(r["syncs"]) == 1, where
            print(f"rank {rank}, {kind}: synchronizing calls of the step that ended: {r['syncs']}")


# ------------------------------------------------------------------ world size 4: the verdict at the step's end
_WS4_LAYOUTS, _WS4_KINDS = ("1F1B", "interleaved"), ("ddp", "fully_shard")


def _diverged_ws4(rank, world_size, seed):
    torch.cuda.set_device(_device(rank))
    return {f"{layout} {kind}": _or_traceback(lambda: _diverged_peers(rank, world_size, seed, layout, kind))
            for layout in _WS4_LAYOUTS for kind in _WS4_KINDS}


@requires_rank_slots(4)
def test_cuda_stages_whose_peers_diverged_raise_at_the_step_end_before_the_optimizer_step():
    """Note [the step check's verdict read at the step's end]: 2 (pp) x 2 (dp) over NCCL on CUDA, 1F1B and
    interleaved 1F1B, DDP or fully_shard stages, rank 1 (stage 0's second replica) diverging before the first
    step. The verdict rides the step's status all-reduce as a device flag (the step's stream waits for the
    check's copy event): as on the host (tests/test_pipeline_stages_clip_and_found_inf_group.py), the first
    step raises on every rank before any optimizer step -- no weight moved -- stage 0's ranks the check's
    RankMismatchError naming the counts or modes, stage 1's a RuntimeError naming stage 0's replicas. Its own
    launch of four ranks (run with four ranks on one GPU: ``FUSEDIST_TEST_RANKS_PER_GPU=4``)."""
    seed = random.randrange(2**20)
    results = run_distributed(_diverged_ws4, 4, seed, backend="nccl", timeout=180, pg_timeout=30)
    for rank, res in enumerate(results):
        for case, r in res.items():
            assert "error" not in r, f"seed {seed}, rank {rank}, {case}:\n{r.get('error')}"
            where = f"seed {seed}, rank {rank}, {case}: {r}"
            assert r["raised"] is not None and r["raised"][0] == 0 and r["moved"] == 0.0, where
            _, kinds, text = r["raised"]
            assert "ranks diverged" in text and "before any optimizer step" in text, where
            if case.endswith("ddp"):
                counts = re.search(r"forward: ranks \[0(?:, 2, 3)?\]: (\d+); ranks \[1\]: (\d+)", text)
                assert counts and int(counts[2]) == int(counts[1]) + 1, where
            else:
                assert re.search(r"modes: ranks \[0(?:, 2, 3)?\] \| ranks \[1\] ran in different modes", text), where
            if rank // 2 == 0:  # stage 0's data-parallel ranks: the check's own error
                assert kinds[0] == "RankMismatchError", where
            else:  # told by their pipeline's exchange
                assert kinds[0] == "RuntimeError" and "replicas of stage 0 diverged" in text, where
