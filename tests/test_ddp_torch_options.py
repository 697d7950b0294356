"""torch DDP's constructor options, as of torch 2.13, on fusedist's DistributedDataParallel: the
same parameters in the same positions, and the same results where an option changes them --
buffers synced at construction and at forwards (``forward_sync_buffers``, the deprecated
``broadcast_buffers``, ``init_sync``), per-bucket caps (``bucket_cap_mb_list``) -- compared
with torch DDP on 2 gloo ranks; so are the attributes and private methods torch's DDP gives
scripts (its settings in bytes, ``require_forward_param_sync``, ``_register_fused_optim``,
``_get_data_parallel_params``, a hook's annotations checked, ``_update_process_group`` refused,
``process_group`` the same object, let go of once destroyed, buffer communication hooks and
``_sync_buffers()``, ``_set_ddp_sink_clone``, ``model.logger``); a load runs the state_dict hooks as often as
torch's (never), a torch DDP inside over a destroyed group is refused naming the destroy, and copies of a
traced wrapper add to the original's trace file.
The CPU tests' two-rank scenarios share one launch of the ranks
(``launched``): starting ranks costs more than most scenarios.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fusedist.testing import run_distributed
from shared_rank_launch import launch_for_selected, results_of
from test_ddp_held_grads_moved import check_moved_gradients, moved_gradients_beside_torch


def test_signature_takes_torchs_parameters_in_torchs_positions():
    import fusedist

    theirs = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    ours = inspect.signature(fusedist.DistributedDataParallel.__init__).parameters
    positional = [n for n, p in ours.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == list(theirs)[:len(positional)]
    assert len(positional) >= list(theirs).index("find_unused_parameters") + 1
    from fusedist.ddp.arguments import TORCH_ONLY_OPTIONS

    for name in theirs:
        assert name in ours or name in TORCH_ONLY_OPTIONS or name == "mixed_precision", name
    for name in ("broadcast_buffers", "init_sync", "forward_sync_buffers", "bucket_cap_mb_list", "bucket_cap_mb",
                 "find_unused_parameters", "device_mesh", "static_graph"):
        assert ours[name].default == theirs[name].default, name


@pytest.mark.parametrize("given", ["delay_all_reduce_named_params", "param_to_hook_all_reduce"])
def test_delayed_all_reduce_options_given_alone_are_refused_as_torch_refuses_them(given):
    """torch's DDP requires both or neither (a ValueError before it touches a group); fusedist
    ignored the one given, where the user meant a delay torch would have refused."""
    import fusedist

    module = nn.Linear(3, 2)
    value = list(module.named_parameters()) if given == "delay_all_reduce_named_params" else module.weight
    for ddp in (nn.parallel.DistributedDataParallel, fusedist.DistributedDataParallel):
        with pytest.raises(ValueError, match="need to be set at the same time"):
            ddp(module, **{given: value})


def test_device_arguments_without_device_ids_are_read_as_torch_reads_them():
    """torch's DDP refuses ``output_device`` (truthy: ``output_device=0`` passes its test) where no
    ``device_ids`` apply -- a CPU module, or none given -- and reads ``device_ids=[]`` as None
    (``DistributedDataParallel.__init__``); fusedist ignored the first and refused the second.
    The check is a function of the module's device, so a CUDA device is named without one."""
    from fusedist.ddp.arguments import check_device_ids

    gpu = torch.device("cuda", 0)
    check_device_ids(gpu, [], None)
    check_device_ids(gpu, None, 0)
    check_device_ids(gpu, [0], 0)
    with pytest.raises(ValueError, match=r"output_device=1 given for a module on cuda:0; pass device_ids=\[0\]"):
        check_device_ids(gpu, None, 1)
    with pytest.raises(ValueError, match="output_device=1 given for a module on cpu; pass device_ids=None"):
        check_device_ids(torch.device("cpu"), None, 1)


def test_output_device_attribute_keeps_the_one_given_as_torch_does():
    """torch's DDP on CUDA keeps the ``output_device`` the user gives (as a device index; only
    when None does it take ``device_ids[0]``); fusedist set ``device_ids[0]`` whatever was given.
    A function of the module's device, so a CUDA device is named without one."""
    from fusedist.ddp.arguments import device_attributes

    gpu = torch.device("cuda", 0)
    assert device_attributes(gpu, [0], None) == ([0], 0)
    for given in (1, "cuda:1", torch.device("cuda", 1)):
        assert device_attributes(gpu, [0], given) == ([0], 1), given
    assert device_attributes(gpu, [gpu], 0) == ([0], 0)
    assert device_attributes(gpu, [], None) == (None, None)
    assert device_attributes(torch.device("cpu"), None, None) == (None, None)


def test_a_copy_keeps_device_ids_and_output_device_as_torchs_copy_does():
    """torch's copy of a CUDA DDP model keeps ``device_ids`` and ``output_device``; fusedist's copy
    was built without them (device_ids=None: its forwards no longer moved inputs to the device).
    The copy's keywords, from a wrapper on cuda:1 (output_device 0), give the original's
    attributes again; a CPU wrapper's copy takes none."""
    from types import SimpleNamespace

    from fusedist.ddp.arguments import check_device_ids, device_attributes
    from fusedist.ddp.config import DDPConfig
    from fusedist.ddp.copies import twin_arguments

    gpu = torch.device("cuda", 1)
    for device, ids, output in ((gpu, [1], 0), (gpu, [1], 1), (torch.device("cpu"), None, None)):
        original = SimpleNamespace(config=DDPConfig(), device_mesh=None, process_group=None, dim=0, device=device,
                                   device_ids=ids, output_device=output)
        kwargs = twin_arguments(original)
        check_device_ids(device, kwargs["device_ids"], kwargs["output_device"])
        assert device_attributes(device, kwargs["device_ids"], kwargs["output_device"]) == (ids, output), device
        assert ids is None or kwargs["device_ids"] is not ids  # (a list of its own, as torch's copy has)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.lin(x))


# (name, kwargs): each run by torch DDP and fusedist DDP.
BUFFER_CASES = [
    ("default", {}),
    ("broadcast_buffers=False", dict(broadcast_buffers=False)),
    ("broadcast_buffers=True", dict(broadcast_buffers=True)),
    ("forward_sync_buffers=False", dict(forward_sync_buffers=False)),
    ("both given", dict(broadcast_buffers=False, forward_sync_buffers=True)),
    ("init_sync=False", dict(init_sync=False)),
    ("init_sync=False, forward_sync_buffers=False", dict(init_sync=False, forward_sync_buffers=False)),
]


def _rank_distinct_net(rank):
    """A model whose parameters and BatchNorm statistics differ between ranks."""
    torch.manual_seed(100 + rank)
    net = _Net()
    with torch.no_grad():
        net.bn.running_mean.fill_(float(rank + 1))
        net.bn.running_var.fill_(float(rank + 2))
    return net


