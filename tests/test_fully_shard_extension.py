"""fully_shard with parameters that choose what is all-gathered: FSDP2's all-gather extension
(Note [all-gather extension] in fusedist/fsdp/extension.py), against torch's FSDP2.

Two subclasses: ``RowwiseInt8Weight`` below, a high-precision weight gathered as int8 rows
plus an fp32 scale per row (two inputs of two dtypes, FSDP2's five-argument
``fsdp_pre_all_gather``, a plain unsharded tensor refilled through ``out=``), and torchao's
float8 training weights (``enable_fsdp_float8_all_gather``: float8 bytes and a scale from
the amax all-reduced over the shard mesh), the extension's main user.

Tolerances: both sides gather the same bytes, dequantize them alike and reduce the same
gradients in the same dtype, so losses and weights come out bit-identical to FSDP2's on gloo
(checked with ``rtol=0``), except where a gradient clip runs: the two sum the norm's squares
over the pieces in different orders (a last-bit difference, ``rtol=1e-6``), and the clipped
gradients and weights then differ by about as much (``CLOSE``). A unit that gathered the
high-precision values instead would be off by the int8 (float8) rounding, about 0.4% (6%) of
a weight; each test also checks the gathered weight itself: the int8 dequantization of the
whole weight, exactly.

FSDP2 references: on gloo, FSDP2 can gather float8 bytes only inside a unit that also gathers
another dtype (gloo has no float8; a mixed unit goes through a byte buffer), and for float8
only rows that divide evenly (its contract hands the extension the unpadded shard). So the
float8 reference is FSDP2 with float8 gathers where those hold (every Linear with a bias, even
rows), and elsewhere FSDP2 with float8 compute but bf16/fp32 gathers -- the same numbers in fp32,
where casting the gathered weight equals gathering the cast shards (one amax, one scale).

Sharing the 2-rank spawn: float8 and NF4 pieces answer FSDP2's DTensor names, as FSDP2's parameters
do on the same mesh (Note [extension pieces read as DTensors] in fusedist/fsdp/extension_names.py).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import fusedist
from fusedist.testing import run_distributed
from fusedist.testing.fsdp_compare import full_state as full_of, square_loss_steps

EXACT = dict(rtol=0, atol=0)
CLOSE = dict(rtol=1e-5, atol=1e-6)  # after a clip: Note on tolerances above


class RowwiseInt8Weight(torch.Tensor):
    """A weight kept in high precision and all-gathered as int8 rows with an fp32 scale per row.
    Outside FSDP it computes in high precision (every op unwraps it)."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(), dtype=data.dtype,
                                                   device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data):
        self._data = data

    _PRESERVE = {torch.ops.aten.detach.default, torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default,
                 torch.ops.aten.slice.Tensor, torch.ops.aten.copy_.default, torch.ops.aten.view.default,
                 torch.ops.aten.as_strided.default, torch.ops.aten._to_copy.default, torch.ops.aten.split.Tensor,
                 torch.ops.aten.clone.default}

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._data, (args, kwargs or {}))
        out = func(*args, **kwargs)
        return pytree.tree_map_only(torch.Tensor, cls, out) if func in cls._PRESERVE else out

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return RowwiseInt8Weight(inner["_data"])

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        rows = -(-outer_size[0] // mesh.size())
        data = self._data
        if data.shape[0] < rows:  # FSDP2 hands the unpadded shard: pad it to the padded shard's rows
            data = torch.cat([data, data.new_zeros(rows - data.shape[0], *data.shape[1:])])
        q, scale = quantize_rows(data)
        # (the scale repeated along each row: FSDP2 wants every input of the padded shard's size)
        return (q, scale.expand(rows, data[0].numel()).reshape(data.shape).contiguous()), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        q, scale = outputs
        w = dequantize_rows(q, scale.reshape(q.shape[0], -1)[:, :1], param_dtype)
        if out is not None:
            out.data.view(-1).copy_(w.reshape(-1)[:out.numel()])
            return None
        return w, (w,)


# FSDP2's checkpoints pickle its local tensors, here this subclass (torchao registers its own)
torch.serialization.add_safe_globals([RowwiseInt8Weight])


def quantize_rows(w: torch.Tensor):
    flat = w.reshape(w.shape[0], -1).float()
    scale = flat.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(flat / scale).to(torch.int8).view(w.shape).contiguous(), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    return (q.reshape(q.shape[0], -1).float() * scale).to(dtype).view(q.shape)


def rowwise_model(device="cpu"):
    """Three Linears with int8-gathered weights; 13 and 26 rows do not divide 2 or 3 evenly."""
    torch.manual_seed(0)
    with torch.device(device):
        m = nn.Sequential(nn.Linear(16, 26), nn.Tanh(), nn.Linear(26, 13), nn.Tanh(), nn.Linear(13, 4))
    for layer in (m[0], m[2], m[4]):
        layer.weight = nn.Parameter(RowwiseInt8Weight(layer.weight.detach()))
    return m


def shard(m, fully_shard, **kw):
    for layer in (m[0], m[2]):
        fully_shard(layer, **kw)
    kw.pop("reshard_after_forward", None)
    fully_shard(m, **kw)
    return m


def batch(step: int, rank: int, world: int, width: int = 16, rows: int = 4):
    torch.manual_seed(100 + step)
    return torch.randn(rows * world, width)[rank * rows:(rank + 1) * rows]


def _train_rowwise(ours: bool, rank, world, mp, reshard_after_forward, accumulate, mesh=None):
    from torch.distributed.fsdp import fully_shard

    m = shard(rowwise_model(), fusedist.fully_shard if ours else fully_shard, mp_policy=mp,
              reshard_after_forward=reshard_after_forward, mesh=mesh)

    def before(step):
        if accumulate and step == 1:  # an unsynchronized micro-batch first
            m.set_requires_gradient_sync(False)
            m(batch(10, rank, world)).float().square().mean().backward()
            m.set_requires_gradient_sync(True)

    return (m, *_clipped_adamw(m, lambda step: batch(step, rank, world), before))


def _clipped_adamw(m, batch_of, before=lambda step: None):
    """Three AdamW steps on ``batch_of(step)``, each clipped by torch's clip at 0.05 (a DTensor
    norm under FSDP2): the losses and the norms."""
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses, norms = [], []
    for step in range(3):
        before(step)
        loss = m(batch_of(step)).float().square().mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
        norms.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def _rowwise_worker(rank, world, bf16, reshard_after_forward, accumulate):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    ours, losses, norms = _train_rowwise(True, rank, world, mp, reshard_after_forward, accumulate)
    ref, ref_losses, ref_norms = _train_rowwise(False, rank, world, mp, reshard_after_forward, accumulate)
    torch.testing.assert_close(losses, ref_losses, **CLOSE)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-6, atol=0)
    a, b = full_of(ours, True), full_of(ref, False)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **CLOSE, msg=f"{k} differs from FSDP2's")
    # at rest the pieces keep the subclass, as FSDP2's local tensors do
    assert isinstance(ours[0].weight, RowwiseInt8Weight)
    assert ours[0].weight.shape == torch.chunk(torch.empty(26, 16), world)[rank].shape  # (FSDP2's chunk)
    # gathered: the int8 dequantization of the whole weight, exactly, not the weight itself
    ours[2].unshard()
    gathered = ours[2].weight.detach()
    whole = a["2.weight"]
    expected = dequantize_rows(*quantize_rows(whole), torch.bfloat16 if bf16 else torch.float32)
    torch.testing.assert_close(gathered, expected, **EXACT)
    assert (gathered.float() - whole).abs().max() > 0  # (the check could tell the two apart)
    ours[2].reshard()
    return losses


