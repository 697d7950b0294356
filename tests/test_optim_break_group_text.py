"""A fused optimizer's param groups written as text read as torch's.

A program swapping torch.optim.Adam/AdamW/SGD for the fused ones and logging or saving its
``state_dict()["param_groups"]`` as JSON (or YAML, or a log line) sees the same text: the same
keys in torch's order and torch's default values with their types (``weight_decay: 0``, not
``0.0``). Oracle: torch's optimizer built, grown and stepped the same way, compared through
``json.dumps``. A fusedist-only setting given away from its default (``master_weights=True``)
comes after torch's keys.
"""

from __future__ import annotations

import json

import pytest
import torch

from fusedist.optim import FusedAdam, FusedAdamW, FusedSGD

PAIRS = [
    (FusedAdam, torch.optim.Adam, {}),
    (FusedAdamW, torch.optim.AdamW, {}),
    (FusedAdamW, torch.optim.AdamW, {"weight_decay": 0, "amsgrad": True}),
    (FusedSGD, torch.optim.SGD, {}),
    (FusedSGD, torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
]


def _groups_text(optimizer_cls, kwargs):
    """The param groups' JSON after construction with two groups, one added group and a step."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(3)]
    opt = optimizer_cls([{"params": [params[0]]}, {"params": [params[1]], "lr": 0.1}], **kwargs)
    opt.add_param_group({"params": [params[2]], "weight_decay": 0})
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return json.dumps(opt.state_dict()["param_groups"])


@pytest.mark.parametrize("fused_cls,torch_cls,kwargs", PAIRS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_param_groups_as_text_match_torch(fused_cls, torch_cls, kwargs):
    assert _groups_text(fused_cls, kwargs) == _groups_text(torch_cls, kwargs)


def test_fusedist_only_setting_follows_torch_keys():
    group = FusedAdamW([torch.nn.Parameter(torch.ones(2))], master_weights=True).state_dict()["param_groups"][0]
    torch_group = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]).state_dict()["param_groups"][0]
    assert list(group) == [k for k in torch_group if k != "params"] + ["master_weights", "params"]
