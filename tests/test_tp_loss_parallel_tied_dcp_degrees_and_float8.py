"""torchtitan's 2-D recipe on a (dp=2, tp=2) gloo mesh in the corners the main tensor-parallel
tests (tests/test_fully_shard_tensor_parallel.py) leave out, each against torch's FSDP2 on the
same mesh:

* ``loss_parallel``: the output layer's logits stay sharded on the vocabulary (a DTensor) and
  the cross-entropy runs on the shards, with the embedding tied to the output layer (one
  ``Shard(0)`` parameter read by a ``RowwiseParallel`` embedding and a ``ColwiseParallel``
  output), bf16 parameters with fp32 reduction, and the clip's global norm over both groups;
* gradient accumulation (``set_requires_gradient_sync(False)``) with bf16 parameters and fp32
  reduction: the ``Partial`` gradients of ``SequenceParallel`` norms accumulated un-summed in
  fp32 and summed over the tensor-parallel group once (Note [tensor-parallel gradients across
  micro-batches] in fusedist/fsdp/tensor_parallel.py);
* torch's distributed checkpoint across tensor-parallel degrees: saved at tp=2 and loaded at
  tp=1 (a 1-D ``fully_shard`` over the 4 ranks), by either engine into either;
* torchao float8 training: the tensorwise recipe with float8 all-gathers and the precomputed
  scales, and the rowwise recipe, on tensor-parallel weights.

Tolerances. Losses are bit-identical to FSDP2's: both sides gather the same values and reduce
the same gradients in the same order. The clip's total norm may differ in its last bit (fp32:
the per-piece sums of squares are added over the data-parallel group in another grouping than
FSDP2's DTensor reduction), hence ``rtol=1e-6``; so the runs compared bit for bit do not clip
(an ulp of the coefficient may flip a bf16 or float8 rounding of a weight later), and the clip
is checked on one step after them. A checkpoint load moves values and computes
none: exact. float8: FSDP2's float8 all-gather cannot run over gloo (gloo has no float8 types),
so its reference is FSDP2 gathering the fp32 weights, which torchao then casts with the amax of
the whole global weight -- the scale fusedist's precomputed one is (the amax over the shard and
tensor-parallel groups), so the float8 bytes and the losses are identical.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from torch import nn

from shared_rank_launch import launch_for_selected, results_of

VOCAB, HIDDEN = 13, 16  # 13: uneven vocabulary shards (7 and 6 rows) over the 2 tensor-parallel ranks
EXACT = dict(rtol=0, atol=0)


class _FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.w2 = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class _Net(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.ffn = _FeedForward()
        self.norm = nn.LayerNorm(HIDDEN)
        self.out = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tied:
            self.out.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        return self.out(self.norm(x + self.ffn(x)))


def _build(mesh, ours: bool, seed: int, tied=False, sharded_logits=False, mp=False, float8=None):
    """The model on ``mesh`` (``("dp", "tp")``: the plan, then ``fully_shard`` on ``mesh["dp"]``;
    1-D: ``fully_shard`` only), by fusedist or by torch's FSDP2."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    import fusedist

    torch.manual_seed(seed)
    model = _Net(tied)
    if float8 is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = (Float8LinearConfig(enable_fsdp_float8_all_gather=ours) if float8 == "tensorwise"
                  else Float8LinearConfig.from_recipe_name(float8))
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn.startswith("ffn"))
    dp = mesh
    if mesh.ndim == 2:
        parallelize_module(model, mesh["tp"], {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "ffn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "ffn.w1": ColwiseParallel(), "ffn.w2": RowwiseParallel(output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if sharded_logits else Replicate(),
                                   use_local_output=not sharded_logits)})
        if tied:  # (parallelize_module gives each module a new DTensor parameter: tie them again)
            model.out.weight = model.embed.weight
        dp = mesh["dp"]
    kwargs = {}
    if mp:
        policy = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kwargs["mp_policy"] = fusedist.MixedPrecisionPolicy(**policy) if ours else TorchMixedPrecision(**policy)
    shard = fusedist.fully_shard if ours else torch_fully_shard
    shard(model.ffn, mesh=dp, **kwargs)
    shard(model, mesh=dp, **kwargs)
    return model


