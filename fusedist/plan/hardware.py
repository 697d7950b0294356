"""GPU presets: memory, peak dense tensor-core throughput, link bandwidths.

Figures are the vendors' datasheet values for the SXM parts, as published by NVIDIA:

* "NVIDIA H100 Tensor Core GPU" datasheet (H100 SXM): 80 GB HBM3; BF16/FP16 Tensor Core
  1,979 TFLOPS *with sparsity*, so 989 dense; TF32 989 with sparsity, so 494 dense; NVLink
  900 GB/s; PCIe Gen5 128 GB/s.
* "NVIDIA H200 Tensor Core GPU" datasheet (H200 SXM): 141 GB HBM3e; BF16/FP16 1,979 TFLOPS
  with sparsity (989 dense); TF32 989 with sparsity (494 dense); NVLink 900 GB/s; PCIe Gen5
  128 GB/s.
* "NVIDIA A100 Tensor Core GPU" datasheet (A100 80GB SXM): 80 GB HBM2e; BF16/FP16 312 TFLOPS
  dense (624 with sparsity); TF32 156 dense; NVLink 600 GB/s; PCIe Gen4 64 GB/s.
* NVIDIA DGX B200 datasheet and HGX B200 specifications (B200 SXM, figures for 8 GPUs):
  1,440 GB HBM3e (180 GB a GPU) at 64 TB/s (8 TB/s a GPU); FP16/BF16 Tensor Core 36 PFLOPS
  and TF32 18 PFLOPS, both *with sparsity*, so 2,250 and 1,125 TFLOPS dense a GPU;
  fifth-generation NVLink 1.8 TB/s a GPU (both directions); PCIe Gen5; 8x ConnectX-7 at
  400 Gb/s.
* Inter-node: one InfiniBand adapter per GPU as in NVIDIA's DGX systems -- DGX H100 / DGX
  H200 user guides: 8x ConnectX-7 at 400 Gb/s (NDR) = 50 GB/s per GPU; DGX A100 user guide:
  8x ConnectX-6 at 200 Gb/s (HDR) = 25 GB/s per GPU; DGX B200 as DGX H100.
* HBM bandwidth, shown with the plan and not used by its step time (compute- and
  link-bound): H100 SXM 3.35 TB/s, H200 4.8 TB/s, A100 80GB SXM 2,039 GB/s (the datasheets).
* Host memory per node, which the offload strategies fill (and must fit): the DGX datasheets'
  system memory for 8 GPUs -- DGX H100 2 TB, DGX H200 2 TB, DGX A100 640GB 2 TB, DGX B200
  2 TB (configurable to 4 TB). The node's ranks share it; the operating system, data loaders
  and the CUDA context's pinned buffers need some of it too, which the plan does not count.
* Host memory bandwidth per node, which bounds the offloaded optimizer update (a CPU Adam
  moves ~30 bytes a parameter and little arithmetic): the peak of the two CPUs' memory
  channels as the 2 TB is populated, 32 DIMMs of 64 GB, two per channel. DGX H100 / H200
  (2x Xeon Platinum 8480C) and DGX B200 (2x Xeon Platinum 8570): 8 DDR5 channels a socket,
  which run at 4400 MT/s with two DIMMs per channel (4800 with one), 2 x 8 x 4400e6 x 8 B =
  563 GB/s. DGX A100 (2x EPYC 7742): 8 DDR4-3200 channels a socket, 410 GB/s. A streaming
  kernel reaches 70-80% of such peaks (``--host-memory-gbps`` can say so).

Conventions: memory in decimal GB (10^9 bytes; the driver reports a little more usable memory,
so this errs on the safe side). Bandwidths in GB/s *per GPU and direction*: the datasheets'
NVLink and PCIe figures add both directions, so the presets carry half of them (900, 450,
300, 64, 32); InfiniBand is quoted per direction (400 Gb/s = 50 GB/s). These are peaks: NCCL's
measured bus bandwidth is typically 70-90% of them, which ``--intra-node-gbps`` /
``--inter-node-gbps`` can express.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .errors import PlanError

GB = 10**9


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    memory_gb: float           # decimal GB per GPU
    peak_tflops_16bit: float   # dense BF16/FP16 tensor-core TFLOPS
    peak_tflops_tf32: float    # dense TF32 tensor-core TFLOPS (used for --precision fp32)
    intra_node_gbps: float     # GB/s per GPU per direction (NVLink)
    inter_node_gbps: float     # GB/s per GPU per direction (InfiniBand)
    pcie_gbps: float           # GB/s per direction, host <-> GPU (offload)
    hbm_gbps: float            # GB/s, device memory (shown with the plan)
    host_memory_gb: float = 2000  # decimal GB of host memory per node, shared by its GPUs (offload)
    host_memory_gbps: float = 563  # GB/s of host memory per node: the offloaded optimizer update

    def peak_flops(self, precision: str) -> float:
        tflops = self.peak_tflops_tf32 if precision == "fp32" else self.peak_tflops_16bit
        return tflops * 1e12


PRESETS = {
    "h100": Hardware("h100", 80, 989, 494, 450, 50, 64, 3350, 2000, 563),
    "h200": Hardware("h200", 141, 989, 494, 450, 50, 64, 4800, 2000, 563),
    "a100": Hardware("a100", 80, 312, 156, 300, 25, 32, 2039, 2000, 410),
    "b200": Hardware("b200", 180, 2250, 1125, 900, 50, 64, 8000, 2000, 563),
}
CHOICES = (*PRESETS, "custom")


def resolve(gpu: str, memory_gb: Optional[float] = None, peak_tflops: Optional[float] = None,
            intra_node_gbps: Optional[float] = None, inter_node_gbps: Optional[float] = None,
            pcie_gbps: Optional[float] = None, host_memory_gb: Optional[float] = None,
            host_memory_gbps: Optional[float] = None) -> Hardware:
    """The preset named ``gpu`` with any given figure overriding it; ``custom`` needs memory
    and peak (bandwidths default to the H100's)."""
    for flag, value in (("--gpu-memory-gb", memory_gb), ("--peak-tflops", peak_tflops),
                        ("--intra-node-gbps", intra_node_gbps), ("--inter-node-gbps", inter_node_gbps),
                        ("--pcie-gbps", pcie_gbps), ("--host-memory-gb", host_memory_gb),
                        ("--host-memory-gbps", host_memory_gbps)):
        if value is not None and not value > 0:
            raise PlanError(flag, f"must be positive, got {value:g}")
    key = (gpu or "").lower()
    if key == "custom":
        if memory_gb is None or peak_tflops is None:
            raise PlanError("--gpu", "custom needs --gpu-memory-gb and --peak-tflops")
        base = dataclasses.replace(PRESETS["h100"], name="custom")
    elif key in PRESETS:
        base = PRESETS[key]
    else:
        raise PlanError("--gpu", f"unknown GPU {gpu!r} (choose {', '.join(CHOICES)})")
    changes = {}
    if memory_gb is not None:
        changes["memory_gb"] = memory_gb
    if peak_tflops is not None:  # one figure for the run's precision
        changes["peak_tflops_16bit"] = changes["peak_tflops_tf32"] = peak_tflops
    if intra_node_gbps is not None:
        changes["intra_node_gbps"] = intra_node_gbps
    if inter_node_gbps is not None:
        changes["inter_node_gbps"] = inter_node_gbps
    if pcie_gbps is not None:
        changes["pcie_gbps"] = pcie_gbps
    if host_memory_gb is not None:
        changes["host_memory_gb"] = host_memory_gb
    if host_memory_gbps is not None:
        changes["host_memory_gbps"] = host_memory_gbps
    return dataclasses.replace(base, **changes)
