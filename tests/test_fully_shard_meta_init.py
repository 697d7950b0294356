"""fully_shard on a model built on the meta device, materialized with ``to_empty`` and
initialized with ``fusedist.fsdp.init_parameters`` (Note [units built on the meta device] in
fusedist/fsdp/unit.py, Note [initializing like the unsharded model] in param_init.py), at 2
and 3 gloo ranks.

References:
* initialization: an unsharded model given the same RNG state and ``model.apply(init_fn)``;
  the sharded model's whole parameters and all its buffers (persistent or not) must equal it
  bit for bit -- every rank draws the whole values and keeps its rows, so nothing is rounded;
* training: the unsharded model trained on the whole global batch (12 samples, each rank its
  slice, gradients averaged), 3 AdamW steps at lr 1e-2: every tensor within 1e-6 on average
  and every element within 1e-3. fp32 sums split over ranks differ in the last bits, and
  AdamW divides each gradient by its own magnitude, so an element whose samples nearly cancel
  carries that rounding into its update at the scale of lr (up to 1e-4 seen, with the
  matmul kernels of another CPU); a wrong row, a lost rank's gradient or a garbage value
  left by ``to_empty`` moves weights by about lr per step, on average as well;
* the default init_fn's blind spots (modules without ``reset_parameters()``): the tensors an
  unsharded model filled with NaN after ``to_empty`` still holds NaN in after
  ``apply(reset_parameters)`` are exactly those ``init_parameters``' warning names;
* MixedPrecisionPolicy, CPUOffloadPolicy, reshard_after_forward=False: the same fully_shard
  configuration built with data (no meta) from the same initial weights, one step: bit for bit
  (the same operations on the same values).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusedist
from fusedist.testing import run_distributed

GLOBAL_BATCH = 12
TRAINED_MAX, TRAINED_MEAN = 1e-3, 1e-6  # (the module's docstring says why)
SEED = 1234


class Rotary(nn.Module):
    """No parameters; a non-persistent buffer computed at initialization (a rotary table)."""

    def __init__(self, d: int):
        super().__init__()
        self.register_buffer("inv_freq", torch.empty(d), persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        n = self.inv_freq.numel()
        steps = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
        self.inv_freq.copy_(1.0 / 10000 ** (steps / n))


class Block(nn.Module):
    def __init__(self, d: int, bn: bool = False):
        super().__init__()
        self.norm = nn.BatchNorm1d(d) if bn else nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.rot = Rotary(d)

    def forward(self, x):
        h = self.norm(x) * torch.cos(self.rot.inv_freq).to(x.dtype)
        return x + self.fc2(torch.tanh(self.fc1(h)))

    def init_weights(self):
        """torchtitan-style: the block initializes its children itself (one weight through
        ``.data``, as some inits do)."""
        nn.init.trunc_normal_(self.fc1.weight, std=0.05)
        self.fc2.weight.data = torch.randn_like(self.fc2.weight) * 0.05
        for fc in (self.fc1, self.fc2):
            nn.init.normal_(fc.bias, std=0.01)


class Net(nn.Module):
    """Blocks sharded on their own; the root's unit holds the layers before and after them and a
    0-dim parameter (an empty piece on some ranks at 3); a random persistent buffer."""

    def __init__(self, d: int = 16, n: int = 2, bn: bool = False):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d, bn) for _ in range(n))
        self.head = nn.Linear(d, 4)
        self.gain = nn.Parameter(torch.empty(()))
        self.register_buffer("shift", torch.empty(4))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.uniform_(self.gain, 0.5, 1.5)
        nn.init.normal_(self.shift, std=0.1)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x) * self.gain + self.shift


class TiedNet(nn.Module):
    """The output layer's weight is the embedding's, held by another unit (the embedding's)."""

    def __init__(self, vocab: int = 11, d: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.out = nn.Linear(d, vocab)
        self.out.weight = self.embed.weight

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _reset(m):
    if hasattr(m, "reset_parameters"):
        m.reset_parameters()


def _titan_init(m):
    """An init_fn that initializes a block's children from the block (which has no parameters
    of its own), the root's layers from the root, and the rest by type."""
    if isinstance(m, Block):
        m.init_weights()
    elif isinstance(m, Net):  # (one parameter replaced by a new one)
        nn.init.trunc_normal_(m.inp.weight, std=0.1)
        m.head.weight = nn.Parameter(torch.randn(m.head.weight.shape) * 0.1)
        for fc in (m.inp, m.head):
            nn.init.zeros_(fc.bias)
        m.reset_parameters()
    elif isinstance(m, (nn.LayerNorm, Rotary)):
        m.reset_parameters()


def _mesh(ws):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (ws,))


def _shard(model, ws, units=None, **kw):
    mesh = _mesh(ws)
    for m in (units(model) if units else model.blocks):
        fusedist.fully_shard(m, mesh=mesh, **kw)
    return fusedist.fully_shard(model, mesh=mesh, **kw)


def _on_meta(make, ws, init_fn=None, **kw):
    """Built on meta, sharded, materialized and initialized from seed SEED."""
    with torch.device("meta"):
        model = make()
    _shard(model, ws, **kw)
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    fusedist.fsdp.init_parameters(model, init_fn)
    return model


def _reference(make, init_fn=None):
    """The unsharded model, ``apply(init_fn)`` from seed SEED."""
    torch.manual_seed(99)
    model = make()
    torch.manual_seed(SEED)
    model.apply(init_fn or _reset)
    return model


def _init_diff(ours, ref) -> float:
    """Largest difference of the whole parameters and every buffer (persistent or not)."""
    full = fusedist.fsdp.full_state_dict(ours)
    want = dict(ref.state_dict())
    want.update(ref.named_buffers())
    got = dict(full)
    got.update(ours.named_buffers())
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    assert all(got[k].shape == want[k].shape for k in want)
    return max((got[k].double() - want[k].double()).abs().max().item() for k in want)


def _batch(step, rank, ws):
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
    per = GLOBAL_BATCH // ws
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _train(model, rank, ws, steps, batch=_batch, loss=F.mse_loss):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = batch(step, rank, ws)
        loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model


def _weights_diff(ours, ref) -> float:
    full = fusedist.fsdp.full_state_dict(ours)
    return max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())


