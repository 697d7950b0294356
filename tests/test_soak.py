"""Soak (short): DDP + FusedAdamW + GradScaler for a few hundred steps, memory must stay flat.

The full 2,000-step run is ``benchmarks/soak_ddp.py`` (result in benchmarks/results/). This
test runs the same worker for fewer steps, on the optimizers' pure-PyTorch path
(``FUSEDIST_KERNEL_BACKEND=torch``: the Triton interpreter would make it take minutes), and
prints the measurements.

Bounds: live tensors after warm-up must not change at all (a leak of one tensor per step
would add ~160). RSS may wobble by a few MiB as the allocator's arenas settle; 16 MiB over
160 steps would still be a leak of ~100 KiB per step, about the size of this model's
gradients, so anything that leaks per-step tensors fails one bound or the other.
"""

import os
import sys

import pytest

from fusedist.testing import run_distributed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from soak_ddp import growth, soak_worker  # noqa: E402


@pytest.mark.slow
def test_soak_memory_is_flat():
    results = run_distributed(soak_worker, 2, 200, 40, 5, 32, 1, timeout=300,
                              env={"FUSEDIST_KERNEL_BACKEND": "torch"})
    for rank, r in enumerate(results):
        d_rss, d_tensors = growth(r["trace"])
        print(f"rank {rank}: {len(r['trace'])} samples after warm-up, RSS {r['trace'][0][1]:.1f} -> "
              f"{r['trace'][-1][1]:.1f} MiB ({d_rss:+.2f}), live tensors {r['trace'][0][2]} -> "
              f"{r['trace'][-1][2]} ({d_tensors:+d}), {r['seconds']:.1f} s, loss {r['loss_first']:.3f} -> "
              f"{r['loss_last']:.3f}")
        assert d_tensors == 0, r["trace"]
        assert d_rss < 16.0, r["trace"]
        assert r["loss_last"] < r["loss_first"]  # it trained
