"""Fused optimizers against torch: FusedLAMB with a tensor learning rate, and
realistic recipes (param groups added mid-training, torch state dicts both ways, maximize /
amsgrad, chained LR schedulers).

Parameters are fp32. Where both sides run the same arithmetic on the same numbers the
comparison is exact; against torch's own optimizers, 1e-6 absolute (a few fp32 ulps per step
on values of order 1, as in test_optim.py); against the fp64 LAMB reference, 1e-5 (as there).
"""

from __future__ import annotations

import copy

import pytest
import torch

from fusedist.optim import FusedLAMB

from test_optim import (  # noqa: F401
    BACKENDS, SHAPES, _assert_params_close, _clone_params, _grads, _params, _reference_lamb, _set_grads,
)


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", request.param)
    return request.param


# -- FusedLAMB with a tensor lr ------------------------------------------------------------------


def test_lamb_takes_a_tensor_lr_like_a_float_and_like_the_reference(backend):
    """torch's optimizers take ``lr=torch.tensor(...)``; FusedLAMB refused it (TypeError). Its
    steps now equal those with the same value as a float, and the fp64 reference's."""
    lr = torch.tensor(1e-2)
    ours, floats = _params(seed=3), _params(seed=3)
    start = _clone_params(ours)
    opt = FusedLAMB(ours, lr=lr, weight_decay=0.01)
    ref = FusedLAMB(floats, lr=float(lr), weight_decay=0.01)  # the tensor's value exactly
    all_grads = []
    for step in range(6):
        grads = _grads(step)
        all_grads.append(grads)
        _set_grads(ours, grads)
        _set_grads(floats, grads)
        opt.step()
        ref.step()
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    _assert_params_close(ours, floats, atol=0)
    expected = _reference_lamb(start, all_grads, float(lr), (0.9, 0.999), 1e-6, 0.01, 1.0)
    _assert_params_close([p.double() for p in ours], expected, atol=1e-5)


def test_lamb_tensor_lr_follows_a_scheduler_and_state_dicts(backend):
    """A scheduler changes a tensor lr in place: each step uses the current value, as the float
    path under the same scheduler does; the state dict keeps the tensor; a 1-element (not 0-d)
    tensor works; a tensor of several elements is refused as torch refuses it."""
    ours, floats = _params(seed=4), _params(seed=4)
    opt = FusedLAMB(ours, lr=torch.tensor([0.02]), weight_decay=0.1)
    ref = FusedLAMB(floats, lr=float(torch.tensor(0.02)), weight_decay=0.1)
    scheds = [torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.5) for o in (opt, ref)]
    for step in range(4):
        grads = _grads(step)
        _set_grads(ours, grads)
        _set_grads(floats, grads)
        opt.step()
        ref.step()
        for s in scheds:
            s.step()
        # torch's scheduler writes the tensor in place (fp32) and the float as a double:
        # continue the float path from the tensor's value, so the two stay the same numbers.
        ref.param_groups[0]["lr"] = float(opt.param_groups[0]["lr"])
    _assert_params_close(ours, floats, atol=0)
    state = copy.deepcopy(opt.state_dict())
    assert isinstance(state["param_groups"][0]["lr"], torch.Tensor)
    again = FusedLAMB(_clone_params(ours), lr=1.0, weight_decay=0.1)
    again.load_state_dict(state)
    assert isinstance(again.param_groups[0]["lr"], torch.Tensor)
    with pytest.raises(ValueError, match=r"param group 0.*Tensor lr must be 1-element"):
        FusedLAMB(_params(), lr=torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="invalid learning rate"):
        FusedLAMB(_params(), lr=torch.tensor(-1.0))


# -- torch's distributed checkpoint of torch's AdamW into FusedAdamW with master weights ---------