def _trained_diff(ours, ref) -> tuple[float, float]:
    """(largest element difference, largest per-tensor mean difference) of two trained models."""
    full = fusedist.fsdp.full_state_dict(ours)
    diffs = [(full[k] - v).abs() for k, v in ref.state_dict().items()]
    return max(d.max().item() for d in diffs), max(d.mean().item() for d in diffs)


def _trained_alike(diff: tuple[float, float]) -> bool:
    largest, mean = diff
    return largest <= TRAINED_MAX and mean <= TRAINED_MEAN


def _tied_batch(step, rank, ws):
    g = torch.Generator().manual_seed(2000 + step)
    ids, target = (torch.randint(0, 11, (GLOBAL_BATCH, 5), generator=g) for _ in range(2))
    per = GLOBAL_BATCH // ws
    return ids[rank * per:(rank + 1) * per], target[rank * per:(rank + 1) * per]


def _tied_loss(out, target):
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


# ------------------------------------------------------------------ init equals unsharded, trains as it
def _init_and_train(rank, ws):
    out = {}
    ours, ref = _on_meta(Net, ws), _reference(Net)
    out["init"] = _init_diff(ours, ref)
    out["devices"] = {str(t.device) for t in [*ours.parameters(), *ours.buffers()]}
    out["empty pieces"] = sum(p.numel() == 0 for p in ours.parameters())
    _train(ours, rank, ws, 3)
    _train(ref, 0, 1, 3)
    out["trained"] = _trained_diff(ours, ref)
    # a checkpoint loaded after to_empty instead of an init (a conversion while on meta first)
    with torch.device("meta"):
        loaded = Net()
    _shard(loaded, ws)
    loaded.float().to_empty(device="cpu")
    fusedist.fsdp.load_full_state_dict(loaded, ref.state_dict())
    out["loaded"] = _weights_diff(loaded, ref)
    # an init_fn initializing a block's children from the block; BatchNorm statistics
    out["init titan"] = _init_diff(_on_meta(Net, ws, _titan_init), _reference(Net, _titan_init))
    out["init bn"] = _init_diff(_on_meta(lambda: Net(bn=True), ws), _reference(lambda: Net(bn=True)))
    # a weight tied across units: out.weight (root's unit borrows it) is embed.weight (its own unit)
    with torch.device("meta"):
        tied = TiedNet()
    _shard(tied, ws, units=lambda m: [m.embed, *m.blocks])
    kept = []
    for _ in range(2):  # from meta (new pieces), then again on a materialized model (new data)
        tied.to_empty(device="cpu")
        kept.append(tied.out.weight is tied.embed.weight)
    out["tied kept"] = all(kept)
    torch.manual_seed(SEED)
    fusedist.fsdp.init_parameters(tied)
    ref = _reference(TiedNet)
    out["tied init"] = _init_diff(tied, ref)
    _train(tied, rank, ws, 3, _tied_batch, _tied_loss)
    _train(ref, 0, 1, 3, _tied_batch, _tied_loss)
    out["tied trained"] = _trained_diff(tied, ref)
    return out


