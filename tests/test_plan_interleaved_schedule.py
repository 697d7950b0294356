"""The interleaved 1F1B pipeline schedule in the planner (Note [interleaved 1F1B as torch runs it] in
fusedist/plan/interleaved.py), checked against the action lists torch's own ScheduleInterleaved1F1B
builds: the chunks each rank holds at its peak, the bytes they make, the bubble when each action
waits for its neighbour stage, the sends torch adds, and the micro-batch counts torch refuses. The
planner modelled 1F1B and GPipe only."""

import pytest
from torch.distributed.pipelining.schedules import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                                    _ComputationType)
from torch.distributed.pipelining.stage import _PipelineStageBase

from fusedist.plan import ModelSpec, cli, interleaved
from fusedist.plan.hardware import PRESETS
from fusedist.plan.pipeline import pipeline_activation_bytes, schedule_refusal, stage_activation_bytes
from fusedist.plan.plan import Job, build_plan

CASES = [(2, 2, 4), (4, 2, 8), (4, 2, 4), (4, 3, 12), (4, 2, 10), (4, 2, 3), (4, 4, 8), (8, 2, 16), (3, 3, 8),
         (2, 1, 4), (4, 2, 1), (4, 3, 6)]
FORWARD = _ComputationType.FORWARD


class _Stage(_PipelineStageBase):
    """Just what the schedule reads to build its order: no model, no process group."""

    def __init__(self, index: int, pp: int, virtual: int):
        self.stage_index, self.group_size, self.group_rank, self.num_stages = index, pp, 0, pp * virtual

    def has_backward(self):
        return True

    def _create_grad_recv_info(self, *args):
        pass

    def _prepare_backward_infra(self, *args):
        pass

    def _prepare_forward_infra(self, *args):
        pass


def _torch_schedule(pp: int, virtual: int, m: int) -> ScheduleInterleaved1F1B:
    return ScheduleInterleaved1F1B([_Stage(s, pp, virtual) for s in range(0, pp * virtual, pp)], m)


def _actions(schedule, rank):
    return [a for a in schedule.pipeline_order[rank] if a is not None]


def _peak(actions, size=lambda stage: 1) -> int:
    """The most ``size`` of the chunks forwarded and not yet backwarded, in the rank's order."""
    alive, held, best = set(), 0, 0
    for a in actions:
        chunk = (a.stage_index, a.microbatch_index)
        if a.computation_type == FORWARD:
            alive.add(chunk)
            held += size(a.stage_index)
            best = max(best, held)
        elif chunk in alive:
            alive.discard(chunk)
            held -= size(a.stage_index)
    return best


def _makespan(schedule, pp: int, virtual: int, forward: float = 1.0, backward: float = 2.0) -> float:
    """Each rank runs its actions in torch's order; a forward waits for the stage before, a
    backward for the stage after (the last stage for its own forward)."""
    last = pp * virtual - 1
    queues = {r: _actions(schedule, r) for r in range(pp)}
    free, done = dict.fromkeys(queues, 0.0), {}
    moved = True
    while moved:
        moved = False
        for r, queue in queues.items():
            while queue:
                a = queue[0]
                s, mb, fwd = a.stage_index, a.microbatch_index, a.computation_type == FORWARD
                need = None if fwd and s == 0 else ((s - 1, mb, True) if fwd else
                                                    ((s + 1, mb, False) if s < last else (s, mb, True)))
                if need is not None and need not in done:
                    break
                free[r] = max(free[r], done.get(need, 0.0)) + (forward if fwd else backward)
                done[(s, mb, fwd)] = free[r]
                queue.pop(0)
                moved = True
    assert not any(queues.values())
    return max(free.values())


