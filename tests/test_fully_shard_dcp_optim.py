"""Optimizer state of fully_shard models through torch's state-dict helpers
(``get_optimizer_state_dict``/``set_optimizer_state_dict``) and its Distributed Checkpoint
(Note [optimizer state of pieces] in fusedist/fsdp/optim_state.py), against torch's FSDP2 on the
same model, on a CPU mesh with gloo.

The training of tests/test_fully_shard_dcp.py (one global batch of 12 split over the ranks):
2 steps at 2 ranks, model and optimizer saved torchtitan-style (``{"model":
get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}`` with ``dcp.save``), loaded
at 3 (or 2) ranks into a fresh model and optimizer, 2 more steps, compared with the
uninterrupted run at 2 ranks. Right after the load the model and the whole optimizer state are
equal bit for bit (a load copies values); after the steps exact at 2 ranks, within 1e-6 at 3
(the averaged gradient is a sum of 3 partial sums instead of 2, in fp32: last-bit differences,
~1e-7 after 2 steps at these magnitudes; Adam divides by sqrt(exp_avg_sq), so a wrong state --
one rank's piece loaded everywhere, or a fresh state -- is off by ~1e-3 or more).
"""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed as dist

import fusedist
from fusedist.testing import run_distributed
from test_fully_shard_dcp import TOL3, _diff, _full, _make, _train

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "fused_adamw": lambda params: fusedist.optim.FusedAdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}


