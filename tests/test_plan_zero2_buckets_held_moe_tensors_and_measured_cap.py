"""The planner against what fusedist builds and what its help says: ZeRO-2's gradient buckets
(the largest two consecutive buckets of the model's tensors, stacked experts included),
``--measure`` training the buckets ``--bucket-cap-mb`` asks for and reporting the bucket peak,
and the choice flags taken in any case, as --arch and --gpu are."""

import json
import os
import random
import sys

import pytest
import torch
import torch.nn.functional as F

import fusedist
from fusedist.plan import ModelSpec, from_hf_config
from fusedist.plan.cli import main
from fusedist.plan.hardware import PRESETS
from fusedist.plan.memory import _bucket_elements, temp_bytes
from fusedist.plan.param_tensors import param_tensors
from fusedist.plan.plan import Job, build_plan
from fusedist.plan.torch_model import Transformer
from fusedist.testing import run_distributed

sys.path.insert(0, os.path.dirname(__file__))
import test_plan_architectures as families  # noqa: E402


@pytest.mark.parametrize("name", random.sample(sorted(families.FAMILIES), 6))
def test_param_tensors_are_the_built_models_tensors_in_order(tmp_path, name):
    """ZeRO-2's buckets follow the tensors in registration order; the planner's list must be
    the model --measure builds, tensor by tensor (a mixture's experts stacked, one tensor each)."""
    base, changes = families.FAMILIES[name]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(families._small(base, **changes)))
    spec = from_hf_config(str(path))
    with torch.device("meta"):
        built = [p.numel() for p in Transformer(spec).parameters()]
    assert param_tensors(spec) == built


def _specs():
    h = 32
    vocab = random.randint(1000, 2000)
    return [ModelSpec(arch="llama", layers=3, hidden=h, heads=4, seq=16, vocab=vocab, tied=False),
            ModelSpec(arch=random.choice(["gpt", "llama"]), layers=3, hidden=h, heads=4, seq=16, vocab=vocab,
                      tied=True),
            ModelSpec(arch="llama", layers=2, hidden=h, heads=4, seq=16, vocab=random.randint(100, 500),
                      experts=random.choice([4, 8]), experts_per_token=2, expert_ffn=2 * h)]


