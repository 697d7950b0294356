"""fusedist.checkpoint across strategies and parameter orders:

* a model that registers its parameters in another order (same names, same shapes): the
  optimizer's state is matched by name, as torch's distributed checkpoint matches it (Note
  [parameters in another order] in fusedist/checkpoint/_load_plan.py). Before, the load was
  refused ("parameter 0 is 'a.weight' in the checkpoint, 'head.weight' here");
* torch's distributed checkpoint (``dcp.save`` of ``get_state_dict``) of a fusedist DDP model
  continued on a ZeroRedundancyOptimizer with ``fusedist.checkpoint.load``: with the names
  torch's helpers give it now (torch DDP's, Note [checkpoint names through the DDP wrapper] in
  fusedist/ddp/dcp_names.py) and with the ``module.`` they carried before. Before, the model
  loaded and the optimizer state was refused ("entry 'state.module.a.weight.step' names no
  parameter of the optimizer").

Every step uses one global batch of 12 samples split evenly over the ranks and DDP averages,
so a run equals the single-process torch AdamW run up to summation order (fp32, 1e-6 after 6
steps; two same-shaped layers swapping their moments give errors of order lr = 1e-2).
"""

import torch
import torch.distributed as dist
from torch import nn

from fusedist.testing import run_distributed

GLOBAL_BATCH = 12
TOL = 1e-6


class TwoLayers(nn.Module):
    """Two same-shaped layers and a head; ``reverse`` registers them in the opposite order."""

    def __init__(self, reverse: bool = False):
        super().__init__()
        if reverse:
            self.head = nn.Linear(5, 3)
            self.b = nn.Linear(5, 5)
            self.a = nn.Linear(5, 5)
        else:
            self.a = nn.Linear(5, 5)
            self.b = nn.Linear(5, 5)
            self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _model(seed: int, reverse: bool) -> nn.Module:
    torch.manual_seed(seed)
    state = TwoLayers().state_dict()
    model = TwoLayers(reverse)
    model.load_state_dict(state)
    return model


def _groups(model):
    named = list(model.named_parameters())
    return [dict(params=[p for n, p in named if n.endswith("weight")], weight_decay=0.1),
            dict(params=[p for n, p in named if n.endswith("bias")], weight_decay=0.0, lr=5e-3)]


def _steps(model, opt, first, last, rank, world_size):
    for step in range(first, last):
        gen = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(GLOBAL_BATCH, 5, generator=gen), torch.randn(GLOBAL_BATCH, 3, generator=gen)
        per = GLOBAL_BATCH // world_size
        opt.zero_grad()
        nn.functional.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        opt.step()
        for group in opt.param_groups:  # a scheduler's edit, which the load must keep
            group["lr"] *= 0.9
    if hasattr(opt, "wait_for_params"):
        opt.wait_for_params()


def _weights(model) -> dict:
    inner = getattr(model, "module", model)
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


def _make(kind: str, seed: int, reverse: bool):
    import fusedist

    model = fusedist.DistributedDataParallel(_model(seed, reverse))
    if kind == "zero":
        return model, fusedist.ZeroRedundancyOptimizer(_groups(model.module), torch.optim.AdamW, stage=2, lr=1e-2)
    return model, torch.optim.AdamW(_groups(model.module), lr=1e-2)


def _worker(rank, world_size, root):
    """Save after 3 steps in one order and strategy, load into the other, train 3 more."""
    import fusedist

    out = {}
    for save_kind, load_kind, save_reverse in (("zero", "ddp", False), ("ddp", "zero", True)):
        directory = f"{root}/{save_kind}-{int(save_reverse)}"
        model, opt = _make(save_kind, 0, save_reverse)
        _steps(model, opt, 0, 3, rank, world_size)
        fusedist.checkpoint.save(directory, model, opt)
        dist.barrier()
        model, opt = _make(load_kind, 7, not save_reverse)
        fusedist.checkpoint.load(directory, model, opt)
        _steps(model, opt, 3, 6, rank, world_size)
        out[save_kind, load_kind] = _weights(model)
    return out


def _uninterrupted() -> dict:
    """The weights of the single-process torch AdamW run of all 6 steps on the global batch."""
    model = _model(0, False)
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    _steps(model, opt, 0, 6, 0, 1)
    return _weights(model)


def test_optimizer_state_follows_names_when_the_parameter_order_differs(tmp_path):
    expected = _uninterrupted()
    results = run_distributed(_worker, 2, str(tmp_path), timeout=120)
    for out in results:
        for pair, weights in out.items():
            assert weights.keys() == expected.keys()
            err = max((weights[k] - expected[k]).abs().max().item() for k in expected)
            assert err < TOL, (pair, err)


def _dcp_worker(rank, world_size, root):
    """A fusedist DDP job saved with torch's DCP after 3 steps (nested and flattened optimizer
    state), continued on ZeRO stage 2 through ``fusedist.checkpoint.load``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    import fusedist

    from torch.distributed.checkpoint import state_dict as helpers

    out = {}
    for flatten, legacy in ((False, False), (True, False), (False, True), (True, True)):
        directory = f"{root}/dcp-{int(flatten)}-{int(legacy)}"
        model, opt = _make("ddp", 0, False)
        _steps(model, opt, 0, 3, rank, world_size)
        names = helpers._get_fqns
        if legacy:  # names as written before fusedist DDP's were torch DDP's: with ``module.``
            helpers._get_fqns = names.__wrapped__
        try:
            msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=flatten))
        finally:
            helpers._get_fqns = names
        assert legacy == all(k.startswith("module.") for k in msd), (legacy, sorted(msd))
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory)
        model, opt = _make("zero", 7, False)
        fusedist.checkpoint.load(directory, model, opt)
        _steps(model, opt, 3, 6, rank, world_size)
        out[flatten, legacy] = _weights(model)
    return out


def test_torch_dcp_checkpoint_of_a_fusedist_ddp_model_continues_on_zero(tmp_path):
    expected = _uninterrupted()
    for out in run_distributed(_dcp_worker, 2, str(tmp_path), timeout=120):
        for case, weights in out.items():
            err = max((weights[k] - expected[k]).abs().max().item() for k in expected)
            assert err < TOL, (case, err)