def _train(model, ours: bool, data_rank: int, seed: int, steps=3, sharded_logits=False, float8=False, clip=True,
           accumulate=1):
    """AdamW steps with the clip: (optimizer, losses, total norms). The tensor-parallel ranks of a
    data-parallel rank see one batch; each step takes ``accumulate`` micro-batches, all but the
    last without gradient sync."""
    import torchao.float8
    from torch.distributed.tensor.parallel import loss_parallel

    import fusedist

    precompute = None
    if float8:
        precompute = (fusedist.fsdp.precompute_float8_dynamic_scale_for_fsdp if ours
                      else torchao.float8.precompute_float8_dynamic_scale_for_fsdp)
        precompute(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed + data_rank)
    losses, norms = [], []
    for _ in range(steps):
        for micro in range(accumulate):
            model.set_requires_gradient_sync(micro == accumulate - 1)
            ids = torch.randint(0, VOCAB, (4, 8), generator=g)
            with loss_parallel() if sharded_logits else contextlib.nullcontext():
                loss = nn.functional.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten())
                loss.backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        opt.zero_grad()
        if precompute is not None:
            precompute(model)
        loss = loss.detach()
        losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
    return opt, losses, norms


def _meshes():
    from torch.distributed.device_mesh import init_device_mesh

    return (init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
            init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))


def _loss_parallel_tied(rank, world, seed):
    mesh, _ = _meshes()
    data_rank = mesh["dp"].get_local_rank()
    runs = {}
    for ours in (True, False):
        model = _build(mesh, ours, seed, tied=True, sharded_logits=True, mp=True)
        tied = model.out.weight is model.embed.weight
        losses = _train(model, ours, data_rank, seed, sharded_logits=True, clip=False)[1]
        # then one clipped step: the norm, the clipped gradients' norm
        norms = _train(model, ours, data_rank, seed + 1, steps=1, sharded_logits=True)[2]
        runs[ours] = (tied, losses, norms)
    return runs[True], runs[False]


def _bf16_accumulation(rank, world, seed):
    """bf16 parameters, fp32 reduction, 2 steps of 3 micro-batches (2 without gradient sync), no clip
    (its norm is summed in another order than FSDP2's: an ulp): (losses, the full model after)
    of fusedist and of FSDP2."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    mesh, _ = _meshes()
    runs = []
    for ours in (True, False):
        model = _build(mesh, ours, seed, mp=True)
        losses = _train(model, ours, mesh["dp"].get_local_rank(), seed, steps=2, clip=False, accumulate=3)[1]
        runs.append((losses, get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))))
    return runs


def _checkpoint_across_degrees(rank, world, seed, root):
    """{"<saver> tp=<a> -> <loader> tp=<b>": (largest model difference, largest optimizer state
    difference) against the saved run's full state dicts}."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, get_state_dict, set_state_dict)

    full = StateDictOptions(full_state_dict=True)
    two_d, flat = _meshes()
    out = {}
    for saver in (True, False):
        for name, src, dst in (("tp=2 -> tp=1", two_d, flat),):
            model = _build(src, saver, seed)
            opt = _train(model, saver, src["dp"].get_local_rank(), seed, steps=2)[0]
            model_sd, optim_sd = get_state_dict(model, opt)
            where = os.path.join(root, f"{saver}-{name}")
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=where)
            want = get_model_state_dict(model, options=full)
            want_optim = get_optimizer_state_dict(model, opt, options=full)["state"]
            for loader in (True, False):
                fresh = _build(dst, loader, seed + 1)  # other initial values, all overwritten by the load
                fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
                model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
                state = {"model": model_sd, "optim": optim_sd}
                dcp.load(state, checkpoint_id=where)
                set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
                got = get_model_state_dict(fresh, options=full)
                got_optim = get_optimizer_state_dict(fresh, fresh_opt, options=full)["state"]
                assert got.keys() == want.keys() and got_optim.keys() == want_optim.keys()
                out[f"{'fusedist' if saver else 'FSDP2'} {name} {'fusedist' if loader else 'FSDP2'}"] = (
                    max(float((got[k] - want[k]).abs().max()) for k in want),
                    max(float((got_optim[k][s] - want_optim[k][s]).abs().max())
                        for k in want_optim for s in want_optim[k]))
    return out


