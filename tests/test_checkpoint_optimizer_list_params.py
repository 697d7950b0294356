"""A list of optimizers loads each position's state only into the very parameters that saved it
(Note [one position, one set of parameters] in fusedist/checkpoint/_optimizer_list.py), strict
or not, as torch's ``Optimizer.load_state_dict`` refuses groups of other sizes: an optimizer
saved over two layers is refused over one (it loaded the first layer's state and dropped the
second's), over three, or over the same parameters in another number of param groups; a load
over the same parameters is torch's ``load_state_dict``, state for state.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from fusedist import checkpoint
from fusedist.checkpoint import CheckpointError, Checkpointer


class _Net(nn.Module):
    """A body whose second block has ``depth`` layers, and a head."""

    def __init__(self, depth: int):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), nn.Sequential(*[nn.Linear(4, 4) for _ in range(depth)]))
        self.head = nn.Linear(4, 2)


def _optimizers(model: _Net, groups: int = 1, sgd_groups: tuple = ()) -> list:
    """AdamW over the second block (its layers in ``groups`` param groups), SGD over the rest: in
    one param group, or with ``sgd_groups`` ("body", "head") the first body layer and the head
    each in one, in that order."""
    block = list(model.body[1].parameters())
    cut = len(block) // groups
    split = [block[:cut], block[cut:]] if groups == 2 else [block]
    rest = {"body": list(model.body[0].parameters()), "head": list(model.head.parameters())}
    sgd = [{"params": rest[k]} for k in sgd_groups] or [*rest["body"], *rest["head"]]
    return [torch.optim.AdamW([{"params": p} for p in split], lr=1e-2), torch.optim.SGD(sgd, lr=0.1, momentum=0.9)]


def _trained(seed: int, depth: int = 2):
    torch.manual_seed(seed)
    model = _Net(depth)
    opts = _optimizers(model)
    for _ in range(2):
        x = torch.randn(5, 3)
        for opt in opts:
            opt.zero_grad()
        model.head(model.body(x)).square().mean().backward()
        for opt in opts:
            opt.step()
    return model, opts


def _save(path: str, how: str, model, opts) -> None:
    if how == "load":
        checkpoint.save(path, model, opts)
    else:
        with Checkpointer(path, every_steps=1, async_save=False) as ckpt:
            ckpt.restore(model, opts)
            ckpt.save(1)


def _load(path: str, how: str, model, opts, strict: bool):
    if how == "load":
        return checkpoint.load(path, model, opts, strict=strict)
    with Checkpointer(path, every_steps=1, async_save=False) as ckpt:
        return ckpt.restore(model, opts, strict=strict)


def _state(opt) -> list:
    """The optimizer's state dict as plain values, for exact comparison."""
    sd = opt.state_dict()
    return [sd["param_groups"], {i: {k: v.clone() for k, v in s.items()} for i, s in sd["state"].items()}]


@pytest.mark.parametrize("how", ["load", "Checkpointer.restore"])
@pytest.mark.parametrize("depth, groups", [(1, 1), (3, 1), (2, 2)],
                         ids=["fewer parameters", "more parameters", "more param groups"])
def test_an_optimizer_over_other_parameters_is_refused_strict_or_not(tmp_path, how, depth, groups):
    seed = int.from_bytes(os.urandom(2), "little")
    saved, saved_opts = _trained(seed)
    path = str(tmp_path / "ckpt")
    _save(path, how, saved, saved_opts)
    torch.manual_seed(seed + 1)
    model = _Net(depth)
    opts = _optimizers(model, groups)
    with pytest.raises(ValueError, match="parameter group|number of parameter groups"):  # torch's own refusal
        _optimizers(_Net(depth), groups)[0].load_state_dict(saved_opts[0].state_dict())
    before = [p.detach().clone() for p in model.parameters()], [_state(o) for o in opts]
    for strict in (False, True):
        with pytest.raises(CheckpointError) as info:
            _load(path, how, model, opts, strict)
        message = str(info.value)
        assert "optimizer 0 (AdamW)" in message, message
        assert f"was saved over 4 parameters in 1 param group(s); here it steps {2 * depth} in {groups}" in message
        if depth == 1:
            assert "saved but not stepped here ['body.1.1.weight', 'body.1.1.bias']" in message, message
        if depth == 3:
            assert "stepped here but not saved ['body.1.2.weight', 'body.1.2.bias']" in message, message
        # nothing changed: the model and both optimizers as they were
        assert all(torch.equal(a, b) for a, b in zip(before[0], model.parameters()))
        for o, state in zip(opts, before[1]):
            assert _state(o)[0] == state[0] and _state(o)[1].keys() == state[1].keys()


