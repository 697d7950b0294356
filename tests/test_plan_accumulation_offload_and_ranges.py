"""The planner (``python -m fusedist.plan``) against ground truth: the bytes fusedist's ZeRO-2 really
sends with gradient accumulation, the K its memory terms use, the optimizers its offload runs, and the
CLI's one-line errors for figures beyond what it models."""

import random

import pytest
import torch
import torch.nn.functional as F

import fusedist
from fusedist.plan import ModelSpec
from fusedist.plan.cli import main
from fusedist.plan.hardware import PRESETS
from fusedist.plan.measure import CommCounter
from fusedist.plan.memory import STRATEGIES
from fusedist.plan.plan import Job, build_plan
from fusedist.plan.torch_model import Transformer
from fusedist.testing import run_distributed


@pytest.mark.parametrize("flags", [("--gpu-memory-gb", "1e300"), ("--scratch-gb", "1e300"),
                                   ("--host-memory-gb", "1e300"), ("--peak-tflops", "1e300"),
                                   ("--peak-tflops", "1e-300", "--mfu", "1e-300")])
def test_out_of_range_hardware_figures_are_one_line_naming_the_flag(capsys, flags):
    """A figure past what the planner models overflowed the headroom to a traceback
    (OverflowError), or underflowed the peak to a ZeroDivisionError: exit 2, one line, the flag."""
    code = main(["--params", f"{random.randint(1, 70)}B", "--gpus", "8", "--seq", "1024", *flags])
    err = capsys.readouterr().err.strip()
    named = [f for f in flags if f.startswith("--") and f in err]
    assert code == 2 and len(err.splitlines()) == 1 and named, err


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_reported_k_is_the_one_the_memory_terms_use(precision, optimizer):
    """The plan's assumptions listed K = 8 for zero2_offload in fp32, whose host optimizer
    term holds FP32 masters too (K = 12)."""
    psi, n = random.randint(10**8, 10**10), random.choice([2, 4, 8])
    plan = build_plan(ModelSpec(params=psi), Job(gpus=n, micro_batch=1, seq=512, precision=precision,
                                                  optimizer=optimizer), PRESETS["h100"])
    for s in STRATEGIES:
        terms = plan["memory"][s]["terms"]
        opt = terms.get("optimizer", terms.get("host:optimizer"))
        per_param = opt / (psi if s == "ddp" else psi / n)
        assert per_param == pytest.approx(plan["inputs"]["assumptions"]["K"][s], abs=1e-6), s


def test_sgd_is_never_suggested_zero2_offload():
    """fusedist's ZeRO-2 offload runs Adam only (refusing SGD); the planner suggested it for SGD."""
    from fusedist.zero.offload import check_offload_config
    with pytest.raises(TypeError, match="SGD"):
        check_offload_config(torch.optim.SGD, {})
    psi = random.uniform(30e9, 34e9)  # zero2 does not fit on 16 H100s, zero2_offload does
    plan = build_plan(ModelSpec(params=int(psi)), Job(gpus=16, micro_batch=1, seq=2048, optimizer="sgd"),
                      PRESETS["h100"])
    assert plan["memory"]["zero2_offload"]["fits"] and not plan["memory"]["zero2"]["fits"]
    assert plan["suggestion"]["strategy"] != "zero2_offload"
    assert plan["memory"]["zero2_offload"]["runs"] is False
    adam = build_plan(ModelSpec(params=int(psi)), Job(gpus=16, micro_batch=1, seq=2048), PRESETS["h100"])
    assert adam["memory"]["zero2_offload"]["runs"] is True


_SPEC = ModelSpec(arch="gpt", layers=2, hidden=32, heads=4, seq=16, vocab=64)


def _zero2_accumulating(rank, world, accum, seed):
    """Bytes a ZeRO-2 rank sends in one step of ``accum`` micro-batches, every backward
    synchronized (the memory the planner gives ZeRO-2 holds no full gradients)."""
    torch.manual_seed(seed)
    ddp = fusedist.DistributedDataParallel(Transformer(_SPEC))
    opt = fusedist.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
    counter = CommCounter(ddp.comm)
    for step in range(2):
        counter.active, counter.bytes = step == 1, 0.0
        for _ in range(accum):
            x = torch.randint(0, _SPEC.vocab, (2, _SPEC.seq))
            F.cross_entropy(ddp(x).flatten(0, 1), x.flatten()).backward()
            held = [p for p in ddp.parameters() if p.grad is not None]
            assert not held, "stage 2 kept full gradients between micro-batches"
        opt.step()
        opt.zero_grad()
    return counter.bytes


def test_zero2_communication_with_gradient_accumulation_is_what_it_sends():
    """The planner's zero2 sent one reduce-scatter a step whatever the accumulation, with
    memory for no full gradients: each micro-batch reduce-scatters (1.5x the bytes at 2)."""
    accum, world = random.choice([2, 3]), 2
    sent = run_distributed(_zero2_accumulating, world, accum, random.randint(0, 10**6), timeout=120)[0]
    plan = build_plan(_SPEC, Job(gpus=world, micro_batch=2, seq=_SPEC.seq, global_batch=2 * world * accum,
                                 precision="fp32"), PRESETS["h100"])
    assert plan["suggestion"]["grad_accum_steps"] == accum
    assert plan["comm"]["zero2"]["bytes_per_step"] == pytest.approx(sent, rel=0.02)
