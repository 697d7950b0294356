"""ZeRO stage 2 gradient memory with a narrower reduce dtype, sparse gradients under ZeRO, and
the optimizer state of parameters with no elements through a ZeRO checkpoint.

* With ``reduce_dtype=torch.bfloat16`` the reduce-scatter reads the bucket's bf16 copy only, so
  the FP32 bucket is released at launch (Note [a converted bucket released at launch] in
  fusedist/zero/grad_sync.py): over a reduce-scatter that lands late, the gradient peak is one
  FP32 bucket filling and the bf16 copies on the wire (as many as the bound on buckets in
  flight), where each bucket in flight held its FP32 gradients too; the numbers stay those of
  torch's DDP with a bf16 compression hook (cast, divide, sum in bf16, back to fp32).
* A sparse gradient (``nn.Embedding(sparse=True)``) is refused naming the parameter, not
  reported as a parameter frozen when the optimizer was built.
* A ZeRO checkpoint loaded into DDP with a full torch optimizer, or into ``fully_shard``, keeps
  the state (step counts, empty moments) of parameters with no elements, as torch's optimizer
  state dict has it.
"""

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fusedist.testing import run_distributed

STEPS = 3
CAP = dict(bucket_cap_mb=0.001, first_bucket_cap_mb=0.001)  # one bucket per Linear(16, 16)


def _bf16_hook(state, bucket):
    """torch's ``bf16_compress_hook`` (which refuses gloo): cast, divide, all-reduce, copy back."""
    buf = bucket.buffer()
    wire = buf.to(torch.bfloat16).div_(dist.get_world_size())
    fut = dist.all_reduce(wire, async_op=True).get_future()

    def done(f):
        buf.copy_(f.value()[0])
        return buf

    return fut.then(done)


def _stack():
    torch.manual_seed(3)
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(16, 16), nn.Tanh())])


def _train(rank, model, opt, no_sync, stats=None):
    for step in range(STEPS):
        g = torch.Generator().manual_seed(10 * step + rank)
        if step == 1:  # a no_sync micro-batch first: accumulated into full buckets
            with no_sync():
                model(torch.randn(4, 16, generator=g)).pow(2).mean().backward()
        model(torch.randn(4, 16, generator=g)).pow(2).mean().backward()
        if stats is not None:
            stats.append(dict(model.reducer.last_stats))
        opt.step()
        opt.zero_grad()


def _bf16_worker(rank, world):
    import fusedist
    from test_zero2_buckets_in_flight_bound import _SlowReduceScatter

    base = _stack()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.001)
    ref.register_comm_hook(None, _bf16_hook)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    _train(rank, ref, ref_opt, ref.no_sync)
    out = {"torch": [p.detach().clone() for p in ref.parameters()]}
    for views in (True, False):
        for bound in (None, 1, 2):
            ddp = fusedist.DistributedDataParallel(copy.deepcopy(base), reduce_dtype=torch.bfloat16,
                                                   gradient_as_bucket_view=views, **CAP)
            opt = fusedist.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-2, stage=2,
                                                   max_buckets_in_flight=bound)
            ddp.reducer.comm = _SlowReduceScatter(ddp.reducer.comm)  # every bucket lands late
            stats = []
            _train(rank, ddp, opt, ddp.no_sync, stats)
            opt.wait_for_params()
            out[(views, bound)] = {"params": [p.detach().clone() for p in ddp.parameters()], "stats": stats,
                                   "largest": max(b.nbytes for b in ddp.reducer.layout.buckets),
                                   "stats_buckets": [b.nbytes for b in ddp.reducer.layout.buckets]}
    return out


def test_bf16_reduce_releases_each_fp32_bucket_at_launch_with_torch_numerics():
    for out in run_distributed(_bf16_worker, 2, timeout=120):
        for key, run in out.items():
            if key == "torch":
                continue
            for step, st in enumerate(run["stats"]):
                if step == 1:  # no_sync filled every bucket before this backward (+ the first copy made)
                    assert st["peak_grad_bytes"] == st["grad_bytes"] + run["largest"] // 2, (key, st)
                else:  # one fp32 bucket filling, and the bf16 copies on the wire (half its size)
                    in_flight = key[1] or len(run["stats_buckets"])
                    assert st["peak_grad_bytes"] == run["largest"] + in_flight * run["largest"] // 2, (key, step, st)
            for got, want in zip(run["params"], out["torch"]):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


class _WithSparse(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.emb = nn.Embedding(10, 4, sparse=True)

    def forward(self, i):
        return self.lin(self.emb(i))


def _sparse_worker(rank, world):
    import fusedist

    messages = []
    for stage in (1, 2):
        torch.manual_seed(0)
        ddp = fusedist.DistributedDataParallel(_WithSparse())
        opt = fusedist.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.1, stage=stage)
        ddp(torch.tensor([1, 2 + rank])).sum().backward()
        try:
            opt.step()
        except RuntimeError as exc:
            messages.append(str(exc))
    plain = nn.Embedding(10, 4, sparse=True)  # stage 1 without DDP: the gradient is in p.grad
    opt = fusedist.ZeroRedundancyOptimizer(plain.parameters(), torch.optim.SGD, lr=0.1)
    plain(torch.tensor([1, 2])).sum().backward()
    try:
        opt.step()
    except RuntimeError as exc:
        messages.append(str(exc))
    return messages


def test_a_sparse_gradient_is_refused_naming_the_parameter():
    for messages in run_distributed(_sparse_worker, 2, timeout=60):
        assert len(messages) == 3, messages
        for text in messages:
            assert "has a sparse gradient" in text and "dense gradients only" in text, text
            assert "requires_grad=False" not in text, text
        assert all("'emb.weight'" in text for text in messages[:2]), messages


def _empty_model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 0), nn.Linear(0, 3))


def _empty_worker(rank, world, root):
    import fusedist

    ddp = fusedist.DistributedDataParallel(_empty_model())
    opt = fusedist.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-2)
    ref = _empty_model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        for model, o in ((ddp, opt), (ref, ref_opt)):
            model(x).sum().backward()
            o.step()
            o.zero_grad()
    fusedist.checkpoint.save(os.path.join(root, "ckpt"), ddp, opt)
    target = fusedist.DistributedDataParallel(_empty_model())
    target_opt = torch.optim.Adam(target.parameters(), lr=1e-2)
    fusedist.checkpoint.load(os.path.join(root, "ckpt"), target, target_opt)

    sharded = _empty_model()
    fusedist.fully_shard(sharded)
    sharded_opt = torch.optim.Adam(sharded.parameters(), lr=1e-2)
    fusedist.checkpoint.load(os.path.join(root, "ckpt"), sharded, sharded_opt)

    def steps(o):
        return {i: float(s["step"]) for i, s in o.state_dict()["state"].items()}

    def summary(o):
        return {i: (float(s["step"]), tuple(s["exp_avg"].shape)) for i, s in o.state_dict()["state"].items()}

    return summary(target_opt), summary(ref_opt), steps(sharded_opt), steps(ref_opt)


def test_zero_checkpoint_into_a_full_optimizer_keeps_the_state_of_empty_parameters(tmp_path):
    for got, want, sharded, want_steps in run_distributed(_empty_worker, 2, str(tmp_path), timeout=90):
        assert len(want) == 6 and got == want, (got, want)  # DDP + torch's Adam
        assert sharded == want_steps, (sharded, want_steps)  # fully_shard + torch's Adam


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