@pytest.mark.parametrize("world, bf16, reshard_after_forward, accumulate", [
    (2, False, True, True),
    (3, True, False, False),
])
def test_rowwise_extension_matches_fsdp2(request, world, bf16, reshard_after_forward, accumulate):
    if world == 2:  # run in the shared 2-rank spawn (``two_ranks``), with these arguments
        assert ROWWISE_2 == (bf16, reshard_after_forward, accumulate)
        _passed(request.getfixturevalue("two_ranks"), "rowwise")
        return
    run_distributed(_rowwise_worker, world, bf16, reshard_after_forward, accumulate)


ROWWISE_2 = (False, True, True)  # the 2-rank case above, as the shared spawn runs it


def float8_model(bias: bool, out: int):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48, bias=bias), nn.ReLU(), nn.Linear(48, out, bias=True), nn.ReLU(),
                         nn.Linear(out, 16, bias=bias))


def _train_float8(ours: bool, rank, world, bias, out, mp, reshard_after_forward, float8_gather, precompute=False,
                  fused=False, checkpointed=False):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    m = float8_model(bias, out)
    convert_to_float8_training(m, config=Float8LinearConfig(enable_fsdp_float8_all_gather=float8_gather))
    if checkpointed:  # recomputed in backward: the weight gathered again there, refilled in place
        m[2] = checkpoint_wrapper(m[2])
    fs = fusedist.fully_shard if ours else fully_shard
    for layer in (m[0], m[2], m[4]):
        fs(layer, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fs(m, mp_policy=mp)
    opt = (fusedist.optim.FusedAdamW if fused else torch.optim.AdamW)(m.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        loss = m(batch(step, rank, world, 32, 8)).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if precompute:
            fusedist.fsdp.precompute_float8_dynamic_scale_for_fsdp(m)
        losses.append(loss.item())
    return m, losses


def _float8_worker(rank, world):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    out = {}
    # fp32, 31 rows (uneven at 2 ranks): against FSDP2 computing in float8 from fp32 gathers; the
    # middle layer checkpointed, so its weight is gathered again for the recomputation in backward
    ours, losses = _train_float8(True, rank, world, False, 31, MixedPrecisionPolicy(), True, True, checkpointed=True)
    ref, ref_losses = _train_float8(False, rank, world, False, 31, MixedPrecisionPolicy(), True, False,
                                    checkpointed=True)
    torch.testing.assert_close(losses, ref_losses, **EXACT)
    a, b = full_of(ours, True), full_of(ref, False)
    for k in a:
        torch.testing.assert_close(a[k], b[k], **EXACT, msg=f"{k} differs from FSDP2's")
    from fusedist.fsdp.state import state_of

    assert state_of(ours[0]).unit.unsharded_bytes == 48 * 32  # gathered: one byte per element, not four
    layer = ours[2]._checkpoint_wrapped_module
    ours[2].unshard()
    assert isinstance(layer.weight, Float8TrainingTensor), type(layer.weight)
    assert layer.weight.shape == (31, 48) and layer.weight._data.dtype == torch.float8_e4m3fn
    ours[2].reshard()
    out["fp32"] = losses
    # bf16 gathers, weights kept across forward: against FSDP2's own float8 gathers
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ours, losses = _train_float8(True, rank, world, True, 32, mp, False, True)
    ref, ref_losses = _train_float8(False, rank, world, True, 32, mp, False, True)
    torch.testing.assert_close(losses, ref_losses, **EXACT)
    a, b = full_of(ours, True), full_of(ref, False)
    for k in a:
        torch.testing.assert_close(a[k], b[k], **EXACT, msg=f"{k} differs from FSDP2's")
    out["bf16"] = losses
    return out


def test_float8_training_matches_fsdp2(two_ranks):
    _passed(two_ranks, "float8")


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _compiled_float8_worker(rank, world):
    """Blocks of float8 Linears, each sharded then compiled (torchtitan's order), as FSDP2's."""
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    out = {}
    for ours in (True, False):
        torch.manual_seed(0)
        m = nn.Sequential(_Block(), _Block(), nn.Linear(32, 16))
        convert_to_float8_training(m, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
        fs = fusedist.fully_shard if ours else fully_shard
        for block in (m[0], m[1]):
            fs(block)
            block.compile(backend="aot_eager")
        fs(m)
        out[ours] = (m, *_clipped_adamw(m, lambda step: batch(step, rank, world, 32, 8)))
    torch.testing.assert_close(out[True][1], out[False][1], **CLOSE)
    a, b = full_of(out[True][0], True), full_of(out[False][0], False)
    for k in a:
        torch.testing.assert_close(a[k], b[k], **CLOSE, msg=f"{k} differs from FSDP2's")


def test_float8_compiled_blocks_match_fsdp2(two_ranks):
    _passed(two_ranks, "compiled")


def _train_float8_tp(ours: bool, mp):
    """torchtitan's float8 with tensor parallelism in small: float8 weights made DTensors by a
    column/row-wise plan on mesh["tp"], then sharded on mesh["dp"] (2x2)."""
    m, mesh = _float8_tp(ours, mp)
    dp = mesh["dp"].get_local_rank()
    return (m, *_clipped_adamw(m, lambda step: batch(step, dp, 2, 32, 8)))


def _float8_tp(ours: bool, mp, seed: int = 0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 64), nn.ReLU(),
                      nn.Linear(64, 16))
    convert_to_float8_training(m, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(),
                                       "6": RowwiseParallel()})
    fs = fusedist.fully_shard if ours else fully_shard
    fs(m[0], mesh=mesh["dp"], mp_policy=mp)
    fs(m[2], mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    fs(m, mesh=mesh["dp"], mp_policy=mp)
    return m, mesh


def _float8_tp_worker(rank, world, root):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    for mp in (MixedPrecisionPolicy(), MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)):
        ours, losses, norms = _train_float8_tp(True, mp)
        ref, ref_losses, ref_norms = _train_float8_tp(False, mp)
        torch.testing.assert_close(losses, ref_losses, **CLOSE)
        torch.testing.assert_close(norms, ref_norms, rtol=1e-6, atol=0)
        a, b = full_of(ours, True), full_of(ref, False)
        for k in a:
            torch.testing.assert_close(a[k], b[k], **CLOSE, msg=f"{k} differs from FSDP2's")
        ours[0].unshard()  # gathered: a DTensor of the plan's placement over the float8 local weight
        assert isinstance(ours[0].weight, DTensor) and isinstance(ours[0].weight._local_tensor, Float8TrainingTensor)
        ours[0].reshard()
        # fusedist.checkpoint: the high-precision values, as region fragments of the global weights
        where = os.path.join(root, str(mp.param_dtype))
        fusedist.checkpoint.save(where, ours)
        fresh, _ = _float8_tp(True, mp, seed=1)
        fusedist.checkpoint.load(where, fresh)
        b = full_of(fresh, True)
        for k in a:
            assert torch.equal(a[k], b[k]), f"{k} differs after fusedist.checkpoint"


def test_float8_with_tensor_parallelism_matches_fsdp2(four_ranks):
    """fp32 and bf16 gathers, a unit kept gathered across forward, the clip over both groups;
    fusedist.checkpoint of such a model loads exactly."""
    _passed(four_ranks, "float8 tp")


def _precompute_worker(rank, world):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # the scales precomputed after each step are those each gather computes: the same training
    # (with the fused AdamW, which steps a piece carrying a precomputed scale through its weight)
    m, losses = _train_float8(True, rank, world, False, 31, MixedPrecisionPolicy(), True, True, precompute=True,
                              fused=True)
    ref, ref_losses = _train_float8(True, rank, world, False, 31, MixedPrecisionPolicy(), True, True, fused=True)
    torch.testing.assert_close(losses, ref_losses, **EXACT)
    a, b = full_of(m, True), full_of(ref, True)
    for k in a:
        torch.testing.assert_close(a[k], b[k], **EXACT, msg=k)
    # and the gathers use them: an even piece (48 rows) and one padded for the gather (31 rows)
    for layer in (m[0], m[2]):
        piece = layer.weight
        assert piece._precomputed_scale is not None
        piece._precomputed_scale = piece._precomputed_scale * 0.5
        layer.unshard()
        torch.testing.assert_close(layer.weight._scale, piece._precomputed_scale, **EXACT)
        layer.reshard()


def test_float8_precomputed_scales_are_the_gathers_own(two_ranks):
    """fusedist's precompute_float8_dynamic_scale_for_fsdp (torchao's finds no DTensor weights in
    fusedist's units): one all-reduce for every weight's scale, the same numbers."""
    _passed(two_ranks, "precompute")


class _NF4Linear(nn.Module):
    """A frozen NF4 weight (torchao's NF4Tensor, QLoRA's base weights) and a trainable bias."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        self.weight = nn.Parameter(to_nf4(torch.randn(d_out, d_in) / d_in ** 0.5), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(d_out))

    def forward(self, x):
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight) + self.bias


def _names_read(m) -> dict:
    """What code written for FSDP2 reads of every parameter: its type, placements, mesh, and the
    class and values of ``full_tensor()`` and ``to_local()`` (NF4: its dequantized values); whether
    ``to_local()`` is the parameter, answers ``full_tensor`` itself, and whether ``requires_grad_()``
    on it unfreezes a frozen parameter."""
    def values(t):
        t = t.get_original_weight() if hasattr(t, "get_original_weight") else t
        return torch.as_tensor(t).detach().clone() if type(t) is torch.Tensor else t._tensor.detach().clone()

    out = {}
    for name, p in m.named_parameters():
        whole, local = p.full_tensor(), p.to_local()
        unfroze = None
        if not p.requires_grad:
            local.requires_grad_()
            unfroze = p.requires_grad
            p.requires_grad_(False)
        out[name] = (p.placements, tuple(p.device_mesh.mesh.tolist()), type(whole).__name__, values(whole),
                     type(local).__name__, tuple(local.shape), values(local),
                     (local is p, hasattr(local, "full_tensor"), unfroze))
    return out


def _extension_names_worker(rank, world):
    """A float8 model's and an NF4 model's parameters read as FSDP2's DTensors, against FSDP2's on
    the same mesh after the same steps; a copy is torchao's class; torchao's classes gain nothing."""
    import copy
    import io

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    mesh = init_device_mesh("cpu", (world,))
    read = {}
    for ours in (True, False):
        m, _ = _train_float8(ours, rank, world, True, 32, MixedPrecisionPolicy(), True, True)
        torch.manual_seed(3)
        q = nn.Sequential(_NF4Linear(128, 256), nn.ReLU(), _NF4Linear(256, 128))
        for layer in (q[0], q[2], q):
            (fusedist.fully_shard if ours else fully_shard)(layer, mesh=mesh)
        square_loss_steps(q, torch.optim.SGD([p for p in q.parameters() if p.requires_grad], lr=0.1),
                          [batch(s, rank, world, 128) for s in range(2)])
        read[ours] = {**_names_read(m), **{f"nf4.{k}": v for k, v in _names_read(q).items()}}
        if ours:
            piece = m[0].weight
            assert type(piece).__name__ == "WeightWithDynamicFloat8CastTensor", type(piece)
            assert isinstance(piece, WeightWithDynamicFloat8CastTensor) and isinstance(piece, nn.Parameter)
            buffer = io.BytesIO()
            torch.save(piece, buffer)
            buffer.seek(0)
            for other in (copy.deepcopy(piece), torch.load(buffer, weights_only=True)):
                assert type(other) is WeightWithDynamicFloat8CastTensor, type(other)
                assert not hasattr(other, "full_tensor") and torch.equal(other._tensor, piece._tensor)
    assert sorted(read[True]) == sorted(read[False]), (sorted(read[True]), sorted(read[False]))
    for name, theirs in read[False].items():
        mine = read[True][name]
        assert mine[:3] == theirs[:3] and mine[4:6] == theirs[4:6] and mine[7] == theirs[7], (name, mine, theirs)
        torch.testing.assert_close(mine[3], theirs[3], **EXACT, msg=name)
        torch.testing.assert_close(mine[6], theirs[6], **EXACT, msg=name)
    return sorted(read[True])


def test_extension_pieces_read_as_fsdp2_dtensors(two_ranks):
    """Every parameter of a float8 model (torchao's float8 training weights) and of an NF4 model answers
    ``placements``, ``device_mesh``, ``full_tensor()`` and ``to_local()`` as FSDP2's DTensor (were:
    AttributeError on the float8 and NF4 weights): a float8 weight's ``full_tensor()`` is the plain
    high-precision weight, its ``to_local()`` the float8 subclass over FSDP2's chunk; an NF4 weight's are
    NF4Tensors, whole and FSDP2's chunk, holding the same values; ``to_local()`` is a new tensor, as FSDP2's:
    ``requires_grad_()`` on it leaves the frozen NF4 weight frozen (was: the piece itself, unfrozen)."""
    _passed(two_ranks, "names")
    names = two_ranks[0]["names result"]
    assert {"0.weight", "4.weight", "nf4.0.weight", "nf4.2.weight"} <= set(names), names


def _state_worker(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    def steps(m, opt, seeds, scaler=None):
        out = []
        for s in seeds:
            loss = m(batch(s, rank, world)).square().mean()
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                fusedist.clip_grad_norm_(m.parameters(), 0.05)
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
            out.append(loss.item())
        return out

    # fusedist's fused AdamW steps the pieces through their inner tensors, as torch's AdamW;
    # fusedist's GradScaler and clip over them
    m = shard(rowwise_model(), fusedist.fully_shard)
    ref = shard(rowwise_model(), fusedist.fully_shard)
    opt = fusedist.optim.FusedAdamW(m.parameters(), lr=1e-2)
    fused = steps(m, opt, range(2), fusedist.amp.GradScaler("cpu", init_scale=2.0 ** 10))
    torch.testing.assert_close(fused, steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), range(2),
                                            fusedist.amp.GradScaler("cpu", init_scale=2.0 ** 10)), **CLOSE)
    # fusedist's checkpoint: a fresh model and optimizer continue as the saved ones
    fusedist.checkpoint.save(os.path.join(path, "fusedist"), m, opt)
    n = shard(rowwise_model(), fusedist.fully_shard)
    n_opt = fusedist.optim.FusedAdamW(n.parameters(), lr=1e-2)
    fusedist.checkpoint.load(os.path.join(path, "fusedist"), n, n_opt)
    torch.testing.assert_close(steps(n, n_opt, (5,)), steps(m, opt, (5,)), **EXACT)
    whole = full_of(m, True)
    for k, v in full_of(n, True).items():
        torch.testing.assert_close(v, whole[k], **EXACT)
    path = os.path.join(path, "dcp")
    # torch's distributed checkpoint: fusedist -> fusedist, fusedist -> FSDP2, and that FSDP2
    # model's checkpoint (its local tensors are the subclass) -> fusedist
    dcp.save({"model": m.state_dict()}, checkpoint_id=path)
    for target, ours in ((shard(rowwise_model(), fusedist.fully_shard), True),
                         (shard(rowwise_model(), fully_shard), False)):
        sd = target.state_dict() if ours else get_model_state_dict(target)
        dcp.load({"model": sd}, checkpoint_id=path)
        target.load_state_dict(sd) if ours else set_model_state_dict(target, sd)
        loaded = full_of(target, ours)
        for k in whole:
            torch.testing.assert_close(loaded[k].float(), whole[k], **EXACT, msg=f"{k} after DCP load")
        if ours:
            assert isinstance(target[0].weight, RowwiseInt8Weight)
    dcp.save({"model": get_model_state_dict(target)}, checkpoint_id=path + "-fsdp2")
    back = shard(rowwise_model(), fusedist.fully_shard)
    sd = back.state_dict()
    dcp.load({"model": sd}, checkpoint_id=path + "-fsdp2")
    back.load_state_dict(sd)
    for k, v in full_of(back, True).items():
        torch.testing.assert_close(v, whole[k], **EXACT, msg=f"{k} loaded from FSDP2's checkpoint")
    # CPUOffloadPolicy: the pieces in host memory, stepped by the fused (host) AdamW, as FSDP2's offload
    from torch.distributed.fsdp import CPUOffloadPolicy

    offloaded = shard(rowwise_model(), fusedist.fully_shard, offload_policy=CPUOffloadPolicy(pin_memory=False))
    ref = shard(rowwise_model(), fully_shard, offload_policy=CPUOffloadPolicy(pin_memory=False))
    torch.testing.assert_close(steps(offloaded, fusedist.optim.FusedAdamW(offloaded.parameters(), lr=1e-2), range(3)),
                               steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), range(3)), **CLOSE)
    assert isinstance(offloaded[0].weight, RowwiseInt8Weight)
    # built on the meta device, materialized, loaded: trains as the model it was loaded from
    meta = shard(rowwise_model("meta"), fusedist.fully_shard)
    meta.to_empty(device="cpu")
    assert isinstance(meta[0].weight, RowwiseInt8Weight) and not meta[0].weight.is_meta
    fusedist.fsdp.load_full_state_dict(meta, whole)
    a = steps(meta, torch.optim.AdamW(meta.parameters(), lr=1e-2), (7, 8))
    b = steps(m, torch.optim.AdamW(m.parameters(), lr=1e-2), (7, 8))
    torch.testing.assert_close(a, b, **EXACT)
    a_whole, b_whole = full_of(meta, True), full_of(m, True)
    for k in a_whole:
        torch.testing.assert_close(a_whole[k], b_whole[k], **EXACT)
    # ... or initialized as the unsharded model is, bit for bit
    meta = shard(rowwise_model("meta"), fusedist.fully_shard)
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    fusedist.fsdp.init_parameters(meta)
    plain = rowwise_model()
    torch.manual_seed(3)
    for module in plain.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    initialized = full_of(meta, True)
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(initialized[k], v.detach(), **EXACT, msg=k)


def test_extension_optimizers_checkpoints_and_meta_init(two_ranks):
    _passed(two_ranks, "state")


class Int8StorageWeight(RowwiseInt8Weight):
    """Quantized storage, as NF4's: no inner tensor holds the weight's values in its dtype (the
    high-precision copy is kept only for the ops of this test double)."""

    def __init__(self, data):
        self._data = data
        self._q, self._scale = quantize_rows(data)

    def __tensor_flatten__(self):
        return ["_q", "_scale"], None


#: implements half of the extension
PreOnlyWeight = type("PreOnlyWeight", (torch.Tensor,), {
    k: v for k, v in vars(RowwiseInt8Weight).items() if k not in ("fsdp_post_all_gather", "__dict__", "__weakref__")})


class WrongArityWeight(RowwiseInt8Weight):
    """An fsdp_pre_all_gather FSDP2 would not know how to call."""

    def fsdp_pre_all_gather(self, mesh, outer_size):
        return RowwiseInt8Weight.fsdp_pre_all_gather(self, mesh, outer_size, None, None, None)


def _refusal_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    def refusal(kind, weight=RowwiseInt8Weight, **kw) -> str:
        layer = nn.Linear(26, 13)
        layer.weight = nn.Parameter(weight(layer.weight.detach()))
        with pytest.raises(kind) as info:
            fusedist.fully_shard(layer, **kw)
        return str(info.value)

    from torch.distributed.tensor import Shard

    errors = {
        "dim 1": refusal(NotImplementedError, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None),
        "int": refusal(NotImplementedError, reshard_after_forward=2),
        "quantized storage": refusal(NotImplementedError, Int8StorageWeight),
        "pre only": refusal(ValueError, PreOnlyWeight),
        "arity": refusal(TypeError, WrongArityWeight),
    }
    assert "'weight'" in errors["dim 1"] and "Shard(1)" in errors["dim 1"]
    assert "reshard_after_forward as an int" in errors["int"]
    # (quantized storage is taken frozen only: Note [quantized storage] in fusedist/fsdp/packed.py)
    assert "Int8StorageWeight" in errors["quantized storage"] and "requires_grad_(False)" in errors["quantized storage"]
    assert "fsdp_post_all_gather must be" in errors["pre only"]
    assert "fsdp_pre_all_gather(self, mesh, outer_size)" in errors["arity"]
    # a rank whose weights are not the subclass: the same clear error on every rank, no hang
    m = rowwise_model()
    if rank % 2:
        for layer in (m[0], m[2], m[4]):
            layer.weight = nn.Parameter(layer.weight._data.clone())
    shard(m, fusedist.fully_shard)
    with pytest.raises(fusedist.RankMismatchError,
                       match=r"4\.weight \(RowwiseInt8Weight\) .*; ranks \[1, 3\]: "
                             r".*\[4\.weight \(float32\) \(4, 13\)"):
        m(batch(0, rank, world))
    # HSDP over a 2x2 mesh, against FSDP2's
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    mp = MixedPrecisionPolicy()
    ours, losses, _ = _train_rowwise(True, rank, world, mp, True, False, mesh=mesh)
    ref, ref_losses, _ = _train_rowwise(False, rank, world, mp, True, False, mesh=mesh)
    torch.testing.assert_close(losses, ref_losses, **CLOSE)
    a, b = full_of(ours, True), full_of(ref, False)
    for k in a:
        torch.testing.assert_close(a[k], b[k], **CLOSE, msg=f"{k} differs from FSDP2's under HSDP")
    return errors


def test_extension_refusals_and_hsdp(four_ranks):
    _passed(four_ranks, "refusals")
    assert len(four_ranks[0]["refusals result"]) == 5


def test_fused_optimizer_refuses_a_subclass_it_cannot_step():
    p = nn.Parameter(Int8StorageWeight(torch.randn(4, 4)))
    p.grad = torch.randn(4, 4)
    opt = fusedist.optim.FusedAdamW([p], lr=1e-2)
    with pytest.raises(TypeError, match=r"param 0 of group 0 is a tensor subclass, Int8StorageWeight"):
        opt.step()


def _optimizer_dcp_worker(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    def steps(m, opt, seeds):
        return square_loss_steps(m, opt, (batch(s, rank, world) for s in seeds))

    m = shard(rowwise_model(), fusedist.fully_shard)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    steps(m, opt, range(2))
    model_sd, optim_sd = get_state_dict(m, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    resumed = {}
    for ours in (True, False):  # into fusedist's units and into FSDP2's, each having stepped otherwise
        n = shard(rowwise_model(), fusedist.fully_shard if ours else fully_shard)
        n_opt = torch.optim.AdamW(n.parameters(), lr=1e-2)
        steps(n, n_opt, (9,))
        model_sd, optim_sd = get_state_dict(n, n_opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(n, n_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        resumed[ours] = steps(n, n_opt, (5, 6))
    expected = steps(m, opt, (5, 6))
    torch.testing.assert_close(resumed[True], expected, **EXACT)
    torch.testing.assert_close(resumed[False], expected, **CLOSE)


def test_extension_optimizer_state_in_torch_dcp(two_ranks):
    """Model and AdamW state of extension pieces through torch's state-dict helpers and DCP: a
    resume into fusedist's units continues exactly, into FSDP2's as FSDP2 would."""
    _passed(two_ranks, "dcp")


def _run_scenarios(rank, world, scenarios: dict) -> dict:
    """Each scenario in turn, as it ran in a spawn of its own. A scenario that fails gives its
    traceback, for its own test to report, and ends the run: the other ranks may be elsewhere,
    so the scenarios after it are not started. A scenario's return value is kept under
    "<name> result" (the refusal messages)."""
    import traceback

    out = {}
    for name, (fn, *args) in scenarios.items():
        try:
            result = fn(rank, world, *args)
        except Exception:
            out[name] = f"rank {rank}:\n{traceback.format_exc()}"
            break
        out[name], out[f"{name} result"] = None, result
    return out


def _two_rank_worker(rank, world, root):
    """Every 2-rank scenario of this file in one spawn (starting ranks that import torchao and
    dynamo costs more than most scenarios)."""
    return _run_scenarios(rank, world, {
        "float8": (_float8_worker,), "precompute": (_precompute_worker,),
        "state": (_state_worker, os.path.join(root, "state")),
        "dcp": (_optimizer_dcp_worker, os.path.join(root, "dcp")),
        "rowwise": (_rowwise_worker, *ROWWISE_2), "names": (_extension_names_worker,),
        "compiled": (_compiled_float8_worker,)})  # last: compiling leaves dynamo's caches behind


def _four_rank_worker(rank, world, root):
    """Both 4-rank scenarios in one spawn."""
    return _run_scenarios(rank, world, {"refusals": (_refusal_worker,), "float8 tp": (_float8_tp_worker, root)})


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """Per rank, {scenario: None when it passed, else its traceback; "<scenario> result": its return}."""
    return run_distributed(_four_rank_worker, 4, str(tmp_path_factory.mktemp("extension_tp")), timeout=300)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Per rank, {scenario: None when it passed, else its traceback}. 300 s: 40 s on a loaded
    2-core machine (the five spawns it replaces had 60 s each)."""
    root = tmp_path_factory.mktemp("extension")
    for sub in ("state", "dcp"):
        (root / sub).mkdir()
    return run_distributed(_two_rank_worker, 2, str(root), timeout=300)


def _passed(per_rank, name):
    for rank, out in enumerate(per_rank):
        assert name in out, f"rank {rank}: {name} did not run, after a failure:\n{[v for v in out.values() if v]}"
        assert out[name] is None, out[name]