def _state(model):
    module = model.module
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _buffer_worker(rank, world_size):
    import fusedist

    out = {}
    for name, kwargs in BUFFER_CASES:
        base = _rank_distinct_net(rank)
        seen = {}
        for who, cls in (("torch", nn.parallel.DistributedDataParallel),
                         ("fusedist", fusedist.DistributedDataParallel)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model = cls(copy.deepcopy(base), **kwargs)
            future = sorted({str(w.message).split()[0] for w in caught if issubclass(w.category, FutureWarning)})
            after_init = _state(model)
            syncs = [model.will_sync_module_buffers()]
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(7 + rank))
            model(x).sum().backward()  # a training forward: statistics updated per rank
            syncs.append(model.will_sync_module_buffers())
            model.eval()
            with torch.no_grad():
                y = model(x)  # the forward after a synchronized one broadcasts buffers (if on)
            seen[who] = (after_init, _state(model), y, syncs, bool(future), model.forward_sync_buffers)
        out[name] = seen
    return out


def test_buffer_and_parameter_sync_options_match_torch(launched):
    per_rank = results_of(launched, "buffers")
    for rank, out in enumerate(per_rank):
        for name, seen in out.items():
            (t_init, t_after, t_y, t_sync, t_warn, t_flag) = seen["torch"]
            (f_init, f_after, f_y, f_sync, f_warn, f_flag) = seen["fusedist"]
            where = f"rank {rank}, {name}"
            for key in t_init:
                assert torch.equal(t_init[key], f_init[key]), f"{where}: {key} after construction"
                assert torch.allclose(t_after[key], f_after[key], rtol=1e-6, atol=1e-7), \
                    f"{where}: {key} after forwards"
            assert torch.allclose(t_y, f_y, rtol=1e-6, atol=1e-6), where
            assert t_sync == f_sync, (where, t_sync, f_sync)
            assert t_warn == f_warn, (where, "FutureWarning", t_warn, f_warn)
            assert t_flag == f_flag, where
    # The cases really differ: rank 1's statistics survive construction without init sync.
    r1 = per_rank[1]
    assert not torch.equal(r1["init_sync=False"]["torch"][0]["bn.running_mean"],
                           r1["default"]["torch"][0]["bn.running_mean"])
    assert not torch.equal(r1["broadcast_buffers=False"]["torch"][1]["bn.running_mean"],
                           r1["default"]["torch"][1]["bn.running_mean"])


def test_bucket_cap_mb_list_caps_each_bucket_in_readiness_order():
    from fusedist.ddp.layout import build_layout

    params = [nn.Parameter(torch.zeros(n)) for n in (100, 300, 50, 50, 400, 10, 10, 10, 500)]
    caps = [1000, 1200, 400]  # bytes: each bucket closes once it reached its cap, as torch's
    layout = build_layout(params, [str(i) for i in range(len(params))], caps=caps, world_size=1,
                          device=torch.device("meta"))
    sizes = [[p.numel() for p in b.params] for b in layout.buckets]
    assert sizes == [[100, 300], [50, 50, 400], [10, 10, 10, 500]], sizes
    torch_buckets, _ = torch.distributed._compute_bucket_assignment_by_size(
        [p.detach() for p in params], caps, [False] * len(params), list(range(len(params))))
    assert [len(b.params) for b in layout.buckets] == [len(b) for b in torch_buckets]


def _trained_beside_torch(base, rank, batch, **ddp_kwargs):
    """torch DDP and fusedist's on copies of ``base`` with the same options, three SGD steps:
    the largest parameter difference, fusedist's bucket bytes and the buckets torch rebuilt
    (its logging data holds them from the third iteration on)."""
    import fusedist

    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), **ddp_kwargs)
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base), **ddp_kwargs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    gen = torch.Generator().manual_seed(1 + rank)
    width = next(base.parameters()).shape[1]
    for _ in range(3):
        x = torch.randn(batch, width, generator=gen)
        for model, opt in zip((ref, ours), opts):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), ours.parameters()))
    torch_bytes = [int(n) for n in str(ref._get_ddp_logging_data()["rebuilt_bucket_sizes"]).split(",")]
    return diff, [sum(p.numel() * 4 for p in b.params) for b in ours.buckets], torch_bytes


def _caps_worker(rank, world_size):
    import fusedist

    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    diff, bucket_bytes, torch_bytes = _trained_beside_torch(base, rank, 16, bucket_cap_mb_list=[0.002, 0.01, 0.005])
    errors = []
    for bad in ([], [-1.0], "x", [True]):
        try:
            fusedist.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb_list=bad)
        except ValueError as exc:
            errors.append(str(exc))
    return diff, bucket_bytes, torch_bytes, errors


def test_bucket_cap_mb_list_trains_as_torch_ddp(launched):
    for diff, bucket_bytes, torch_bytes, errors in results_of(launched, "caps"):
        assert diff < 1e-6, diff
        # Linear(32, 32): 4096 B of weight, 128 B of bias. Each bucket closes once it reaches
        # its cap (2 KiB, then 10 KiB, then 5 KiB each): the buckets torch DDP rebuilt after
        # its first step (Note [buckets close as torch's do]).
        assert bucket_bytes == torch_bytes == [4224, 3 * 4224, 2 * 4224], (bucket_bytes, torch_bytes)
        assert len(errors) == 4 and all("bucket_cap_mb_list" in e for e in errors), errors


def _bucket_cap_worker(rank, world_size, bucket_cap_mb):
    torch.manual_seed(0)
    # 1 MiB weights: torch's first bucket is 1 MiB while bucket_cap_mb is its default, and
    # bucket_cap_mb itself once it is given (2 MiB: two layers), so the two rules differ here
    base = nn.Sequential(*[nn.Linear(512, 512) for _ in range(5)])
    kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    return _trained_beside_torch(base, rank, 4, **kwargs)


@pytest.mark.parametrize("bucket_cap_mb", [None, 2, 0])
def test_bucket_cap_mb_makes_torch_ddps_buckets(launched, bucket_cap_mb):
    """The first bucket's cap is torch's: 1 MiB by default, ``bucket_cap_mb`` once it is given
    (fusedist kept 1 MiB, one collective more than torch for 2 MiB here); and 0 is one bucket
    per parameter, as torch's (fusedist refused it)."""
    for diff, bucket_bytes, torch_bytes in results_of(launched, f"bucket_cap_mb={bucket_cap_mb}"):
        assert diff < 1e-6, diff
        layer = 512 * 512 * 4 + 512 * 4
        expected = {None: [layer, 4 * layer], 2: [2 * layer, 2 * layer, layer],
                    0: [512 * 4, 512 * 512 * 4] * 5}[bucket_cap_mb]
        assert bucket_bytes == torch_bytes == expected, (bucket_bytes, torch_bytes)


def _unfreeze_caps_worker(rank, world_size):
    import fusedist

    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Linear(32, 32) for _ in range(5)])
    caps = [0.002, 0.01, 0.005]
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb_list=caps)
    model = copy.deepcopy(base)
    for p in model[:4].parameters():
        p.requires_grad_(False)  # frozen when wrapped, trainable from the first step
    ours = fusedist.DistributedDataParallel(model, bucket_cap_mb_list=caps)
    # A sharded optimizer fixes the layout: parameters that become trainable get buckets
    # appended (Note [trainable set changes]) instead of a rebuild.
    fusedist.ZeroRedundancyOptimizer(ours.parameters(), torch.optim.SGD, lr=0.1)
    wrapped = len(ours.buckets)
    for p in model.parameters():
        p.requires_grad_(True)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1 + rank))
    for m in (ref, ours):
        m(x).pow(2).mean().backward()
    diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(ref.parameters(), ours.parameters()))
    appended = [sum(p.numel() * 4 for p in b.params) for b in ours.buckets[wrapped:]]
    return diff, appended