@pytest.mark.parametrize("how", ["load", "Checkpointer.restore"])
def test_a_load_that_is_not_strict_over_the_saved_parameters_is_torchs_load_state_dict(tmp_path, how):
    """A head added since the save is left out of the model load; the optimizers over the saved
    parameters take their state exactly as torch's load_state_dict gives it."""
    seed = int.from_bytes(os.urandom(2), "little")
    saved, saved_opts = _trained(seed)
    path = str(tmp_path / "ckpt")
    _save(path, how, saved, saved_opts)
    torch.manual_seed(seed + 1)
    model = _Net(2)
    model.extra = nn.Linear(2, 2)  # (in no optimizer: it goes with the first view, as a frozen parameter)
    opts = _optimizers(model)
    _load(path, how, model, opts, strict=False)
    for mine, theirs in zip(opts, saved_opts):
        reference = type(theirs)([{"params": [nn.Parameter(p.detach().clone()) for p in g["params"]]}
                                  for g in mine.param_groups])
        reference.load_state_dict(theirs.state_dict())
        ours, expected = mine.state_dict(), reference.state_dict()
        assert ours["param_groups"] == expected["param_groups"]
        assert ours["state"].keys() == expected["state"].keys()
        for i, s in expected["state"].items():
            for key, value in s.items():
                assert torch.equal(ours["state"][i][key], value), (type(mine).__name__, i, key)
    for p, q in zip(model.body.parameters(), saved.body.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("flat", [False, True], ids=["torch dcp", "torch dcp flattened, groups recorded"])
def test_torch_dcp_of_a_list_into_a_position_of_another_group_count_is_refused_naming_it(tmp_path, flat):
    """torch's distributed checkpoint of ``get_state_dict(model, [opts])``: a position's optimizer
    in one param group took the state saved in two (merged by name, as pipeline stages re-split
    may be); torch's load_state_dict refuses another number of groups, and so does the list now,
    naming the position and both counts, nothing changed. In the saved grouping it loads as
    torch's set_state_dict loads it."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    seed = int.from_bytes(os.urandom(2), "little")
    torch.manual_seed(seed)
    saved = _Net(1)
    saved_opts = _optimizers(saved, groups=2, sgd_groups=("body", "head"))
    saved.head(saved.body(torch.randn(5, 3))).square().mean().backward()
    for opt in saved_opts:
        opt.step()
    msd, osd = get_state_dict(saved, saved_opts, options=StateDictOptions(flatten_optimizer_state_dict=flat))
    if flat:
        osd = checkpoint.record_param_groups(saved, saved_opts, osd)
    path = str(tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (one process: DCP warns that it saves alone)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    with pytest.raises(ValueError, match="different number of parameter groups"):  # torch's own refusal
        _optimizers(_Net(1))[0].load_state_dict(saved_opts[0].state_dict())

    torch.manual_seed(seed + 1)
    model = _Net(1)
    opts = _optimizers(model)
    before = [p.detach().clone() for p in model.parameters()], [_state(o) for o in opts]
    with pytest.raises(CheckpointError, match=r"optimizer 0 \(AdamW\) of the list in .*holds its parameters in 1 "
                       r"param group\(s\), the checkpoint in 2 .*nothing was loaded"):
        checkpoint.load(path, model, opts)
    assert all(torch.equal(a, b) for a, b in zip(before[0], model.parameters()))
    for o, state in zip(opts, before[1]):
        assert _state(o)[0] == state[0] and not o.state

    # the second optimizer's groups named by its own index (they are the list's groups 2 and 3)
    for sgd_groups, expected in (((), "holds its parameters in 1 param group(s), the checkpoint in 2 (its group 0: "
                                      "'body.0.weight', 'body.0.bias'; its group 1: 'head.weight', 'head.bias')"),
                                 (("head", "body"), "parameter 'head.weight' is in param group 0 of the optimizer but "
                                                    "was saved in its param group 1 with 'head.bias'")):
        with pytest.raises(CheckpointError) as refused:
            checkpoint.load(path, model, _optimizers(model, groups=2, sgd_groups=sgd_groups))
        assert "the state of optimizer 1 (SGD) of the list in" in str(refused.value), refused.value
        assert expected in str(refused.value), refused.value
    assert all(torch.equal(a, b) for a, b in zip(before[0], model.parameters()))

    same = _optimizers(model, groups=2, sgd_groups=("body", "head"))
    checkpoint.load(path, model, same)
    reference = _Net(1)
    reference_opts = _optimizers(reference, groups=2, sgd_groups=("body", "head"))
    set_state_dict(reference, reference_opts, model_state_dict=msd, optim_state_dict=osd)
    for mine, theirs in zip(same, reference_opts):
        ours, expected = _state(mine), _state(theirs)
        assert ours[0] == expected[0] and ours[1].keys() == expected[1].keys()
        for i, s in expected[1].items():
            assert all(torch.equal(ours[1][i][k], v) for k, v in s.items()), (type(mine).__name__, i)