@pytest.mark.parametrize("ws", [2, 3])
def test_meta_build_init_equals_unsharded_and_trains(ws):
    results = run_distributed(_init_and_train, ws)
    for rank, res in enumerate(results):
        assert res["devices"] == {"cpu"}, res["devices"]
        for key in ("init", "init titan", "init bn", "tied init"):
            assert res[key] == 0.0, (rank, key, res[key])  # bit for bit
        assert res["loaded"] == 0.0, (rank, res["loaded"])
        assert res["tied kept"], "to_empty untied the weight shared across units"
        assert _trained_alike(res["trained"]), (rank, res["trained"])
        assert _trained_alike(res["tied trained"]), (rank, res["tied trained"])
    if ws == 3:  # the 0-dim gain and the small biases: some ranks hold nothing of them
        assert any(res["empty pieces"] for res in results)


# ------------------------------------------------------------------ policies: the meta path is the data path
def _one_step_both_ways(rank, ws, **kw):
    """The same fully_shard configuration built on meta (then to_empty, init_parameters) and
    built with data from the reference init: whole weights after the init and after one step."""
    ours = _on_meta(Net, ws, **kw)
    ref = _reference(Net)
    data = _shard(copy.deepcopy(ref), ws, **kw)
    out = {"init": _init_diff(ours, ref), "init data path": _init_diff(data, ref)}
    _train(ours, rank, ws, 1)
    _train(data, rank, ws, 1)
    a, b = fusedist.fsdp.full_state_dict(ours), fusedist.fsdp.full_state_dict(data)
    out["step"] = max((a[k] - b[k]).abs().max().item() for k in a)
    out["moved"] = _weights_diff(ours, ref)
    out["shard dtypes"] = {str(p.dtype) for p in ours.parameters()}
    return out