def test_buckets_appended_for_unfrozen_parameters_follow_bucket_cap_mb_list(launched):
    """Buckets appended when parameters become trainable (under a ZeroRedundancyOptimizer)
    take the list's last cap, not bucket_cap_mb (which the list replaces): here 5 KiB, so the
    four layers (4224 B each: a 4096 B weight and its bias) take two buckets, not one, each
    closed once it reached the cap (Note [buckets close as torch's do]). The gradients are torch
    DDP's (fp32, same sums)."""
    for diff, appended in results_of(launched, "unfrozen caps"):
        assert diff < 1e-6, diff
        cap = int(0.005 * 2**20)
        assert appended == [2 * 4224, 2 * 4224] and all(size >= cap for size in appended), appended


def _two_forwards_worker(rank, world_size):
    """Two training forwards, then one backward of their summed losses (two micro-batches in
    one graph): the second forward broadcasts the BatchNorm statistics the first one saved for
    backward. Weights, statistics and the versions of the statistics against torch DDP's."""
    import fusedist

    base = _rank_distinct_net(rank)
    out = {}
    for who, cls in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        model = cls(copy.deepcopy(base))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(11 + rank)
        for _ in range(3):
            a, b = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
            opt.zero_grad()
            (model(a).square().mean() + model(b).square().mean()).backward()
            opt.step()
        out[who] = _state(model)
    return max((out["torch"][k].float() - out["fusedist"][k].float()).abs().max().item() for k in out["torch"])


def test_two_forwards_before_one_backward_match_torch(launched):
    """The buffer broadcast writes without bumping the buffers' versions, as torch's does:
    before, the backward failed with "modified by an inplace operation"."""
    for diff in results_of(launched, "two forwards"):
        assert diff <= 1e-6, diff


# -- torch DDP's input placement and its legacy helpers (Note [inputs moved to the module's device]) --

@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    tag: str


def _placement_attrs_and_helpers(rank, world):
    import fusedist

    results = {}
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 3, generator=gen), torch.randn(2, 3, generator=gen)
    for name, cls in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        torch.manual_seed(0)
        model = cls(nn.Linear(3, 2))
        moved_args, moved_kwargs = model.to_kwargs((x, [y]), {"batch": _Batch(x, "a")}, None)
        try:  # torch's gather is for CUDA tensors: the same refusal on CPU
            gathered = model.gather([torch.ones(2, 2), torch.zeros(1, 2)], -1)
        except AssertionError as e:
            gathered = str(e)
        results[name] = dict(device_ids=model.device_ids, output_device=model.output_device,
                             device_type=model.device_type, moved=(moved_args, moved_kwargs), gathered=gathered,
                             out=model(x).detach())
    return results


def test_cpu_placement_attributes_and_helpers_match_torch(launched):
    """On CPU (no device_ids) inputs go through untouched and ``device_ids``/``output_device``/
    ``device_type`` and the ``to_kwargs``/``gather`` helpers equal torch DDP's."""
    for res in results_of(launched, "placement"):
        ours, theirs = res["fusedist"], res["torch"]
        for key in ("device_ids", "output_device", "device_type"):
            assert ours[key] == theirs[key], key
        (args_o,), (kw_o,) = ours["moved"]
        (args_t,), (kw_t,) = theirs["moved"]
        torch.testing.assert_close(args_o, args_t, rtol=0, atol=0)
        assert kw_o["batch"].tag == kw_t["batch"].tag == "a"
        torch.testing.assert_close(kw_o["batch"].x, kw_t["batch"].x, rtol=0, atol=0)
        assert ours["gathered"] == theirs["gathered"] == "Gather function not implemented for CPU tensors"
        torch.testing.assert_close(ours["out"], theirs["out"], rtol=0, atol=0)


def _cuda_inputs_moved(rank, world):
    import fusedist

    torch.manual_seed(0)
    base = nn.Linear(3, 2).cuda()
    outs = {}
    for name, cls in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        model = cls(copy.deepcopy(base), device_ids=[0])
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))  # on the host, as a DataLoader gives it
        out = model(x, **{})
        out.sum().backward()
        gathered = model.gather([out.detach(), out.detach()[:1]], model.output_device)
        outs[name] = (out.device.type, out.detach().cpu(), model.device_ids, model.output_device, gathered.cpu())
    return outs


@pytest.mark.gpu
def test_cuda_inputs_on_the_host_are_moved_to_the_device_ids_device():
    """torch DDP given ``device_ids`` copies host inputs to the module's GPU; so does fusedist's."""
    outs = run_distributed(_cuda_inputs_moved, 1, backend="nccl")[0]
    assert outs["fusedist"][0] == outs["torch"][0] == "cuda"
    torch.testing.assert_close(outs["fusedist"][1], outs["torch"][1])
    assert outs["fusedist"][2:4] == outs["torch"][2:4] == ([0], 0)
    torch.testing.assert_close(outs["fusedist"][4], outs["torch"][4])


# -- rank-local parameters and buffers (Note [parameters and buffers DDP ignores]) -------------------

class _WithLocalState(nn.Module):
    """``shared`` is data-parallel; ``local`` (its width differs between ranks) and the
    ``seen`` buffer are this rank's own, as a sharded table or a per-rank statistic would be."""

    def __init__(self, rank):
        super().__init__()
        self.shared = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)
        self.local = nn.Linear(3, 2 + rank)
        self.register_buffer("seen", torch.full((1,), float(rank)))

    def forward(self, x):
        self.seen += x.shape[0]
        return self.local(self.bn(self.shared(x))).sum(dim=1)


def _ignored_state_trains_as_torch(rank, world):
    import fusedist

    torch.manual_seed(rank)  # every rank starts from its own values: the broadcast decides
    base = _WithLocalState(rank)
    ignored = ["local.weight", "local.bias", "seen"]
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(5, 4, generator=gen) for _ in range(3)]
    out = {}
    for name, cls in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        module = copy.deepcopy(base)
        cls._set_params_and_buffers_to_ignore_for_model(module, ignored)
        model = cls(module)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for x in batches:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        out[name] = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        out[name + " ignores"] = sorted(getattr(model, "parameters_to_ignore"))
    return out


def test_parameters_and_buffers_to_ignore_stay_rank_local_as_in_torch(launched):
    """torch's ``_set_params_and_buffers_to_ignore_for_model``: ignored parameters (of a shape
    that differs between ranks) keep this rank's values and are trained on this rank's
    gradient, the ignored buffer is not broadcast; the rest is synchronized. Equal to torch
    DDP's state after three SGD steps on every rank, bitwise."""
    results = results_of(launched, "ignored state")
    for rank, res in enumerate(results):
        assert res["fusedist ignores"] == res["torch ignores"]
        assert res["fusedist"].keys() == res["torch"].keys()
        for key in res["torch"]:
            torch.testing.assert_close(res["fusedist"][key], res["torch"][key], rtol=0, atol=0, msg=key)
        assert res["fusedist"]["seen"].item() == rank + 15  # never broadcast from rank 0
    torch.testing.assert_close(results[0]["fusedist"]["shared.weight"], results[1]["fusedist"]["shared.weight"])
    assert results[0]["fusedist"]["local.weight"].shape != results[1]["fusedist"]["local.weight"].shape


