"""The optimizer's step counts in the planner's model states (Note [step counts] in
fusedist/plan/memory.py): torch's AdamW keeps a 0-dim float32 ``step`` a parameter (on the CPU
unless fused or capturable), fusedist's fused optimizers one on the parameter's device, and
ZeRO-1/2's inner optimizer one a flat piece of each gradient bucket. The planner counted none."""

import torch

from fusedist.optim import FusedAdamW
from fusedist.plan import Job, ModelSpec, build_plan
from fusedist.plan.hardware import PRESETS
from fusedist.plan.memory import bucket_count, model_states
from fusedist.plan.model import param_tensors
from fusedist.plan.torch_model import Transformer

SPEC = ModelSpec(arch="llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=48, seq=8, vocab=40)


def _step_bytes(opt) -> tuple:
    """(bytes of the ``step`` tensors, their dtypes) after one step."""
    steps = [st["step"] for st in opt.state.values()]
    return sum(t.numel() * t.element_size() for t in steps), {t.dtype for t in steps}


def test_step_counts_are_the_optimizers_own():
    torch.manual_seed(0)
    tensors = len(param_tensors(SPEC))
    for dtype, make, key in ((torch.bfloat16, lambda ps: FusedAdamW(ps, lr=1e-3, master_weights=True), "steps"),
                             (torch.float32, lambda ps: torch.optim.AdamW(ps, lr=1e-3), "host:steps")):
        model = Transformer(SPEC).to(dtype)
        assert len(list(model.parameters())) == tensors
        opt = make(model.parameters())
        model(torch.randint(40, (2, 8))).float().sum().backward()
        opt.step()
        kept, dtypes = _step_bytes(opt)
        assert dtypes == {torch.float32} and kept == 4 * tensors
        precision = "bf16" if dtype == torch.bfloat16 else "fp32"
        plan = build_plan(SPEC, Job(gpus=2, micro_batch=1, seq=8, precision=precision), PRESETS["h100"])
        for strategy in ("ddp", "zero3"):  # every parameter / piece stepped on every rank
            assert plan["memory"][strategy]["terms"][key] == kept, (precision, strategy)
        zero1 = plan["memory"]["zero1"]["terms"]  # torch's AdamW over one piece a bucket, CPU counts
        assert zero1["host:steps"] == 4 * bucket_count(tuple(param_tensors(SPEC)), 25.0, 4 if dtype == torch.float32
                                                       else 2, 2) == 4
    # SGD: torch's keeps no count (fp32, ZeRO's inner), FusedSGD one (16-bit DDP / ZeRO-3)
    assert "host:steps" not in model_states(1e6, 2, "zero1", "bf16", "sgd", step_tensors=3).terms
    assert model_states(1e6, 2, "ddp", "bf16", "sgd", step_tensors=3).terms["steps"] == 12
    assert "steps" not in model_states(1e6, 2, "ddp", "bf16", convention="paper", step_tensors=3).terms


def test_zero_pieces_are_one_a_bucket():
    """Five Linear(8, 8) at a 524-byte cap: fusedist's ZeRO steps 3 pieces a rank in fp32 (buckets
    of 4, 4 and 2 tensors) and 2 in bf16 (8 and 2), as its inner AdamW's state shows."""
    tensors = (64, 8) * 5
    assert bucket_count(tensors, 0.0005, 4, 2) == 3
    assert bucket_count(tensors, 0.0005, 2, 2) == 2