def _variants(rank, ws):
    policies = {
        "bf16": dict(mp_policy=fusedist.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
        "offload": dict(offload_policy=fusedist.CPUOffloadPolicy()),
        "keep gathered": dict(reshard_after_forward=False),
    }
    return {name: _one_step_both_ways(rank, ws, **kw) for name, kw in policies.items()}


def test_policies_meta_path_equals_data_path():
    for res in run_distributed(_variants, 2):
        for name, r in res.items():
            assert r["init"] == 0.0 and r["init data path"] == 0.0, (name, r)
            assert r["step"] == 0.0, (name, r)  # the same operations on the same values
            assert r["moved"] > 0.0, (name, r)  # and a step was taken
            assert r["shard dtypes"] == {"torch.float32"}, (name, r)  # fp32 shards under bf16 compute


# ------------------------------------------------------------------ misuse and mixed devices
def _misuse(rank, ws):
    out = {}
    with torch.device("meta"):
        model = Net()
    _shard(model, ws)
    out["meta pieces"] = all(p.is_meta for p in model.parameters())
    x = torch.randn(3, 8)
    visited = []  # (apply before to_empty: torch's, on the meta pieces; nothing to make whole)
    out["apply on meta"] = model.apply(lambda m: visited.append(type(m).__name__)) is model and len(visited)
    for what, call in (("forward", lambda: model(x)), ("unshard", lambda: model.blocks[1].unshard()),
                       ("init", lambda: fusedist.fsdp.init_parameters(model))):
        with pytest.raises(RuntimeError) as err:
            call()
        out[what] = str(err.value)
    # nothing was left half set up: after to_empty and the init, training works
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    fusedist.fsdp.init_parameters(model)
    _train(model, rank, ws, 2)
    ref = _train(_reference(Net), 0, 1, 2)
    out["trained after error"] = _trained_diff(model, ref)
    # model.apply(init_fn) after sharding: the unsharded init (Note [apply on a sharded model]), where
    # on the pieces every rank drew the same numbers for its own rows; the modules visited in apply's order
    torch.manual_seed(SEED)
    applied = model.apply(_reset)
    out["apply after sharding"] = (applied is model, _init_diff(applied, _reference(Net)))
    order, ref_order = [], []
    model.apply(lambda m: order.append(type(m).__name__.removeprefix("FullyShard")))
    _reference(Net).apply(lambda m: ref_order.append(type(m).__name__))
    out["apply order"] = (order == ref_order, len(order))
    # apply inside a pass (a root forward pre-hook: its units in use) or inside another apply: torch's, on
    # the pieces (made whole there, a submodule's call was refused / a piece-shaped result refused); trains as without
    built = []
    for _ in range(2):
        torch.manual_seed(SEED)
        built.append(_shard(Net(), ws))
    hooked, plain, visits = *built, []
    hooked.register_forward_pre_hook(lambda mod, args: mod.apply(lambda m: visits.append("hook")) and None)
    hooked.apply(lambda m: m.apply(lambda m2: visits.append("nested")) if m is hooked.blocks[0] else None)
    _train(hooked, rank, ws, 2)
    _train(plain, rank, ws, 2)
    a, b = fusedist.fsdp.full_state_dict(hooked), fusedist.fsdp.full_state_dict(plain)
    out["apply in a pass"] = ((visits.count("nested"), visits.count("hook")),
                              (len(list(hooked.blocks[0].modules())), 2 * len(list(hooked.modules()))),
                              max((a[k] - b[k]).abs().max().item() for k in b))
    # a unit with parameters on meta and off it is refused, naming both
    half = Net()
    with torch.device("meta"):
        half.blocks[0].fc2 = nn.Linear(32, 16)
    with pytest.raises(ValueError) as err:
        fusedist.fully_shard(half.blocks[0], mesh=_mesh(ws))
    out["mixed unit"] = str(err.value)
    # units differing in where they were built are fine: to_empty materializes the meta ones
    mixed = Net()
    with torch.device("meta"):
        mixed.blocks[1] = Block(16)
    _shard(mixed, ws)
    mixed.to_empty(device="cpu")
    torch.manual_seed(SEED)
    fusedist.fsdp.init_parameters(mixed)
    out["mixed units init"] = _init_diff(mixed, _reference(Net))
    out.update(_uninitialized_named(ws))
    return out


class _Partly(nn.Module):
    """Tensors no reset_parameters() reaches: an attention's projections (nn.MultiheadAttention has
    only a private _reset_parameters), the model's own parameter and a buffer (of modules without one)."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 2)
        self.fc = nn.Linear(d, d)
        self.gain = nn.Parameter(torch.ones(d))
        self.register_buffer("pos", torch.arange(float(d)), persistent=False)

    def forward(self, x):
        return self.fc(self.attn(x, x, x)[0]) * self.gain + self.pos


def _uninitialized_named(ws) -> dict:
    """What the default init_fn leaves as to_empty left it, and what init_parameters warns of."""
    import warnings

    # reference: the unsharded model filled with NaN after to_empty, then apply(reset_parameters): the NaN left
    ref = _Partly()
    ref.to_empty(device="cpu")
    for t in (*ref.parameters(), *ref.buffers()):
        t.detach().fill_(float("nan"))
    ref.apply(_reset)
    left = sorted(n for n, t in (*ref.named_parameters(), *ref.named_buffers()) if t.isnan().any())
    out = {"left": left}
    for name, make, units in (("partly", _Partly, lambda m: [m.attn]), ("all reset", Net, None)):
        with torch.device("meta"):
            model = make()
        _shard(model, ws, units=units)
        model.to_empty(device="cpu")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fusedist.fsdp.init_parameters(model)
        out[f"warned {name}"] = [str(w.message) for w in seen if "init_parameters" in str(w.message)]
    return out


def test_misuse_and_mixed_devices():
    """Refusals before ``to_empty`` name the unit; ``model.apply(init_fn)`` after sharding is the unsharded
    init (was: every rank drew the same numbers for its own rows), torch's ``apply`` on the meta pieces before
    ``to_empty``, inside a pass and inside another ``apply``; mixed-device units are refused or materialized."""
    for res in run_distributed(_misuse, 2):
        assert res["meta pieces"]
        for what in ("forward", "unshard", "init"):
            assert "meta device" in res[what] and "to_empty" in res[what], (what, res[what])
        assert "the root module (Net)" in res["forward"], res["forward"]  # the unit is named as elsewhere
        assert "fully_shard(Block)" in res["unshard"] and "fc1.weight" in res["unshard"], res["unshard"]
        assert _trained_alike(res["trained after error"]), res["trained after error"]
        assert res["apply after sharding"] == (True, 0.0), res["apply after sharding"]  # (the unsharded init)
        assert res["apply order"][0] and res["apply order"][1] == res["apply on meta"] > 1, res
        counts, expected, trained = res["apply in a pass"]
        assert counts == expected and trained == 0.0, res["apply in a pass"]  # (the same ops on the same values)
        assert "fc2.weight" in res["mixed unit"] and "fc1.weight (cpu)" in res["mixed unit"], res["mixed unit"]
        assert res["mixed units init"] == 0.0
        # tensors no reset_parameters() reaches are named, as Lightning's materialization warns
        assert res["left"] == ["attn.in_proj_bias", "attn.in_proj_weight", "gain", "pos"], res["left"]
        assert len(res["warned partly"]) == 1, res["warned partly"]
        named = res["warned partly"][0].split(" belong to ")[0].split(": ", 1)[1].split(", ")
        assert sorted(named) == res["left"], res["warned partly"]
        assert res["warned all reset"] == [], res["warned all reset"]