def _ignore_lists_differ(rank, world):
    import fusedist

    module = nn.Linear(3, 3)
    if rank == 1:
        fusedist.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ["bias"])
    fusedist.DistributedDataParallel(module)


def test_an_ignore_list_that_differs_between_ranks_is_refused_on_every_rank(launched):
    """Buckets built around different ignored sets would pair different tensors: the
    construction check names the setting on every rank (each rank's traceback is its result)."""
    outcomes = launched["ignore lists differ"]
    assert len(outcomes) == 2, outcomes
    for passed, text in outcomes:
        assert not passed and "RankMismatchError" in text and "params_and_buffers_to_ignore" in text, text


def _zero_with_rank_local_parameters(rank, world):
    import fusedist
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    from fusedist.zero import ZeroRedundancyOptimizer

    torch.manual_seed(rank)
    base = _WithLocalState(rank)
    ignored = ["local.weight", "local.bias", "seen"]
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(5, 4, generator=gen) for _ in range(3)]
    out = {}
    for name, ddp_cls, zero_cls, stages in (("torch", nn.parallel.DistributedDataParallel, TorchZero, (1,)),
                                            ("fusedist", fusedist.DistributedDataParallel, ZeroRedundancyOptimizer,
                                             (1, 2))):
        for stage in stages:
            module = copy.deepcopy(base)
            ddp_cls._set_params_and_buffers_to_ignore_for_model(module, ignored)
            model = ddp_cls(module)
            local = list(module.local.parameters())
            shared = [p for p in model.parameters() if all(p is not q for q in local)]
            kw = dict(stage=stage) if name == "fusedist" else {}
            if name == "fusedist":
                try:
                    zero_cls(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, **kw)
                except ValueError as e:
                    out[f"refused {stage}"] = str(e)
            opts = [zero_cls(shared, optimizer_class=torch.optim.SGD, lr=0.1, **kw), torch.optim.SGD(local, lr=0.1)]
            for x in batches:
                model(x).square().mean().backward()
                for opt in opts:
                    opt.step()
                    opt.zero_grad()
            out[f"{name} {stage}"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return out


def test_zero_refuses_rank_local_parameters_and_trains_the_rest_as_torch(launched):
    """A ZeroRedundancyOptimizer given parameters its DDP model ignores is refused naming them
    (sharding would overwrite their rank-local values); built over the synchronized ones, with
    a local optimizer for the rest, stages 1 and 2 train as torch's DDP + ZeroRedundancyOptimizer."""
    for res in results_of(launched, "zero with rank-local parameters"):
        for stage in (1, 2):
            assert "['local.weight', 'local.bias'] are ignored" in res[f"refused {stage}"]
            for key, expected in res["torch 1"].items():
                torch.testing.assert_close(res[f"fusedist {stage}"][key], expected, rtol=1e-6, atol=1e-7, msg=key)


# -- torch's settings as attributes, its buffer flag, its fused optimizer (Note [torch's settings as attributes]) --

_SETTING_NAMES = ("bucket_bytes_cap", "bucket_bytes_cap_list", "bucket_bytes_cap_default", "broadcast_bucket_size",
                  "skip_all_reduce_unused_params", "batched_grad_copy", "is_multi_device_module",
                  "require_forward_param_sync")


def _torch_settings_as_attributes(rank, world):
    import fusedist
    from torch.nn.parallel.distributed import _MixedPrecision

    results = []
    for kwargs in ({}, {"bucket_cap_mb": 0.5}, {"bucket_cap_mb_list": [1, 3, 2]},
                   {"skip_all_reduce_unused_params": True, "batched_grad_copy": True},
                   {"mixed_precision": _MixedPrecision(reduce_dtype=torch.float32)}):
        row = {}
        for name, cls in (("torch", nn.parallel.DistributedDataParallel),
                          ("fusedist", fusedist.DistributedDataParallel)):
            model = cls(nn.Linear(3, 2), **kwargs)
            row[name] = {key: getattr(model, key, "missing") for key in _SETTING_NAMES}
            row[name]["mixed_precision is the argument"] = model.mixed_precision is kwargs.get("mixed_precision")
        results.append((sorted(kwargs), row))
    return results


def test_constructor_settings_read_back_as_torch_ddps_attributes(launched):
    """The bucket caps in bytes (``bucket_bytes_cap``...), ``mixed_precision`` and the flags torch
    keeps from its constructor hold torch DDP's values (before: AttributeError)."""
    for per_rank in results_of(launched, "settings as attributes"):
        for kwargs, row in per_rank:
            assert row["fusedist"] == row["torch"], kwargs


def _forward_param_sync_flag(rank, world):
    import fusedist

    results = {}
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(6, 3, generator=gen) * (rank + 1) for _ in range(3)]
    for name, cls in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        torch.manual_seed(0)
        model = cls(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
        seen = [model.require_forward_param_sync]
        model(batches[0]).sum().backward()
        seen.append(model.require_forward_param_sync)
        model.require_forward_param_sync = False  # the next forward broadcasts nothing
        with torch.no_grad():
            model(batches[1])
        seen.append(model.require_forward_param_sync)
        after_unsynced = model.module[1].running_mean.clone()
        model.require_forward_param_sync = True  # this one broadcasts rank 0's statistics first
        model.eval()
        with torch.no_grad():
            model(batches[2])
        results[name] = dict(seen=seen, unsynced=after_unsynced, synced=model.module[1].running_mean.clone(),
                             will_sync=model.will_sync_module_buffers())
    return results


def test_require_forward_param_sync_reads_and_sets_the_next_forwards_buffer_broadcast_as_torch(launched):
    """torch's ``require_forward_param_sync``: True after a synchronized training forward, False
    after one without gradients; set to False, the next forward leaves each rank's BatchNorm
    statistics its own, set to True it broadcasts rank 0's, as torch DDP does."""
    per_rank = results_of(launched, "forward param sync flag")
    for res in per_rank:
        assert res["fusedist"]["seen"] == res["torch"]["seen"] == [True, True, False]
        assert res["fusedist"]["will_sync"] == res["torch"]["will_sync"] is False
        for key in ("unsynced", "synced"):
            torch.testing.assert_close(res["fusedist"][key], res["torch"][key], rtol=1e-6, atol=1e-7, msg=key)
    assert not torch.equal(per_rank[0]["fusedist"]["unsynced"], per_rank[1]["fusedist"]["unsynced"])


def _fused_optim_beside_torch(rank, world):
    import fusedist

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(5, 4, generator=gen) for _ in range(3)]
    diffs = {}
    for case in ("sgd momentum, every parameter", "adam on the first layer, sgd steps the rest"):
        models, rest_optimizers = [], []
        for cls in (nn.parallel.DistributedDataParallel, fusedist.DistributedDataParallel):
            model = cls(copy.deepcopy(base))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # (torch's functional optimizers)
                if case.startswith("sgd"):
                    model._register_fused_optim(torch.optim.SGD, lr=0.1, momentum=0.9)
                else:
                    model._register_fused_optim(torch.optim.Adam, lr=0.01, optim_params=model.module[0].parameters())
                    rest_optimizers.append(torch.optim.SGD(model.module[2].parameters(), lr=0.1))
            models.append(model)
        for x in batches:
            for model in models:
                model(x).pow(2).sum().backward()
            for opt in rest_optimizers:
                opt.step()
                opt.zero_grad()
        diffs[case] = (max((a - b).abs().max().item() for a, b in zip(models[0].parameters(), models[1].parameters())),
                       max((a - b).abs().max().item() for a, b in zip(base.parameters(), models[1].parameters())))
    return diffs