@pytest.mark.parametrize("pp,virtual,m", CASES)
def test_schedule_figures_are_torchs(pp, virtual, m):
    schedule = _torch_schedule(pp, virtual, m)
    for rank in range(pp):
        actions = _actions(schedule, rank)
        assert interleaved.in_flight(rank, pp, virtual, m) == _peak(actions), rank
        # bytes: every local stage a size of its own, so that which chunks are alive shows
        def size(stage):
            return 7 ** (stage // pp) + (1000 if stage == 0 else 0)
        assert interleaved.peak_held(rank, pp, virtual, m, lambda local: size(local * pp + rank)) == \
            _peak(actions, size), rank
    compute = virtual * m * 3.0
    assert interleaved.bubble_ratio(pp, virtual, m) == pytest.approx(
        (_makespan(schedule, pp, virtual) - compute) / compute)
    sends = [sum(a.computation_type in (_ComputationType.SEND_F, _ComputationType.SEND_B) for a in actions)
             for actions in schedule.pipeline_order_with_comms.values()]
    assert interleaved.p2p_sends(pp, virtual, m) == {"total": sum(sends), "busiest_rank": max(sends)}


def _torch_refuses(build) -> bool:
    try:
        build()
    except ValueError:
        return True
    return False


def test_refused_micro_batch_counts_are_torchs():
    """ScheduleInterleaved1F1B: a multiple of max(1, m // pp) rounds; Schedule1F1B: m >= pp (the
    planner suggested 1F1B pipelines of one micro-batch a step, which torch refuses); GPipe: any."""
    for pp in (2, 3, 4, 8):
        for m in range(1, 4 * pp):
            for schedule, build in (("interleaved", lambda: _torch_schedule(pp, 2, m)),
                                    ("1f1b", lambda: Schedule1F1B(_Stage(0, pp, 1), m)),
                                    ("gpipe", lambda: ScheduleGPipe(_Stage(0, pp, 1), m))):
                why = schedule_refusal(schedule, pp, m, 2)
                assert (why is not None) == _torch_refuses(build), (schedule, pp, m)
                if why:
                    assert why.startswith(f"{m} micro-batch") and "Schedule" in why


def test_first_rank_holds_more_than_under_1f1b_and_the_plan_says_so():
    spec = ModelSpec(arch="llama", layers=8, hidden=256, heads=8, kv_heads=2, ffn_hidden=512, seq=512,
                     vocab=1000)
    args = (spec, 2, 512, "bf16", "none")
    one_f_one_b = pipeline_activation_bytes(*args, pp=4, micro_batches=8)
    inter = pipeline_activation_bytes(*args, pp=4, micro_batches=8, schedule="interleaved", virtual=2)
    # the first rank: 11 chunks of one block (its stages 0 and 4) against 1F1B's 4 micro-batches of two
    assert inter == stage_activation_bytes(*args, 1, 4, 8, "interleaved", 0, 2) > one_f_one_b
    # a job that needs a pipeline: the suggestion carries the interleaved schedule's figures
    hw = PRESETS["h100"]
    wide = ModelSpec(arch="llama", layers=8, hidden=512, heads=8, kv_heads=2, ffn_hidden=1024, seq=512, vocab=32000)
    plan = build_plan(wide, Job(gpus=4, gpus_per_node=1, micro_batch=1, seq=128, global_batch=16, scratch_gb=0,
                                pp_schedule="interleaved", virtual_stages=2),
                      hw.__class__(**{**hw.__dict__, "memory_gb": 0.3, "host_memory_gb": 1e-3}))
    layout = plan["suggestion"]["layout"]
    assert layout is not None and layout["pp"] > 1, plan["suggestion"]
    pipe, m = layout["pipeline"], plan["suggestion"]["grad_accum_steps"]
    assert pipe["first_rank_in_flight"] == interleaved.in_flight(0, layout["pp"], 2, m)
    assert pipe["bubble_ratio"] == interleaved.bubble_ratio(layout["pp"], 2, m)
    assert pipe["p2p_sends_more_than_1f1b"] == 2 * m * layout["pp"]


def test_layouts_torch_refuses_are_skipped_by_name():
    spec = ModelSpec(arch="llama", layers=8, hidden=256, heads=8, kv_heads=2, ffn_hidden=512, seq=512,
                     vocab=1000)
    hw = PRESETS["h100"]
    small = hw.__class__(**{**hw.__dict__, "memory_gb": 0.3})
    # 8 GPUs, one a node (no tensor parallelism), 36 sequences a step: pp=2 runs 9 micro-batches a
    # pipeline (4 rounds), pp=4 18 (4 rounds), neither a multiple; pp=8 has 16 stages for 8 blocks
    plan = build_plan(spec, Job(gpus=8, gpus_per_node=1, micro_batch=1, seq=512, global_batch=36,
                                pp_schedule="interleaved", virtual_stages=2), small)
    refused = plan["suggestion"]["layouts_refused"]
    assert refused["pp=2"].startswith("9 micro-batches") and refused["pp=4"].startswith("18 micro-batches")
    assert "16 stages, more than the 8 blocks" in refused["pp=8"]
    assert plan["suggestion"]["layout"] is None or plan["suggestion"]["layout"]["pp"] == 1
    # 1F1B with one micro-batch a step: every pipeline refused, naming what to give
    plan = build_plan(spec, Job(gpus=8, gpus_per_node=1, micro_batch=1, seq=512), small)
    assert "torch's Schedule1F1B needs: give a --global-batch of at least 8" in \
        plan["suggestion"]["layouts_refused"]["pp=4"]


@pytest.mark.parametrize("argv,message", [
    (["--pp-schedule", "interleaved"], "--virtual-stages: needed with --pp-schedule interleaved"),
    (["--virtual-stages", "2"], "--virtual-stages: only with --pp-schedule interleaved"),
    (["--pp-schedule", "interleaved", "--virtual-stages", "0"], "--virtual-stages: must be positive"),
])
def test_virtual_stages_flag_is_checked(capsys, argv, message):
    assert cli.main(["--params", "7B", "--gpus", "8", "--seq", "2048", *argv]) == 2
    assert message in capsys.readouterr().err


def test_first_rank_holds_what_autograd_saves_in_torchs_order():
    """Rank 0 of pp = 2, v = 2 (a 4-block bf16 GPT: stage 0 the embedding and block 0, stage 2
    block 2) runs torch's order for m = 4; the planner's figure is the peak of what autograd saves."""
    import torch
    from test_planner_recompute_peak import _drop, _GPTLayer, _peak_saved_bytes

    torch.manual_seed(0)
    b, s, h, a, vocab, pp, virtual, m = 2, 16, 32, 4, 7, 2, 2, 4
    embed = torch.nn.Embedding(vocab, h).to(torch.bfloat16)
    blocks = {0: _GPTLayer(h, a).to(torch.bfloat16), 2: _GPTLayer(h, a).to(torch.bfloat16)}
    params = {p.untyped_storage().data_ptr() for mod in (embed, *blocks.values()) for p in mod.parameters()}
    tokens = [torch.randint(vocab, (b, s)) for _ in range(m)]
    received = [torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True) for _ in range(m)]

    def run():
        outputs = {}
        for action in _actions(_torch_schedule(pp, virtual, m), 0):
            stage, mb = action.stage_index, action.microbatch_index
            if action.computation_type == FORWARD:
                x = _drop(embed(tokens[mb])) if stage == 0 else received[mb]
                outputs[stage, mb] = blocks[stage](x)
            else:
                y = outputs.pop((stage, mb))
                y.backward(torch.randn_like(y))

    peak = _peak_saved_bytes(run, params, b * s)
    spec = ModelSpec(layers=4, hidden=h, heads=a, seq=s, vocab=vocab)
    assert peak == stage_activation_bytes(spec, b, s, "bf16", "none", 1, pp, m, "interleaved", 0, virtual)