def _float8(rank, world, seed):
    mesh, _ = _meshes()
    data_rank = mesh["dp"].get_local_rank()
    out = {}
    for recipe in ("tensorwise", "rowwise"):
        runs = [_train(_build(mesh, ours, seed, float8=recipe), ours, data_rank, seed, steps=2, clip=False,
                       float8=recipe == "tensorwise")[1] for ours in (True, False)]
        out[recipe] = runs
    return out


def _by_test(seed: int, root: str) -> dict:
    return {
        "test_loss_parallel_with_tied_embeddings_matches_fsdp2": {"loss_parallel": (_loss_parallel_tied, (seed,))},
        "test_partial_gradients_accumulate_in_reduce_dtype_as_fsdp2": {
            "bf16 accumulation": (_bf16_accumulation, (seed,))},
        "test_torch_dcp_moves_between_tensor_parallel_degrees": {
            "dcp": (_checkpoint_across_degrees, (seed, root))},
        "test_float8_tensor_parallel_weights_train_as_fsdp2": {"float8": (_float8, (seed,))},
    }


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    pytest.importorskip("torchao")
    seed = int(torch.randint(0, 10_000, ()).item())
    return seed, launch_for_selected(request, _by_test(seed, str(tmp_path_factory.mktemp("tp_dcp"))), 4, timeout=300)


def test_loss_parallel_with_tied_embeddings_matches_fsdp2(launched):
    seed, results = launched
    for rank, (ours, theirs) in enumerate(results_of(results, "loss_parallel")):
        assert ours[0] and theirs[0], f"rank {rank}: the tie did not survive fully_shard (seed {seed})"
        assert ours[1] == theirs[1], f"rank {rank}: losses {ours[1]} != FSDP2's {theirs[1]} (seed {seed})"
        torch.testing.assert_close(ours[2], theirs[2], rtol=1e-6, atol=0, msg=f"rank {rank}: clip norms (seed {seed})")


def test_partial_gradients_accumulate_in_reduce_dtype_as_fsdp2(launched):
    """Note [tensor-parallel gradients across micro-batches] in fusedist/fsdp/tensor_parallel.py:
    the SequenceParallel norm's Partial gradients, kept un-summed in fp32 across unsynchronized
    backwards and summed over the tensor-parallel group once, as FSDP2 does -- the same bits.
    Summed per micro-batch in bf16, the parameters drifted from FSDP2's by up to 1e-4 in 3 steps."""
    seed, results = launched
    for rank, ((losses, state), (ref_losses, ref_state)) in enumerate(results_of(results, "bf16 accumulation")):
        assert losses == ref_losses, f"rank {rank}: losses {losses} != FSDP2's {ref_losses} (seed {seed})"
        assert state.keys() == ref_state.keys()
        for k in ref_state:
            torch.testing.assert_close(state[k], ref_state[k], **EXACT, msg=f"rank {rank}: {k} (seed {seed})")


def test_torch_dcp_moves_between_tensor_parallel_degrees(launched):
    seed, results = launched
    for rank, moves in enumerate(results_of(results, "dcp")):
        assert len(moves) == 4, moves
        bad = {k: v for k, v in moves.items() if v != (0.0, 0.0)}
        assert not bad, f"rank {rank}: loaded values differ from the saved ones (seed {seed}): {bad}"


def test_float8_tensor_parallel_weights_train_as_fsdp2(launched):
    seed, results = launched
    for rank, recipes in enumerate(results_of(results, "float8")):
        for recipe, (ours, theirs) in recipes.items():
            assert ours == theirs, f"rank {rank} {recipe}: losses {ours} != FSDP2's {theirs} (seed {seed})"