def test_register_fused_optim_steps_in_backward_as_torch_ddp(launched):
    """torch's ``_register_fused_optim`` (an optimizer stepping each bucket's parameters as the
    bucket is averaged, in backward): the same parameters as torch DDP's after three backwards,
    with every parameter and with ``optim_params`` and an ordinary optimizer for the rest."""
    for diffs in results_of(launched, "fused optim"):
        for case, (to_torch, moved) in diffs.items():
            assert to_torch < 1e-6, (case, to_torch)
            assert moved > 1e-2, case  # (the parameters were stepped)


def _data_parallel_params_and_group_update(rank, world):
    import fusedist

    results = {}
    for name, cls in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
        cls._set_params_and_buffers_to_ignore_for_model(net, ["1.bias"])
        model = cls(net)
        synced = [p is q for p, q in zip(model._get_data_parallel_params(net), [net[0].weight, net[0].bias,
                                                                                net[1].weight])]
        named = [n for n, _ in cls._get_data_parallel_params(net, named_params=True)]
        try:
            model._update_process_group(dist.new_group(list(range(world))))
            update = "updated"
        except RuntimeError as e:
            update = str(e)
        results[name] = dict(synced=synced, named=named, update=update)
    return results


def test_data_parallel_params_as_torchs_and_a_process_group_update_refused_naming_the_way(launched):
    """torch's static ``_get_data_parallel_params`` (the parameters a DDP unit synchronizes,
    ignored ones left out) gives torch's; ``_update_process_group``, which torch's DDP takes, is
    refused on every rank saying to wrap the module again on the new group."""
    for rank, res in enumerate(results_of(launched, "data parallel params, group update")):
        assert res["fusedist"]["synced"] == res["torch"]["synced"] == [True] * 3
        assert res["fusedist"]["named"] == res["torch"]["named"]  # (torch's named form filters nothing)
        assert res["torch"]["update"] == "updated"
        assert res["fusedist"]["update"].startswith(
            f"fusedist.DistributedDataParallel (rank {rank}): _update_process_group is not supported"), res
        assert "DistributedDataParallel(model.module, process_group=new_group)" in res["fusedist"]["update"]


def _process_group_held_weakly(rank, world):
    import gc
    import weakref

    import fusedist

    results = {}
    torch.manual_seed(0)
    ours = fusedist.DistributedDataParallel(nn.Linear(4, 2))
    theirs = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    results["default group"] = (ours.process_group is theirs.process_group, ours.process_group is dist.group.WORLD)
    group = dist.new_group(list(range(world)))
    ours = fusedist.DistributedDataParallel(nn.Linear(4, 2), process_group=group)
    theirs = nn.parallel.DistributedDataParallel(nn.Linear(4, 2), process_group=group)
    results["subgroup"] = (ours.process_group is theirs.process_group, ours.process_group is group)
    replicated = fusedist.replicate(nn.Linear(4, 2), process_group=group)
    for model in (ours, replicated):
        model(torch.ones(3, 4)).sum().backward()
        model.check_consistency()  # (its step check waited for: an unwaited collective holds its group until it is)
    held = weakref.ref(group)
    del theirs, group  # (torch's DDP holds its group past the destroy)
    gc.collect()
    gc.disable()  # freed by the destroy itself, not by a later collection
    try:
        dist.destroy_process_group(held())
        results["freed at the destroy"] = held() is None
    finally:
        gc.enable()
    results["after the destroy"] = (repr(ours.process_group), repr(ours.join_process_group))
    kept = dist.new_group(list(range(world)))  # (destroyed, but still held by the program)
    on_kept = fusedist.DistributedDataParallel(nn.Linear(4, 2), process_group=kept)
    dist.destroy_process_group(kept)
    results["destroyed, held elsewhere"] = repr(on_kept.process_group)
    try:
        copy.deepcopy(ours)
        results["copy"] = "copied"
    except Exception as e:  # noqa: BLE001 - the test reads which
        results["copy"] = f"{type(e).__name__}: {e}"
    return results


def test_process_group_reads_as_torchs_and_the_model_lets_go_of_it_when_destroyed(launched):
    """``model.process_group`` is the group torch's DDP holds (the default group itself when none was
    given); a model (or a ``fusedist.replicate`` module) kept past ``destroy_process_group()`` does not keep
    the destroyed group alive (torch's does: into the interpreter's finalization, where freeing a gloo group
    can abort the process), and the model reads None from then on (also where the program still holds the
    group); a copy of it is refused, naming the destroyed group."""
    for rank, res in enumerate(results_of(launched, "process group held weakly")):
        assert res["default group"] == res["subgroup"] == (True, True), res
        assert res["freed at the destroy"] is True, res
        assert res["after the destroy"] == ("None", "None"), res
        assert res["destroyed, held elsewhere"] == "None", res
        assert res["copy"].startswith(f"RuntimeError: fusedist.DistributedDataParallel (rank {rank}): cannot copy "
                                      "this model: its process group was destroyed"), res


def _torch_ddp_over_a_destroyed_group_inside(rank, world):
    import fusedist

    group = dist.new_group(list(range(world)))
    inner = nn.parallel.DistributedDataParallel(nn.Linear(4, 2), process_group=group)
    dist.destroy_process_group(group)
    try:
        fusedist.DistributedDataParallel(nn.Sequential(inner))
        return "built"
    except Exception as e:  # noqa: BLE001 - the test reads which
        return f"{type(e).__name__}: {e}"


def test_torch_ddp_inside_over_a_destroyed_group_is_refused_naming_the_destroy(launched):
    """A torch DDP (inside the wrapped module) whose group was destroyed was refused as "over other ranks than
    this wrapper's"; the refusal names the destroy."""
    for rank, text in enumerate(results_of(launched, "torch ddp over a destroyed group inside")):
        assert text == (
            f"RuntimeError: fusedist.DistributedDataParallel (rank {rank}): the module holds torch's "
            "DistributedDataParallel at '0' whose process group was destroyed (torch.distributed."
            "destroy_process_group): its reducer would synchronize gradients over a group that no longer exists. "
            "Wrap its .module (the module inside torch's wrapper) instead"), text


