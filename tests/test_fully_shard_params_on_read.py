"""The parameter tables ``init_parameters`` gives modules while ``model.apply(fn)`` runs (Note [whole
only when read] in fusedist/fsdp/param_init.py): every way torch's ``nn.Module`` and plain Python
hand out or change a parameter reports it first, and what only names parameters (``setattr`` of a
flag, ``hasattr``, ``in``, ``keys()``) does not. Single process: the tables need no ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusedist.fsdp.params_on_read import ParamsOnRead, unwatch_params, watch_params


def _watched():
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    reads = []
    watched = watch_params([module], lambda: reads.append(1))
    return module, reads, watched


READS = {
    "attribute": lambda m: m.weight,
    "parameters()": lambda m: list(m.parameters()),
    "named_parameters()": lambda m: dict(m.named_parameters()),
    "state_dict()": lambda m: m.state_dict(),
    "get": lambda m: m._parameters.get("bias"),
    "values": lambda m: list(m._parameters.values()),
    "dict()": lambda m: dict(m._parameters),
    "unpacked": lambda m: {**m._parameters},
    "copy": lambda m: m._parameters.copy(),
    "assign a parameter": lambda m: setattr(m, "bias", nn.Parameter(torch.zeros(2))),
    "delete a parameter": lambda m: delattr(m, "bias"),
    "register_parameter": lambda m: m.register_parameter("extra", nn.Parameter(torch.zeros(1))),
}

NOT_READS = {
    "a flag": lambda m: setattr(m, "flag", True),
    "training": lambda m: m.train(False),
    "hasattr": lambda m: hasattr(m, "missing"),
    "in": lambda m: "weight" in m._parameters,
    "keys": lambda m: list(m._parameters.keys()),
    "iteration": lambda m: list(m._parameters),
    "len": lambda m: len(m._parameters),
}


@pytest.mark.parametrize("what", list(READS))
def test_every_read_or_write_of_a_parameter_reports_first(what):
    module, reads, watched = _watched()
    READS[what](module)
    assert reads, f"{what} handed out or changed a parameter without reporting it"
    unwatch_params(watched)


@pytest.mark.parametrize("what", list(NOT_READS))
def test_what_only_names_parameters_reports_nothing(what):
    module, reads, watched = _watched()
    NOT_READS[what](module)
    assert reads == [], f"{what} reported a parameter read"
    unwatch_params(watched)


def test_unwatching_gives_the_module_its_own_table_with_what_it_holds_now():
    module, _, watched = _watched()
    original = watched[0][1]
    assert isinstance(module._parameters, ParamsOnRead)
    module.bias = nn.Parameter(torch.ones(2))  # a replacement made while watched is kept
    unwatch_params(watched)
    assert module._parameters is original and type(original) is dict
    assert torch.equal(module.bias, torch.ones(2)) and set(original) == {"weight", "bias"}
