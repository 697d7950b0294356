"""The optimizer's step counts in the planner's model states (Note [step counts] in
fusedist/plan/memory.py): torch's AdamW keeps a 0-dim float32 ``step`` a parameter (on the CPU
unless fused or capturable), fusedist's fused optimizers one on the parameter's device, and
ZeRO-1/2's inner optimizer one a flat piece of each gradient bucket. The planner counted none."""

import torch

from fusedist.optim import FusedAdamW
from fusedist.plan import Job, ModelSpec, build_plan
from fusedist.plan.hardware import PRESETS
from fusedist.plan.memory import bucket_count, model_states, zero_pieces
from fusedist.plan.param_tensors import param_tensors
from fusedist.plan.plan import _groups
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


def _fusedist_pieces(spec, groups_of, dtype, cap_bytes: int, world: int) -> int:
    """The pieces the busiest rank's inner optimizer steps: fusedist's own gradient buckets (DDP's
    layout, gradients' order) and ZeRO's flat partition of them, param groups from ``groups_of``."""
    from fusedist.ddp.layout import build_layout
    from fusedist.zero.partition import FlatPartition
    params = list(Transformer(spec).to(dtype).parameters())
    order = params[::-1]
    layout = build_layout(order, [str(i) for i in range(len(order))], caps=[cap_bytes], world_size=world,
                          device=torch.device("cpu"))
    group_of = [groups_of(p) for p in params]
    return max(len(FlatPartition(layout.buckets, params, group_of, rank, world).pieces) for rank in range(world))


def test_zero_pieces_follow_the_param_groups():
    """A no-weight-decay group for the norms and biases (nanoGPT's and the HF Trainer's split) cuts
    each bucket's slice wherever the group changes: the planner counted one piece a bucket."""
    gpt = ModelSpec(arch="gpt", layers=2, hidden=32, heads=4, seq=8, vocab=40)
    plain = (lambda p: 0)
    no_decay = (lambda p: int(p.dim() < 2))
    for spec in (SPEC, gpt):
        tensors = tuple(param_tensors(spec))
        for split, rule in ((plain, "one"), (no_decay, "no-decay")):
            groups = _groups(spec, 1, rule)
            for dtype, g in ((torch.float32, 4), (torch.bfloat16, 2)):
                for cap_mb, world in ((0.004, 2), (0.004, 3), (1.0, 2), (0.0005, 4)):
                    real = _fusedist_pieces(spec, split, dtype, int(cap_mb * 2**20), world)
                    assert zero_pieces(tensors, groups, cap_mb, g, world) == real, (spec.arch, rule, cap_mb, world)
        # the plan's count, as --param-groups gives it
        for rule, split in (("one", plain), ("no-decay", no_decay)):
            plan = build_plan(spec, Job(gpus=2, micro_batch=1, seq=8, precision="fp32", bucket_cap_mb=0.004,
                                        param_groups=rule), PRESETS["h100"])
            assert plan["memory"]["zero1"]["terms"]["host:steps"] == 4 * _fusedist_pieces(
                spec, split, torch.float32, int(0.004 * 2**20), 2)
    assert _fusedist_pieces(SPEC, no_decay, torch.float32, 1 << 20, 2) > _fusedist_pieces(SPEC, plain, torch.float32,
                                                                                          1 << 20, 2)


def test_param_groups_flag(capsys):
    import json
    from fusedist.plan import cli
    shape = ["--arch", "gpt", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "8", "--vocab", "40",
             "--gpus", "2", "--precision", "fp32", "--bucket-cap-mb", "0.004", "--json"]
    steps = {}
    for rule in ("one", "no-decay"):
        assert cli.main([*shape, "--param-groups", rule]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["inputs"]["param_groups"] == rule
        steps[rule] = plan["memory"]["zero2"]["terms"]["host:steps"]
    assert steps["no-decay"] > steps["one"]
    assert cli.main([*shape, "--param-groups", "layerwise"]) == 2
    assert "--param-groups: invalid choice" in capsys.readouterr().err