def _state_dict_hooks_across_a_load(rank, world):
    import collections

    import fusedist

    runs = {}
    for name, wrap in (("fusedist", fusedist.DistributedDataParallel), ("torch", nn.parallel.DistributedDataParallel)):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(4, 2), nn.BatchNorm1d(2))
        bare = module.state_dict()
        model = wrap(module)
        counts = runs[name] = collections.Counter()
        module.register_state_dict_pre_hook(lambda *_args, counts=counts: counts.update(["module pre"]))
        module[1].register_state_dict_post_hook(lambda *_args, counts=counts: counts.update(["child post"]))
        model.register_state_dict_pre_hook(lambda *_args, counts=counts: counts.update(["wrapper pre"]))
        saved = model.state_dict()
        model.load_state_dict(saved)
        if name == "fusedist":
            model.load_state_dict(bare)  # (keys without "module.": torch's refuses them)
    return {name: dict(counts) for name, counts in runs.items()}


def test_state_dict_hooks_run_as_often_as_under_torch_ddp_across_a_load(launched):
    """A load read the wrapper's own keys by calling ``state_dict()``, running the user's state_dict hooks
    once more on every load; torch's DDP runs none on a load."""
    for res in results_of(launched, "state_dict hooks across a load"):
        assert res["fusedist"] == res["torch"] == {"module pre": 1, "child post": 1, "wrapper pre": 1}, res


def _copies_write_one_trace(rank, world, directory):
    import json
    import os
    import pickle

    import fusedist

    prefix = os.path.join(directory, "trace")
    os.environ["FUSEDIST_TIMELINE"] = prefix
    try:
        model = fusedist.DistributedDataParallel(nn.Linear(4, 2))
        copied = copy.deepcopy(model)
        loaded = pickle.loads(pickle.dumps(model))
    finally:
        del os.environ["FUSEDIST_TIMELINE"]
    backwards = {"original": (model, 2), "deep copy": (copied, 1), "loaded pickle": (loaded, 3)}
    for name, (each, count) in backwards.items():
        for _ in range(count):
            each(torch.ones(2, 4)).sum().backward()
    for name, (each, _) in backwards.items():
        each.timeline.flush()  # (the last flush is a copy's: it must not drop the original's events)
    with open(f"{prefix}.rank{rank}.json") as f:
        events = json.load(f)["traceEvents"]
    return sum(event["name"] == "backward begins" for event in events)


def test_copies_of_a_traced_wrapper_add_to_the_same_trace_file(launched):
    """A deep copy or a loaded pickle of a wrapper built under ``FUSEDIST_TIMELINE`` builds its timeline again:
    it adds its events to the original's trace file, none of the original's lost to the copy's flush."""
    for rank, backwards in enumerate(results_of(launched, "copies write one trace")):
        assert backwards == 2 + 1 + 3, (rank, backwards)


def _halving_hook(state, bucket):
    """Averages the bucket as torch's allreduce_hook does (annotations set per case below)."""
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _annotated(annotations: dict):
    # (as written here, strings: this module imports ``annotations`` from ``__future__``)
    def hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return _halving_hook(state, bucket)

    if annotations is not None:
        hook.__annotations__ = annotations
    return hook


def _hook_annotations(rank, world):
    import fusedist

    future = torch.futures.Future[torch.Tensor]
    cases = {"bucket: int": {"bucket": int, "return": future}, "-> int": {"bucket": dist.GradBucket, "return": int},
             "as torch's hooks": {"bucket": dist.GradBucket, "return": future}, "as strings": None}
    results = {}
    for name, cls in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        for case, given in cases.items():
            torch.manual_seed(0)
            model = cls(nn.Linear(3, 2))
            try:
                model.register_comm_hook(None, _annotated(given))
            except ValueError as e:
                results[name, case] = str(e)
                continue
            model(torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))).sum().backward()
            results[name, case] = [p.grad.clone() for p in model.parameters()]
    return results


def test_hook_annotations_refused_as_torch_refuses_them_and_strings_resolved(launched):
    """A hook annotated with another bucket or return type is refused at registration with torch's
    words (before: taken); annotations written as strings are resolved first, where torch refuses
    a correct hook whose module uses ``from __future__ import annotations``."""
    for res in results_of(launched, "hook annotations"):
        for case, says in (("bucket: int", "bucket annotation should be dist.GradBucket."),
                           ("-> int", "return annotation should be torch.futures.Future[torch.Tensor].")):
            assert res["torch", case] == f"Communication hook: {says}"
            assert res["fusedist", case].startswith("fusedist.DistributedDataParallel.register_comm_hook: hook ")
            assert res["fusedist", case].endswith(says)
        assert res["torch", "as strings"] == "Communication hook: bucket annotation should be dist.GradBucket."
        for case in ("as torch's hooks", "as strings"):
            for ours, theirs in zip(res["fusedist", case], res["torch", "as torch's hooks"]):
                torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7, msg=case)


