"""The planner (``python -m fusedist.plan``) against what fusedist does and what its help says: the
ZeRO-2 gradient buckets it really builds, --steps outside --measure, --arch in any case, and the
peak an fp32 plan is timed at."""

import random

import torch
import torch.nn.functional as F

import fusedist
from fusedist.plan import ModelSpec
from fusedist.plan.cli import main
from fusedist.plan.hardware import PRESETS
from fusedist.plan.plan import Job, build_plan
from fusedist.plan.torch_model import Transformer
from fusedist.testing import run_distributed


def _zero2_buckets(rank, world, spec, cap_mb, seed):
    """The bytes of each gradient bucket fusedist's ZeRO-2 builds for ``spec`` (in backward's
    order), and the most full-gradient bytes a step held."""
    torch.manual_seed(seed)
    ddp = fusedist.DistributedDataParallel(Transformer(spec), bucket_cap_mb=cap_mb)
    opt = fusedist.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
    peak = 0
    for _ in range(2):
        x = torch.randint(0, spec.vocab, (2, spec.seq))
        F.cross_entropy(ddp(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad()
        peak = max(peak, ddp.comm_stats()["peak_grad_bytes"])
    return [b.nbytes for b in ddp.buckets], peak


def test_zero2_temporary_bytes_hold_three_of_the_buckets_fusedist_builds():
    """The planner's ZeRO-2 temporary term was two bucket caps, but a bucket closes only once it
    reaches the cap, the tensor that crosses it included: an embedding larger than the cap is a
    bucket of its own, and the peak measured 1.7x the term with 25 MiB buckets. Three consecutive
    buckets as fusedist builds them (two in flight, one filling) must fit in it."""
    hidden = random.choice([64, 96])
    spec = ModelSpec(arch=random.choice(["gpt", "llama"]), layers=3, hidden=hidden, heads=4, seq=16,
                     vocab=random.randint(3000, 5000))
    cap_mb = random.choice([0.25, 0.5])
    sizes, peak = run_distributed(_zero2_buckets, 2, spec, cap_mb, random.randint(0, 10**6), timeout=120)[0]
    plan = build_plan(spec, Job(gpus=2, micro_batch=2, seq=spec.seq, precision="fp32", bucket_cap_mb=cap_mb,
                                scratch_gb=0), PRESETS["h100"])
    temp = plan["memory"]["zero2"]["temp_bytes"]
    held = max(sum(sizes[i:i + 3]) for i in range(max(1, len(sizes) - 2)))  # two in flight, one filling
    assert held <= temp <= sum(sizes), (sizes, temp)
    assert peak <= sum(sizes)


def _shape(arch):
    return ["--arch", arch, "--layers", str(random.randint(1, 4)), "--hidden", "64", "--heads", "4",
            "--seq", "32", "--vocab", str(random.randint(100, 1000)), "--gpus", "2", "--json"]


def test_steps_without_measure_is_refused_naming_the_flag(capsys):
    """--steps counts what --measure trains; a plan alone ignored it without a word."""
    code = main(_shape("llama") + ["--steps", str(random.randint(1, 20))])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--steps" in err and "--measure" in err, err


def test_arch_in_any_case_is_the_same_plan(capsys):
    """--gpu H100 was taken and --arch Llama refused; the error now lists the architectures."""
    argv = _shape("llama")
    assert main(argv) == 0
    lower = capsys.readouterr().out
    argv[1] = random.choice(["Llama", "LLAMA", "lLaMa"])
    assert main(argv) == 0
    assert capsys.readouterr().out == lower
    assert main(_shape("Mamba")) == 2
    err = capsys.readouterr().err
    assert "'Mamba'" in err and "gpt, llama" in err, err


def test_fp32_plan_says_its_peak_needs_tf32(capsys):
    """fp32 plans are timed at the TF32 peak, which torch's default matmul precision does not
    reach; the plan says so, and a --peak-tflops figure is named as the one given."""
    argv = _shape("gpt")[:-1] + ["--precision", "fp32", "--gpu", random.choice(["h100", "a100", "b200"])]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tf32" in out and "set_float32_matmul_precision('high')" in out, out
    assert main(argv + ["--peak-tflops", "60"]) == 0
    out = capsys.readouterr().out
    assert "peak 60 TFLOPS (given by --peak-tflops)" in out, out
    assert main(argv[:-4] + ["--precision", "bf16"]) == 0
    assert "(bf16/fp16 dense)" in capsys.readouterr().out


def test_measured_json_is_strict_json():
    """--json is strict JSON; --measure's wrote ``Infinity`` for an error with no finite value
    (zero3_offload's device model states: predicted nothing, something measured on a GPU)."""
    import json
    import math

    from fusedist.plan.measure import _relative_error, json_text
    spec = ModelSpec(arch="llama", layers=2, hidden=64, heads=4, seq=32, vocab=random.randint(100, 1000))
    plan = build_plan(spec, Job(gpus=2, micro_batch=1, seq=32), PRESETS["h100"])
    error = _relative_error(random.randint(1, 10**6), 0)
    assert math.isinf(error)
    doc = {"plan": plan, "measured": {"zero3_offload": {"model_states_error": error}},
           "rank_errors": {"zero3_offload": {"model_states_error": [error, 0.0]}}}

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")
    back = json.loads(json_text(doc), parse_constant=refuse)
    assert back["measured"]["zero3_offload"]["model_states_error"] is None
    assert back["rank_errors"]["zero3_offload"]["model_states_error"] == [None, 0.0]
    assert back["plan"] == json.loads(json.dumps(plan))


def test_measured_table_says_a_global_batch_is_not_measured():
    """--measure trains one micro-batch a step and dropped --global-batch without a word; the
    table now says so (and nothing when none was given)."""
    from types import SimpleNamespace

    from fusedist.plan.measure import NOT_MEASURED, format_measured
    from fusedist.plan.memory import STRATEGIES
    spec = ModelSpec(arch="gpt", layers=2, hidden=64, heads=4, seq=32, vocab=random.randint(100, 1000))
    plan = build_plan(spec, Job(gpus=2, micro_batch=2, seq=32), PRESETS["h100"])
    ddp = {"predicted_model_states_bytes": 1e6, "model_states_bytes": 1e6, "model_states_error": 0.0,
           "predicted_comm_bytes_per_step": 1e5, "comm_bytes_per_step": 1e5, "comm_error": 0.0, "step_s": 0.01,
           "achieved_mfu": 0.1, "matmul_flops": 1e10, "predicted_activation_bytes": 1e6, "saved_activation_bytes": 1e6}
    measured = {s: NOT_MEASURED for s in STRATEGIES} | {"ddp": ddp}
    info = SimpleNamespace(device=torch.device("cpu"), backend="gloo")
    batch = 4 * random.randint(2, 8)
    text = format_measured(plan, measured, info, 3, 1, True, batch)
    assert f"--global-batch {batch} (gradient accumulation) is not measured" in text, text
    assert "--global-batch" not in format_measured(plan, measured, info, 3, 1, True)