def _bf16_net(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(torch.bfloat16)


def _torch_job(kw: dict):
    """A bf16 model and torch's AdamW (``kw``) after two steps: what a torch job checkpoints."""
    source = _bf16_net(0)
    source_opt = torch.optim.AdamW(source.parameters(), **kw)
    for step in range(2):
        _grads_of(source, step)
        source_opt.step()
    return source, source_opt


def _grads_of(model, seed):
    model.zero_grad()
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_dcp_checkpoint_into_fused_adamw_with_master_weights(tmp_path):
    """A bf16 model trained with torch's AdamW, saved with DCP, loaded into FusedAdamW with
    master_weights=True (which has already stepped: other weights, other masters). Loading
    needs a planner that lets the masters be missing (torch's strict load names the key); the
    masters then come from the loaded parameters -- before, the next step wrote the target's
    stale masters over them. The run continues exactly as a plain load_state_dict of torch's
    state does, and within fp32 rounding of torch's AdamW stepping FP32 copies of the loaded
    weights (the master-weight recipe done by hand)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # (a BaseException)
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from fusedist.checkpoint import FusedOptimizerLoadPlanner
    from fusedist.optim import FusedAdamW

    kw = dict(lr=1e-2, weight_decay=0.1)
    source, source_opt = _torch_job(kw)
    msd, osd = get_state_dict(source, source_opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))

    def fused_target(seed):
        model = _bf16_net(seed)
        opt = FusedAdamW(model.parameters(), master_weights=True, **kw)
        _grads_of(model, 100 + seed)
        opt.step()
        return model, opt

    target, opt = fused_target(1)
    msd, osd = get_state_dict(target, opt)
    state = {"model": msd, "optim": osd}
    with pytest.raises(CheckpointException,
                       match=r"Missing key in checkpoint state_dict: optim\..*\.master_(param|weights)"):
        dcp.load(copy.deepcopy(state), checkpoint_id=str(tmp_path))
    dcp.load(state, checkpoint_id=str(tmp_path), planner=FusedOptimizerLoadPlanner())
    set_state_dict(target, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), source.parameters()))

    plain, plain_opt = fused_target(2)  # the same state through load_state_dict
    plain.load_state_dict(source.state_dict())
    plain_opt.load_state_dict(copy.deepcopy(source_opt.state_dict()))
    ref = _bf16_net(3).float()  # torch's AdamW on FP32 copies of the loaded weights
    ref.load_state_dict({k: v.float() for k, v in source.state_dict().items()})
    ref_opt = torch.optim.AdamW(ref.parameters(), **kw)
    ref_opt.load_state_dict(copy.deepcopy(source_opt.state_dict()))  # moments widened to fp32, exactly
    for step in range(2, 5):
        grads = _grads_of(target, step)
        for p, q, r, g in zip(target.parameters(), plain.parameters(), ref.parameters(), grads):
            q.grad, r.grad = g.clone(), g.float()
        opt.step()
        plain_opt.step()
        ref_opt.step()
    for p, q, r in zip(target.parameters(), plain.parameters(), ref.parameters()):
        assert torch.equal(p, q) and torch.equal(opt.state[p]["master_param"], plain_opt.state[q]["master_param"])
        # fp32 masters of order 1 after a few steps: 1e-6 as against torch elsewhere; the bf16
        # weights are the masters rounded, so within one bf16 ulp (2**-7 relative) of torch's.
        torch.testing.assert_close(opt.state[p]["master_param"], r.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(p.detach().float(), r.detach(), rtol=2**-7, atol=1e-6)
    assert opt.state[target[0].weight]["step"].item() == 5


def test_a_consistent_master_survives_loading_the_optimizer_before_the_model():
    """The loaded masters are checked against the parameters at the next step (not at load):
    a program that loads the optimizer first, then the model, continues bit for bit -- the
    masters, which hold more bits than the bf16 weights, are kept."""
    from fusedist.optim import FusedAdamW

    model = _bf16_net(0)
    opt = FusedAdamW(model.parameters(), lr=1e-2, master_weights=True)
    for step in range(3):
        _grads_of(model, step)
        opt.step()
    saved_opt, saved_model = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    assert any(not torch.equal(opt.state[p]["master_param"], p.float()) for p in model.parameters())
    other = _bf16_net(7)
    other_opt = FusedAdamW(other.parameters(), lr=1e-2, master_weights=True)
    other_opt.load_state_dict(saved_opt)
    other.load_state_dict(saved_model)
    for step in range(3, 5):
        for o in (model, other):
            _grads_of(o, step)
        opt.step()
        other_opt.step()
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q) and torch.equal(opt.state[p]["master_param"], other_opt.state[q]["master_param"])


# -- tensor betas, as torch's Adam/AdamW take them -------------------------------------------------


@pytest.mark.parametrize("fused_name,torch_cls", [("FusedAdam", torch.optim.Adam), ("FusedAdamW", torch.optim.AdamW)])
def test_tensor_betas_step_like_torch(backend, fused_name, torch_cls):
    """torch's Adam/AdamW take ``betas`` as two 1-element tensors (kept 0-d in the group);
    fusedist refused them (TypeError). Steps, amsgrad and maximize included, equal torch's
    within 1e-6 (fp32, as against torch elsewhere), the tensors survive a state-dict round
    trip both ways, and torch's refusals are the same."""
    import fusedist.optim as fo

    fused_cls = getattr(fo, fused_name)
    ours = _params(seed=5)
    theirs = _clone_params(ours)
    kw = dict(lr=1e-2, weight_decay=0.05, amsgrad=True, maximize=True)
    opt = fused_cls(ours, betas=(torch.tensor([0.8]), torch.tensor(0.95)), **kw)
    ref = torch_cls(theirs, betas=(torch.tensor([0.8]), torch.tensor(0.95)), **kw)
    assert all(isinstance(b, torch.Tensor) and b.dim() == 0 for b in opt.param_groups[0]["betas"])
    for step in range(4):
        if step == 2:  # changed in place, as a program or scheduler may
            for o in (opt, ref):
                o.param_groups[0]["betas"][0].fill_(0.7)
        grads = _grads(step)
        _set_grads(ours, grads)
        _set_grads(theirs, grads)
        opt.step()
        ref.step()
    _assert_params_close(ours, theirs, atol=1e-6)
    again = torch_cls(_clone_params(ours), **kw)
    again.load_state_dict(copy.deepcopy(opt.state_dict()))
    back = fused_cls(_clone_params(ours), **kw)
    back.load_state_dict(copy.deepcopy(ref.state_dict()))
    for o in (again, back):
        assert all(isinstance(b, torch.Tensor) for b in o.param_groups[0]["betas"])
    for cls, params in ((torch_cls, theirs), (fused_cls, ours)):
        with pytest.raises(ValueError, match="betas must be either both floats or both Tensors"):
            cls(params, betas=(torch.tensor(0.9), 0.999))
        with pytest.raises(ValueError,
                           match=r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True"):
            cls(params, betas=(torch.tensor(0.9), torch.tensor(0.999)), foreach=True)
    # (torch's range check on the tensor fails first there: RuntimeError "Boolean value of Tensor ...")
    with pytest.raises(ValueError, match=r"Tensor betas\[1\] must be 1-element"):
        fused_cls(ours, betas=(torch.tensor(0.9), torch.tensor([0.9, 0.99])))