class _CountingNet(nn.Module):
    """A BatchNorm and a counter buffer: what a buffer hook sums or averages instead of rank 0's copy."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen += x.shape[0]
        return self.norm(self.lin(x))


def _all_reduce_buffers(model, named_buffers, return_futures):
    futures = [dist.all_reduce(b, group=model.process_group, async_op=True).get_future()
               for b in named_buffers.values()]
    if return_futures:
        return futures
    torch.futures.collect_all(futures).wait()


def _broadcast_through_default(model, named_buffers):
    model._default_broadcast_coalesced(list(named_buffers.values()))


def _buffer_hooks_beside_torch(rank, world):
    import functools

    import fusedist
    from torch.nn.parallel.distributed import _BufferCommHookLocation as Location

    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(6 + rank, 4, generator=gen) * (rank + 1) for _ in range(3)]
    cases = {f"all-reduce {where.name} futures={futures}": (
        functools.partial(_all_reduce_buffers, return_futures=futures), where)
        for where in (Location.PRE_FORWARD, Location.POST_FORWARD) for futures in (False, True)}
    cases["default broadcast"] = (_broadcast_through_default, Location.POST_FORWARD)
    cases["no hook"] = (None, None)
    results = {}
    for case, (hook, where) in cases.items():
        for name, cls in (("torch", nn.parallel.DistributedDataParallel),
                          ("fusedist", fusedist.DistributedDataParallel)):
            model = cls(_CountingNet())
            if hook is not None:
                model._register_buffer_comm_hook(model, hook, where)
            seen = []
            for x in batches[:2]:
                out = model(x)
                seen.append([b.clone() for b in model.module.buffers()])
                out.square().sum().backward()
            model.module.seen += rank  # ranks differ; torch's way to synchronize outside a forward
            model._sync_buffers()
            seen.append([b.clone() for b in model.module.buffers()])
            seen.append(sorted(model.named_module_buffers))
            seen.append([p.grad.clone() for p in model.parameters()])
            results[case, name] = seen
    model = fusedist.DistributedDataParallel(_CountingNet())
    try:
        model._register_buffer_comm_hook(model, "not a hook")
    except TypeError as exc:
        results["not callable"] = str(exc)
    model._register_buffer_comm_hook(model, _broadcast_through_default)
    try:
        with model.join():
            model(batches[0])
    except RuntimeError as exc:
        results["in join"] = str(exc)
    return results


def test_buffer_comm_hooks_and_sync_buffers_as_torch_ddp(launched):
    """``_register_buffer_comm_hook``: an all-reduce of the buffers before or after the forward
    (waited in the hook or returned as futures), a broadcast through ``_default_broadcast_coalesced``,
    and ``_sync_buffers()`` outside a forward leave the buffers and gradients torch DDP's leave
    (before: AttributeError). Refused by name: a hook that is not callable, a hook under join()."""
    for res in results_of(launched, "buffer hooks"):
        cases = {key[0] for key in res if isinstance(key, tuple)}
        assert len(cases) == 6, cases
        for case in cases:
            # (torch waits for a hook's returned all-reduces at the end of the backward: the buffers
            # read after its forward are still being written, and a PRE_FORWARD hook's race with the
            # forward, as its docs warn; fusedist waits for a PRE_FORWARD hook's as the hook returns, and
            # for a POST_FORWARD hook's at the end of the backward, as torch: those reads are not compared)
            ref_case = case.replace("futures=True", "futures=False")
            theirs, ours = res[ref_case, "torch"], res[case, "fusedist"]
            assert ours[3] == theirs[3] == ["norm.num_batches_tracked", "norm.running_mean", "norm.running_var",
                                            "seen"], case
            in_flight_after_forward = case == "all-reduce POST_FORWARD futures=True"
            for step, (mine, ref) in enumerate(zip(ours[:3] + ours[4:], theirs[:3] + theirs[4:])):
                if in_flight_after_forward and step < 2:
                    continue
                for a, b in zip(mine, ref):
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{case}, step {step}")
        assert "the hook must be callable, got str" in res["not callable"]
        assert "does not run inside join()" in res["in join"] and "_register_buffer_comm_hook" in res["in join"]


def _sink_clone_and_logger(rank, world):
    import fusedist

    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
    results = {}
    for name, cls in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        grads = []
        for clone in (True, False):
            torch.manual_seed(0)
            model = cls(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)), find_unused_parameters=True)
            model._set_ddp_sink_clone(clone)
            out = model(x)
            try:
                out.mul_(2)  # in place on the output: torch's sink clones it unless told not to
            except RuntimeError as exc:  # (torch without the clone: its sink's output is a view)
                grads.append(str(exc))
                continue
            out.sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        logger = model.logger
        before, whole = logger._get_ddp_logging_data(), model._get_ddp_logging_data()
        logger.set_error_and_log("diverged at step 3")
        logger._set_comm_hook_name("my_hook")
        logger._set_uneven_input_join()
        logger.set_runtime_stats_and_log()
        after = model._get_ddp_logging_data()
        results[name] = dict(
            grads=grads, clone=model._ddp_sink_clone,
            maps=({**before.strs_map, **before.ints_map} == whole, type(before.ints_map).__name__,
                  before.strs_map.get("module_name"), before.ints_map.get("world_size")),
            recorded={k: after.get(k) for k in ("has_error", "error", "comm_hook", "join_uneven_inputs")})
        if name == "fusedist":
            try:
                logger.set_construction_data_and_log("Linear", [], -1, True, False, False)
            except RuntimeError as exc:
                results["construction data"] = str(exc)
    return results


def test_sink_clone_setting_and_the_logger_as_torch_ddps(launched):
    """``_set_ddp_sink_clone`` is taken (fusedist never copies the outputs: an in-place change of
    the output trains as torch's with its clone, also where torch's without it refuses the change)
    and ``model.logger`` splits the logging data into ``strs_map``/``ints_map`` and records an
    error, a hook's name and a join as torch's logger does (before: AttributeError for both);
    ``set_construction_data_and_log`` is refused by name."""
    for res in results_of(launched, "sink clone, logger"):
        theirs, ours = res["torch"], res["fusedist"]
        assert "is a view and is being modified inplace" in theirs["grads"][1]
        for mine in ours["grads"]:  # with or without the setting, as torch's with its clone
            for a, b in zip(mine, theirs["grads"][0]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert ours["clone"] is theirs["clone"] is False
        assert ours["maps"] == theirs["maps"] == (True, "dict", "Sequential", 2)
        assert ours["recorded"] == theirs["recorded"] == dict(
            has_error=1, error="diverged at step 3", comm_hook="my_hook", join_uneven_inputs=1)
        assert "set_construction_data_and_log is not supported" in res["construction data"]


def _gradient_handles(model, batches) -> dict:
    """What code holding ``p.grad`` tensors sees: one kept across ``zero_grad()`` (set to None),
    one assigned by hand before a backward (and one before a ``no_sync`` accumulation), ``_base``,
    ``detach_()`` and the optimizer's ``zero_grad(set_to_none=False)`` on a gradient."""
    p, q = model.module[0].weight, model.module[1].weight
    seen, values = {}, []
    for _ in range(3):  # (past torch's bucket rebuild, which gives new storage once)
        model.zero_grad()
        model(batches[0]).sum().backward()
    storages = {g.grad.untyped_storage().data_ptr() for g in model.parameters()}
    kept, before = p.grad, p.grad.clone()
    model.zero_grad()
    model(batches[1]).sum().backward()
    seen["kept unchanged"] = torch.equal(kept, before)
    storages |= {g.grad.untyped_storage().data_ptr() for g in model.parameters() if g is not p}
    seen["gradient storages"] = len(storages)
    seen["kept is the new gradient"] = p.grad is kept
    values += [kept, p.grad.clone()]
    model.zero_grad()
    mine = torch.zeros_like(p)
    p.grad = mine
    model(batches[2]).sum().backward()
    seen["assigned is the gradient"] = p.grad is mine
    values.append(mine.clone())
    seen["_base"] = q.grad._base is None
    try:
        q.grad.detach_()
        seen["detach_"] = "ok"
    except RuntimeError as exc:
        seen["detach_"] = "gradient_as_bucket_view" in str(exc)
    model.zero_grad()
    accumulated = torch.zeros_like(p)
    p.grad = accumulated
    with model.no_sync():
        model(batches[0]).sum().backward()
    model(batches[1]).sum().backward()
    seen["assigned accumulates"] = p.grad is accumulated
    values.append(accumulated.clone())
    torch.optim.SGD(model.parameters(), lr=0.1).zero_grad(set_to_none=False)
    seen["zeroed in place"] = p.grad is accumulated and not accumulated.any().item()
    model(batches[2]).sum().backward()
    seen["grads"] = values + [g.grad.clone() for g in model.parameters()]
    return seen


