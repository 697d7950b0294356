"""Fused optimizers on parameters on ``meta`` step, save and load as torch's optimizers do (step counts
kept on the CPU), each case against torch's own optimizer on the same state."""

from __future__ import annotations

import copy

import pytest
import torch

from fusedist.optim import FusedAdam, FusedAdamW, FusedLAMB, FusedSGD

META_CASES = {
    "adamw": (FusedAdamW, torch.optim.AdamW, dict(lr=0.1), torch.float32),
    "adam-amsgrad": (FusedAdam, torch.optim.Adam, dict(lr=0.1, amsgrad=True), torch.float32),
    "sgd-momentum": (FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9), torch.float32),
    "adamw-bf16-masters": (FusedAdamW, torch.optim.AdamW, dict(lr=0.1, master_weights=True), torch.bfloat16),
    "lamb": (FusedLAMB, None, dict(lr=0.1), torch.float32),
}


def _step_counts(opt, params) -> list:
    return [float(opt.state[p]["step"]) for p in params if "step" in opt.state[p]]


@pytest.mark.parametrize("case", list(META_CASES))
def test_parameters_on_meta_step_save_and_load_like_torch(case):
    """On ``meta`` (a model built without memory) torch's optimizers step, save and load, and
    keep the step counts on the CPU with their values. The fused ones failed: the C++ CPU Adam
    was picked for meta tensors and read their step counts (``Tensor.item() cannot be called
    on meta tensors``), FusedSGD's ``state_dict`` read counts kept on meta, a loaded master
    was compared with a meta parameter, and a real state dict loaded onto meta parameters lost
    its step counts (moved to meta)."""
    fused_cls, torch_cls, kw, dtype = META_CASES[case]
    torch.manual_seed(0)
    real = torch.nn.Linear(5, 3).to(dtype)
    real_opt = fused_cls(real.parameters(), **kw)
    for _ in range(3):
        real_opt.zero_grad()
        real(torch.randn(4, 5, dtype=dtype)).square().sum().backward()
        real_opt.step()
    saved = copy.deepcopy(real_opt.state_dict())
    counts = {cls: None for cls in (fused_cls, torch_cls) if cls is not None}
    for cls in counts:
        with torch.device("meta"):
            model = torch.nn.Linear(5, 3).to(dtype)
        own = kw if cls is fused_cls else {k: v for k, v in kw.items() if k != "master_weights"}
        opt = cls(model.parameters(), **own)
        opt.load_state_dict(copy.deepcopy(saved))
        loaded = _step_counts(opt, model.parameters())
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        state_dict = opt.state_dict()
        counts[cls] = (loaded, _step_counts(opt, model.parameters()))
        assert all(v.is_meta for st in state_dict["state"].values() for k, v in st.items() if k != "step")
        # a fresh optimizer on meta steps too, and its state dict loads into another
        fresh = cls(model.parameters(), **own)
        fresh.step()
        cls(model.parameters(), **own).load_state_dict(fresh.state_dict())
    if fused_cls is FusedSGD:
        return  # (its counts are its own: torch's SGD keeps none, and its state dict leaves them out)
    assert counts[fused_cls] == ([3.0, 3.0], [4.0, 4.0])
    if torch_cls is not None:
        assert counts[fused_cls] == counts[torch_cls]
