"""Activation memory under pipeline parallelism (Note [activations under pipeline parallelism] in
fusedist/plan/pipeline.py): a stage holds its share of the blocks for each micro-batch in flight
-- under 1F1B the first stage ``min(pp, m)`` of them, under GPipe every stage all ``m``. The
planner counted every block for one micro-batch whatever the pipeline.

Checked against Korthikanti et al.'s per-layer formula with Megatron's memory estimator's
pipeline factors, and byte for byte against the tensors autograd saves while the first stage of
a small bf16 GPT runs each schedule's order of forwards and backwards."""

import torch

from fusedist.plan import ModelSpec, activation_bytes
from fusedist.plan.hardware import PRESETS
from fusedist.plan.pipeline import pipeline_activation_bytes, stage_activation_bytes
from fusedist.plan.plan import Job, _memory_entry, build_plan
from fusedist.plan.model import count_params
from test_planner_recompute_peak import _drop, _GPTLayer, _peak_saved_bytes


def test_stage_figures_follow_megatrons_estimator():
    b, s, h, a, v, layers = 2, 512, 1024, 16, 50304, 8
    spec = ModelSpec(layers=layers, hidden=h, heads=a, seq=s, vocab=v)
    per_layer = s * b * h * (34 + 5 * a * s // h)  # Korthikanti et al., eq. 1
    mask, out = s * b * h, 4 * s * b * h + 4 * s * b * v  # embedding dropout; output layer's inputs, fp32 logits
    args = (spec, b, s, "bf16", "none")
    assert pipeline_activation_bytes(*args) == activation_bytes(*args) == layers * per_layer + mask + out
    pp = 4
    for m in (8, 4, 2, 1):
        # 1F1B: stage 0 holds min(pp, m) micro-batches of L/pp blocks: Megatron's L-block figure times min(1, m/pp)
        first = (layers * per_layer + pp * mask) * min(pp, m) // pp
        last = layers // pp * per_layer + out
        assert stage_activation_bytes(*args, 1, pp, m, "1f1b", 0) == first
        assert stage_activation_bytes(*args, 1, pp, m, "1f1b", pp - 1) == last
        assert pipeline_activation_bytes(*args, pp=pp, micro_batches=m) == max(first, last)
        # GPipe: all m micro-batches on every stage
        gpipe = m * (layers // pp * per_layer + max(mask, out))
        assert pipeline_activation_bytes(*args, pp=pp, micro_batches=m, schedule="gpipe") == gpipe
        for tp in (2, 4):  # sequence parallelism divides everything
            assert pipeline_activation_bytes(*args, tp=tp, pp=pp, micro_batches=m) == max(first, last) // tp
    # full recomputation: stored block inputs per micro-batch in flight, one block recomputed once
    full = (spec, b, s, "bf16", "full")
    assert stage_activation_bytes(*full, 1, pp, 8, "1f1b", 0) == pp * (layers // pp * 2 * s * b * h + mask) + per_layer


def _stage_peak(order, micro_batches):
    """Peak saved bytes of stage 0 (embedding, its dropout, two blocks of a 4-block bf16 GPT)
    running its forwards ("F") and backwards ("B") of ``micro_batches`` in ``order``."""
    torch.manual_seed(0)
    b, s, h, a, vocab = 2, 16, 32, 4, 7
    embed = torch.nn.Embedding(vocab, h).to(torch.bfloat16)
    blocks = [_GPTLayer(h, a).to(torch.bfloat16) for _ in range(2)]
    params = {p.untyped_storage().data_ptr() for m in (embed, *blocks) for p in m.parameters()}
    tokens = [torch.randint(vocab, (b, s)) for _ in range(micro_batches)]

    def run():
        outputs, fwd, bwd = [], iter(tokens), 0
        for step in order:
            if step == "F":
                y = _drop(embed(next(fwd)))
                for block in blocks:
                    y = block(y)
                outputs.append(y)
            else:
                y, outputs[bwd] = outputs[bwd], None
                y.backward(torch.randn_like(y))  # the gradient the next stage sends back
                bwd += 1

    spec = ModelSpec(layers=4, hidden=h, heads=a, seq=s, vocab=vocab)
    return _peak_saved_bytes(run, params, b * s), spec, b, s


def test_first_stage_holds_what_autograd_saves_under_each_schedule():
    # pp = 2, m = 3: 1F1B runs F0 F1 B0 F2 B1 B2 on stage 0, GPipe F0 F1 F2 B0 B1 B2
    for schedule, order, held in (("1f1b", "FFBFBB", 2), ("gpipe", "FFFBBB", 3)):
        peak, spec, b, s = _stage_peak(order, 3)
        planned = stage_activation_bytes(spec, b, s, "bf16", "none", 1, 2, 3, schedule, 0)
        assert peak == planned, (schedule, peak, planned)
        one, _, _, _ = _stage_peak("FB", 1)
        assert peak == held * one


def test_suggested_pipeline_layout_counts_its_stages_activations():
    """Nothing fits data-parallel: the layout search sizes each (tp, pp) with the fullest stage's
    activations for the micro-batches that layout runs, 1F1B by default or GPipe."""
    spec = ModelSpec(arch="llama", layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, seq=4096,
                     vocab=128256)
    hw = PRESETS["h100"]
    psi = count_params(spec)
    for schedule in ("1f1b", "gpipe"):
        job = Job(gpus=16, micro_batch=2, seq=4096, global_batch=256, pp_schedule=schedule)
        for dp, pp in ((8, 2), (4, 4), (2, 8)):
            m = 256 // (2 * dp)
            entry = _memory_entry(spec, psi, job, hw, "zero1", dp, 1, pp)
            assert entry["activation_bytes"] == pipeline_activation_bytes(spec, 2, 4096, "bf16", "none", 1, pp, m,
                                                                          schedule)
        plan = build_plan(spec, job, hw)
        lay = plan["suggestion"]["layout"]
        assert plan["inputs"]["pp_schedule"] == schedule
        if lay is not None and lay["pp"] > 1:
            entry = _memory_entry(spec, psi, job, hw, lay["strategy"], lay["dp"], lay["tp"], lay["pp"])
            assert lay["total_bytes"] == entry["total_bytes"]
    # 1F1B with more micro-batches than stages: the first stage holds pp of them, as the whole model one
    one = activation_bytes(spec, 2, 4096, "bf16", "none")
    staged = pipeline_activation_bytes(spec, 2, 4096, "bf16", "none", 1, 4, 16)
    assert abs(staged - one) < 0.02 * one
    assert pipeline_activation_bytes(spec, 2, 4096, "bf16", "none", 1, 4, 16, "gpipe") > 3.9 * one