class _BranchOnRankZero(nn.Module):
    """``c`` is used on rank 0 only: rank 1's gradient of it is the average it did not add to."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 3), nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x, use_c: bool):
        h = self.a(x)
        return self.b(h).sum() + (self.c(h).sum() if use_c else 0)


def _held_gradients_of_unused_parameters(model, batches, rank) -> dict:
    """With ``find_unused_parameters=True``: a kept gradient of a parameter this rank did not use
    (its slot written by the bucket's collective alone), and one assigned by hand to it."""
    c = model.module.c.weight
    for _ in range(3):
        model.zero_grad()
        model(batches[0], rank == 0).backward()
    kept, before = c.grad, c.grad.clone()
    model.zero_grad()
    model(batches[1], rank == 0).backward()
    seen = {"kept unchanged": torch.equal(kept, before)}
    model.zero_grad()
    mine = torch.ones_like(c)
    c.grad = mine
    model(batches[2], rank == 0).backward()
    seen["assigned is the gradient"] = c.grad is mine
    seen["grads"] = [kept, mine.clone()] + [g.grad.clone() for g in model.parameters()]
    return seen


def _gradient_views_beside_torch(rank, world):
    import fusedist

    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(3, 4, generator=gen) for _ in range(3)]
    results = {}
    for name, cls, options in (("torch", nn.parallel.DistributedDataParallel, {}),
                               ("torch", nn.parallel.DistributedDataParallel, dict(gradient_as_bucket_view=True)),
                               ("fusedist", fusedist.DistributedDataParallel, {}),
                               ("fusedist", fusedist.DistributedDataParallel, dict(gradient_as_bucket_view=False))):
        torch.manual_seed(0)
        model = cls(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)), **options)
        results[name, model.gradient_as_bucket_view] = _gradient_handles(model, batches)
        torch.manual_seed(0)
        model = cls(_BranchOnRankZero(), find_unused_parameters=True, **options)
        results[name, model.gradient_as_bucket_view, "unused"] = _held_gradients_of_unused_parameters(
            model, batches, rank)
    return results


def test_gradient_tensors_a_user_holds_behave_as_torchs_default_ones(launched):
    """fusedist's default gradient views (``gradient_as_bucket_view=True``) save torch's copy, yet a
    gradient tensor the user holds behaves as under torch's default (``False``): one kept across
    ``zero_grad()`` keeps its values, one assigned by hand stays ``p.grad`` and receives the
    average, gradients have no ``_base`` and take ``detach_()`` (torch's ``True`` differs on each).
    ``gradient_as_bucket_view=False`` gives torch's default gradient tensors too."""
    for res in results_of(launched, "gradient views"):
        theirs = res["torch", False]
        for key in ((view,) + case for view in (True, False) for case in ((), ("unused",))):
            ours, ref = dict(res[("fusedist",) + key]), dict(res[("torch", False) + key[1:]])
            if not key[1:]:  # the views' memory saving kept: the gradients are the bucket's slots
                storages, theirs_apart = ours.pop("gradient storages"), ref.pop("gradient storages")
                assert (storages == 1) is key[0] and theirs_apart > 1, (key, storages, theirs_apart)
            for a, b in zip(ours.pop("grads"), ref["grads"]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            assert ours == {k: v for k, v in ref.items() if k != "grads"}, (key, ours, ref)
        assert res["torch", False, "unused"] == dict(res["torch", False, "unused"], **{
            "kept unchanged": True, "assigned is the gradient": True})
        assert theirs == dict(theirs, **{"kept unchanged": True, "assigned is the gradient": True, "_base": True,
                                         "detach_": "ok", "assigned accumulates": True})
        views = res["torch", True]  # what torch's gradient views would have given
        assert (views["kept unchanged"], views["assigned is the gradient"], views["_base"]) == (False, False, False)


def test_gradients_moved_kept_by_a_hook_or_cached_across_the_rebuild_as_torch_ddps(launched):
    """``p.grad.data = t`` before an accumulating backward, or before ``zero_grad()``: the next
    backward's average as torch DDP's (the bucket is cut a new slot; the moved tensor keeps ``t``'s
    memory). A communication hook's ``bucket.gradients()`` kept across steps are views of the
    bucket, as torch's (not ``p.grad`` tensors moved onto copies each step). Gradient tensors cached
    after a first ``no_sync`` backward stay ``p.grad`` across the buckets' rebuild."""
    check_moved_gradients(results_of(launched, "moved gradients"))


# ---------------------------------------------------------------- the shared launch
@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    # (the refused construction last: every rank raised at the same check, but nothing needs to follow it)
    return launch_for_selected(request, {
        "test_buffer_and_parameter_sync_options_match_torch": {"buffers": (_buffer_worker, ())},
        "test_bucket_cap_mb_list_trains_as_torch_ddp": {"caps": (_caps_worker, ())},
        "test_bucket_cap_mb_makes_torch_ddps_buckets": {
            f"bucket_cap_mb={cap}": (_bucket_cap_worker, (cap,)) for cap in (None, 2, 0)},
        "test_buckets_appended_for_unfrozen_parameters_follow_bucket_cap_mb_list": {
            "unfrozen caps": (_unfreeze_caps_worker, ())},
        "test_two_forwards_before_one_backward_match_torch": {"two forwards": (_two_forwards_worker, ())},
        "test_cpu_placement_attributes_and_helpers_match_torch": {"placement": (_placement_attrs_and_helpers, ())},
        "test_parameters_and_buffers_to_ignore_stay_rank_local_as_in_torch": {
            "ignored state": (_ignored_state_trains_as_torch, ())},
        "test_zero_refuses_rank_local_parameters_and_trains_the_rest_as_torch": {
            "zero with rank-local parameters": (_zero_with_rank_local_parameters, ())},
        "test_constructor_settings_read_back_as_torch_ddps_attributes": {
            "settings as attributes": (_torch_settings_as_attributes, ())},
        "test_require_forward_param_sync_reads_and_sets_the_next_forwards_buffer_broadcast_as_torch": {
            "forward param sync flag": (_forward_param_sync_flag, ())},
        "test_register_fused_optim_steps_in_backward_as_torch_ddp": {"fused optim": (_fused_optim_beside_torch, ())},
        "test_data_parallel_params_as_torchs_and_a_process_group_update_refused_naming_the_way": {
            "data parallel params, group update": (_data_parallel_params_and_group_update, ())},
        "test_process_group_reads_as_torchs_and_the_model_lets_go_of_it_when_destroyed": {
            "process group held weakly": (_process_group_held_weakly, ())},
        "test_hook_annotations_refused_as_torch_refuses_them_and_strings_resolved": {
            "hook annotations": (_hook_annotations, ())},
        "test_buffer_comm_hooks_and_sync_buffers_as_torch_ddp": {"buffer hooks": (_buffer_hooks_beside_torch, ())},
        "test_sink_clone_setting_and_the_logger_as_torch_ddps": {"sink clone, logger": (_sink_clone_and_logger, ())},
        "test_gradient_tensors_a_user_holds_behave_as_torchs_default_ones": {
            "gradient views": (_gradient_views_beside_torch, ())},
        "test_gradients_moved_kept_by_a_hook_or_cached_across_the_rebuild_as_torch_ddps": {
            "moved gradients": (moved_gradients_beside_torch, ())},
        "test_state_dict_hooks_run_as_often_as_under_torch_ddp_across_a_load": {
            "state_dict hooks across a load": (_state_dict_hooks_across_a_load, ())},
        "test_torch_ddp_inside_over_a_destroyed_group_is_refused_naming_the_destroy": {
            "torch ddp over a destroyed group inside": (_torch_ddp_over_a_destroyed_group_inside, ())},
        "test_copies_of_a_traced_wrapper_add_to_the_same_trace_file": {
            "copies write one trace": (_copies_write_one_trace, (str(tmp_path_factory.mktemp("timeline")),))},
        "test_an_ignore_list_that_differs_between_ranks_is_refused_on_every_rank": {
            "ignore lists differ": (_ignore_lists_differ, ())},
    }, 2, timeout=480)
