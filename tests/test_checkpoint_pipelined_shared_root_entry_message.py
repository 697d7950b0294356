"""Pipeline stages and pipelined checkpoints (fusedist/pipelining/__init__.py, fusedist/checkpoint/pipeline.py),
checked against what torch's schedules and the documentation give.

- A pipelined save of stages that each keep one entry of the whole model's root (a persistent
  buffer, as RoPE frequencies are in some models; every stage cut from the whole model keeps
  it) is refused before anything is written, and the refusal names that cause and its fix
  (``persistent=False``); it named only stages cut as slices, which was not the cause.
"""

from __future__ import annotations

import os

import torch

import models
from fusedist.testing import run_distributed

WIDTH, LAYERS = 8, 4


class _WithRootBuffer(models.WholeModelLayers):
    """Layers ``ids`` under the whole model's names, and a persistent buffer of the whole
    model's root that each stage keeps."""

    def __init__(self, ids, seed: int):
        super().__init__(ids, seed, width=WIDTH, count=LAYERS)
        self.register_buffer("rope", torch.randn(WIDTH), persistent=True)


def _root_buffer_worker(rank, world_size, seed, root):
    """pp 2 x dp 1: each stage saves two layers and the root's buffer; what the save raises and
    what it left in ``root``."""
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    pp = mesh["pp"].get_local_rank()
    module = _WithRootBuffer(range(2 * pp, 2 * pp + 2), seed)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    module(torch.randn(4, WIDTH)).square().mean().backward()
    opt.step()
    try:
        fusedist.checkpoint.save(root, module, opt, process_group=mesh["dp"], pipeline=True)
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        raised = f"{type(e).__name__}: {e}"
    else:
        raised = "no error"
    torch.distributed.barrier()  # every rank done with the save (and its clean-up) before listing
    return raised, sorted(os.listdir(root)) if os.path.isdir(root) else []


def test_a_root_buffer_every_stage_keeps_is_refused_naming_that_cause(tmp_path):
    seed = int(torch.randint(0, 10_000, ()).item())
    root = str(tmp_path / "ckpt")
    for rank, (raised, written) in enumerate(run_distributed(_root_buffer_worker, 2, seed, root, timeout=120)):
        assert "'rope' is the name of an entry of two pipeline stages" in raised, (rank, raised)
        assert "persistent buffer" in raised and "persistent=False" in raised, (rank, raised)
        assert "Nothing was written" in raised and not [f for f in written if f.endswith(".pt")], (rank, written)