def _bucket_bytes(rank, world, specs, cap_mb):
    """The bytes of each gradient bucket fusedist's ZeRO-2 builds for each spec, in backward's order."""
    out = []
    for spec in specs:
        torch.manual_seed(0)
        ddp = fusedist.DistributedDataParallel(Transformer(spec), bucket_cap_mb=cap_mb)
        opt = fusedist.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
        x = torch.randint(0, spec.vocab, (2, spec.seq))
        F.cross_entropy(ddp(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        out.append([b.nbytes for b in ddp.buckets])
    return out


def _largest_three(sizes):
    """Three consecutive buckets: two reduce-scatters in flight (fusedist's default bound) and the
    bucket filling; fewer buckets: all of them."""
    return max((sum(sizes[i:i + 3]) for i in range(len(sizes) - 2)), default=sum(sizes))


def test_zero2_bucket_term_is_the_largest_run_of_the_buckets_fusedist_builds():
    """The term was 2 (cap + largest tensor): an untied model's embedding counted twice (1.9x
    the largest pair, though the embedding and the output layer fill the last and the first
    bucket), a tied one's likewise, and a mixture's stacked experts (one tensor a layer)
    not at all (half the pair). Then it was the largest two consecutive buckets, one short of
    what a backward that outruns its reduce-scatters holds (two in flight, one filling). It is
    the largest three consecutive buckets, exactly."""
    specs = _specs()
    cap_mb = random.choice([0.05, 0.1, 0.2])
    built = run_distributed(_bucket_bytes, 2, specs, cap_mb, timeout=120)[0]
    for spec, sizes in zip(specs, built):
        plan = build_plan(spec, Job(gpus=2, micro_batch=2, seq=spec.seq, precision="fp32", bucket_cap_mb=cap_mb,
                                    scratch_gb=0), PRESETS["h100"])
        held = _largest_three(sizes)
        assert plan["memory"]["zero2"]["temp_bytes"] == held, (spec, sizes, plan["memory"]["zero2"]["temp_bytes"])


def test_zero2_bucket_term_covers_the_default_first_bucket():
    """Under the default cap DDP's first bucket is 1 MiB, the cap when given: the term is the
    larger run of the two layouts, so it bounds both."""
    tensors = [random.randint(1, 4_000_000) for _ in range(random.randint(60, 120))]  # 0.5-2 GB of fp32
    mib = 1 << 20
    pairs = []
    for caps in ((25 * mib,), (mib, 25 * mib)):
        sizes = _bucket_elements(tensors[::-1], caps, 4, 2)
        pairs.append(_largest_three(sizes) * 4)
    assert max(pairs) < 4 * sum(tensors)
    assert temp_bytes("zero2", sum(tensors), "fp32", 0, 25.0, 0, n=2, tensors=tensors) == max(pairs)
    # a cap given other than the default: the cap's layout alone
    sizes = _bucket_elements(tensors[::-1], (10 * mib,), 4, 2)
    assert temp_bytes("zero2", sum(tensors), "fp32", 0, 10.0, 0, n=2, tensors=tensors) == 4 * _largest_three(sizes)


def _measure_zero2(rank, world, spec, job):
    from fusedist.plan.measure import measure_one
    return {s: measure_one(spec, job, s, 1, 1, torch.device("cpu")) for s in ("zero2", "zero2_offload")}


def test_measure_trains_the_bucket_cap_asked_for_and_reports_the_bucket_peak():
    """--measure trained DDP's default 25 MiB buckets whatever --bucket-cap-mb said, and never
    showed ZeRO-2's measured bucket peak beside the plan's term. Each bucket is one
    reduce-scatter a step, so their count shows the cap the run used."""
    from fusedist.plan.measure import _zero2_lines
    cap_mb = random.choice([0.02, 0.05])
    spec = ModelSpec(arch="llama", layers=2, hidden=32, heads=4, seq=8, vocab=random.randint(200, 600))
    job = Job(gpus=2, micro_batch=1, seq=spec.seq, precision="fp32", bucket_cap_mb=cap_mb)
    measured = run_distributed(_measure_zero2, 2, spec, job, timeout=120)[0]
    buckets = _bucket_elements(param_tensors(spec)[::-1], (cap_mb * (1 << 20),), 4, 2)
    for s, m in measured.items():
        assert m["collectives_per_step"]["reduce_scatter"] == len(buckets), (s, m["collectives_per_step"], buckets)
        assert 0 < m["peak_grad_bytes"] <= 4 * sum(buckets)
        m["predicted_grad_bucket_bytes"] = random.randint(1, 10**6)
    lines = _zero2_lines(measured, cap_mb)
    assert len(lines) == 2 and all(f"--bucket-cap-mb {cap_mb:g}" in line and "measured peak" in line
                                   for line in lines), lines


@pytest.mark.parametrize("flag,value", [("--precision", "fp32"), ("--precision", "bf16"),
                                        ("--recompute", "selective"), ("--optimizer", "sgd"),
                                        ("--convention", "paper")])
def test_choice_flags_in_any_case_are_the_same_plan(capsys, flag, value):
    """--precision BF16 was refused while --arch Llama and --gpu H100 were taken."""
    argv = ["--arch", "llama", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab",
            str(random.randint(100, 1000)), "--gpus", "2", "--json", flag]
    assert main(argv + [value]) == 0
    lower = capsys.readouterr().out
    assert main(argv + [random.choice([value.upper(), value.capitalize()])]) == 0
    assert capsys.readouterr().out == lower
    assert main(argv + [value + "x"]) == 2
    assert flag in capsys.readouterr().err