def _full_optim(model, opt) -> dict:
    """The whole optimizer state through torch's helper (full_state_dict=True), tensors only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {f"{fqn}.{k}": v.detach().clone() for fqn, st in osd["state"].items() for k, v in st.items()
            if isinstance(v, torch.Tensor)}


def _plain_state(opt) -> bool:
    return all(type(v) is torch.Tensor for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


def _helpers_save(rank, ws, where, opt_name, kind, scalar=True):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = _make(kind, ws, 0, scalar=scalar)
    opt = OPTIMIZERS[opt_name](model.parameters())
    _train(model, opt, rank, ws, 0, 2)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=where)
    out = {"weights 2": _full(model), "optim 2": _full_optim(model, opt)}
    _train(model, opt, rank, ws, 2, 4)
    out["weights 4"] = _full(model)
    return out


def _helpers_load(rank, ws, where, opt_name, kind, scalar=True):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    model = _make(kind, ws, 1, scalar=scalar)
    opt = OPTIMIZERS[opt_name](model.parameters())  # never stepped: the helper initializes its state
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=where)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    out = {"plain": _plain_state(opt) if kind == "ours" else True,
           "weights": _full(model), "optim": _full_optim(model, opt)}
    _train(model, opt, rank, ws, 2, 4)
    out["continued"] = _full(model)
    return out


# The checkpoints every test below loads: (kind, optimizer, 0-dim parameter) -- fusedist's model
# with each optimizer, and each side of the interchange with torch's FSDP2 (no 0-dim parameters).
SAVES = [("ours", opt_name, True) for opt_name in OPTIMIZERS] + [("ours", "adamw", False), ("torch", "adamw", False)]
# The loads at each world size: {world size: [(saved checkpoint, kind loading it)]}.
LOADS = {2: [(save, "ours") for save in SAVES[:3]],
         3: [(save, "ours") for save in SAVES[:3]] + [(SAVES[3], "torch"), (SAVES[4], "ours")]}
FULL_OPT_NAMES = ("adamw", "fused_adamw", "sgd_momentum")


def _where(root: str, save) -> str:
    return os.path.join(root, "-".join(map(str, save)))


def _save_all(rank, ws, root):
    """Every checkpoint of SAVES at 2 ranks, the full-state-dict checks at 2, and then the loads
    at 2 (into fresh models and optimizers: nothing of the saving ones is reused), in one launch."""
    saved = {save: _helpers_save(rank, ws, _where(root, save), save[1], save[0], save[2]) for save in SAVES}
    dist.barrier()  # every rank's pieces written before any rank loads
    return saved, _full_optim_helpers_each(rank, ws, FULL_OPT_NAMES), _load_all(rank, ws, root)[0]


def _load_all(rank, ws, root):
    """Every load of LOADS[ws] (and the full-state-dict checks at 3 ranks), in one launch."""
    loaded = {(save, kind): _helpers_load(rank, ws, _where(root, save), save[1], kind, save[2])
              for save, kind in LOADS[ws]}
    return loaded, _full_optim_helpers_each(rank, ws, FULL_OPT_NAMES) if ws == 3 else None


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """One launch saves every checkpoint at 2 ranks and loads them at 2, one loads at 3 (each
    launch costs a process group and the imports in every rank): {"saved": rank 0's results by
    save, world size: per-rank results by (save, kind), ("full", world size): per-rank
    full-state-dict results}."""
    root = str(tmp_path_factory.mktemp("ck"))
    saved = run_distributed(_save_all, 2, root, timeout=300)
    out = {"saved": saved[0][0], ("full", 2): [by_opt for _, by_opt, _ in saved],
           2: [by_load for _, _, by_load in saved]}
    loaded = run_distributed(_load_all, 3, root, timeout=300)
    out[3] = [by_load for by_load, _ in loaded]
    out[("full", 3)] = [by_opt for _, by_opt in loaded]
    return out


@pytest.mark.parametrize("load_ws", [3, 2])
@pytest.mark.parametrize("opt_name", ["adamw", "fused_adamw", "sgd_momentum"])
def test_optimizer_dcp_save_at_2_load_resharded_matches_uninterrupted(launches, opt_name, load_ws):
    save = ("ours", opt_name, True)
    saved = launches["saved"][save]
    tol = 0.0 if load_ws == 2 else TOL3
    for by_load in launches[load_ws]:
        res = by_load[(save, "ours")]
        assert res["plain"]  # the optimizer holds plain pieces after the load
        assert _diff(res["weights"], saved["weights 2"]) == 0.0
        assert _diff(res["optim"], saved["optim 2"]) == 0.0
        assert _diff(res["continued"], saved["weights 4"]) <= tol


@pytest.mark.parametrize("src,dst", [("ours", "torch"), ("torch", "ours")])
def test_optimizer_dcp_interchange_with_torch_fsdp2(launches, src, dst):
    """A checkpoint of fusedist's model and AdamW loads into torch's FSDP2 at 3 ranks, and back."""
    save = (src, "adamw", False)  # (FSDP2: no 0-dim parameters)
    saved = launches["saved"][save]
    for by_load in launches[3]:
        res = by_load[(save, dst)]
        assert res["plain"]
        assert _diff(res["weights"], saved["weights 2"]) == 0.0
        assert _diff(res["optim"], saved["optim 2"]) == 0.0
        assert _diff(res["continued"], saved["weights 4"]) <= TOL3


# ------------------------------------------------------------------ full_state_dict=True
def _full_optim_helpers(rank, ws, opt_name):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    out = {}
    ref, ours = _make("torch", ws, 0), _make("ours", ws, 0)  # (FSDP2: no 0-dim parameters)
    ref_opt = OPTIMIZERS["adamw" if opt_name == "fused_adamw" else opt_name](ref.parameters())
    opt = OPTIMIZERS[opt_name](ours.parameters())
    _train(ref, ref_opt, rank, ws, 0, 2)
    _train(ours, opt, rank, ws, 0, 2)
    whole = _full_optim(ours, opt)
    # the whole state, shaped like the parameters, equal to torch FSDP2's
    out["vs torch"] = _diff(whole, _full_optim(ref, ref_opt))
    weights = _full(ours)
    out["shapes"] = all(v.shape == weights[k.rsplit(".", 1)[0]].shape for k, v in whole.items()
                        if not k.endswith(".step"))
    offloaded = get_optimizer_state_dict(ours, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    torch_offloaded = get_optimizer_state_dict(ref, ref_opt,
                                               options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out["offload keys"] = (sorted(offloaded.get("state", {})), sorted(torch_offloaded.get("state", {})))
    # ... and back: every rank passes the whole state, or rank 0 broadcasts it
    full = get_optimizer_state_dict(ours, opt, options=StateDictOptions(full_state_dict=True))
    for opts, src in ((StateDictOptions(full_state_dict=True), full),
                      (StateDictOptions(full_state_dict=True, broadcast_from_rank0=True), offloaded)):
        fresh = _make("ours", ws, 0)
        fresh_opt = OPTIMIZERS[opt_name](fresh.parameters())
        set_optimizer_state_dict(fresh, fresh_opt, src, options=opts)
        key = "set broadcast" if opts.broadcast_from_rank0 else "set full"
        out[key] = _diff(_full_optim(fresh, fresh_opt), whole)
        out[key + " plain"] = _plain_state(fresh_opt)
    # optimizer.state_dict() is still the pieces to torch.save: a same-layout round trip
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    plain = torch.load(buf, weights_only=True)
    out["pickled plain pieces"] = all(type(v) is torch.Tensor for st in plain["state"].values()
                                      for v in st.values() if isinstance(v, torch.Tensor))
    fresh = _make("ours", ws, 0)
    fresh_opt = OPTIMIZERS[opt_name](fresh.parameters())
    fresh_opt.load_state_dict(plain)
    # state, but never stepped in this process: torch's helpers would not step it, so it has no
    # state-dict hooks until it is tracked (Note [optimizer state of pieces])
    out["untracked"] = type(fresh_opt.state_dict()["state"][0]["exp_avg" if opt_name != "sgd_momentum"
                                                            else "momentum_buffer"]) is torch.Tensor
    fusedist.fsdp.track_optimizer(fresh_opt)
    out["torch.save round trip"] = _diff(_full_optim(fresh, fresh_opt), whole)
    fresh_opt.load_state_dict(opt.state_dict())  # ShardedPiece entries load as plain pieces
    out["state_dict round trip"] = _diff(_full_optim(fresh, fresh_opt), whole)
    out["state_dict round trip plain"] = _plain_state(fresh_opt)
    return out


def _full_optim_helpers_each(rank, ws, opt_names):
    """:func:`_full_optim_helpers` for each optimizer, in one launch of the ranks."""
    return {opt_name: _full_optim_helpers(rank, ws, opt_name) for opt_name in opt_names}


@pytest.mark.parametrize("ws", [2, 3])
def test_optimizer_full_state_dict(launches, ws):
    opt_names = FULL_OPT_NAMES
    for rank, by_opt in enumerate(launches[("full", ws)]):
        assert sorted(by_opt) == sorted(opt_names), by_opt
        for opt_name, res in by_opt.items():
            ours_keys, torch_keys = res.pop("offload keys")
            # rank 0 only with cpu_offload
            assert ours_keys == torch_keys and (ours_keys != []) == (rank == 0), (opt_name, ours_keys, torch_keys)
            # torch's model took its steps with its own 3-way gradient average, and FusedAdamW's
            # kernel rounds differently from torch's AdamW: last-bit differences
            assert res.pop("vs torch") <= (0.0 if ws == 2 and opt_name != "fused_adamw" else TOL3), opt_name
            for name, value in res.items():
                assert value in (True, 0.0), (opt_name, rank, name, value)
