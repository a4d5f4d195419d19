"""The deployments the simulator knows: what one device can do, from public spec sheets.

Peak figures are the vendors' dense (no sparsity) numbers; `flop_efficiency` and `bw_efficiency`
are the fractions a serving engine's kernels typically reach (GEMMs at large batch, and streaming
weights and KV at small batch), the knobs a calibration file corrects (cost_model.py).

Sources: NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 TFLOP/s BF16 dense, 3.35 TB/s HBM3,
80 GB, NVLink 900 GB/s total); NVIDIA H200 datasheet (SXM: 989 TFLOP/s BF16 dense, 4.8 TB/s
HBM3e, 141 GB, NVLink 900 GB/s); NVIDIA A100 datasheet (80GB SXM: 312 TFLOP/s BF16 dense,
2.039 TB/s, NVLink 600 GB/s); NVIDIA L4 datasheet (121 TFLOP/s BF16 dense, 300 GB/s GDDR6,
24 GB, PCIe Gen4 x16 64 GB/s). `cpu-here` is this project's 2-core AVX2 machine, measured
(docs/benchmarks.md): 20.7 GB/s read on one core and 35 GB/s on two (a streaming-read loop),
float32 GEMMs at ~56 GFLOP/s per core (the model harness at batch 32).

PD links (`pd_link_bw`, per device, one direction; the KV of disaggregated serving crosses them): H100
and H200 nodes (DGX H100/H200) give each GPU its own ConnectX-7 InfiniBand NDR port, 400 Gb/s = 50 GB/s;
DGX A100 one ConnectX-6 HDR port per GPU, 200 Gb/s = 25 GB/s; an L4 server a 25 Gb/s Ethernet NIC (TCP);
cpu-here a 10 Gb/s TCP link. Latency per transfer: 10 us over RDMA, 50 us over TCP (setup and first byte;
assumed round figures, not measured here). docs/disaggregation.md (Simulated PD deployments) says how to change them.

HiCache links (docs/hicache.md, Simulated): `host_link_bw` is what a device<->host-memory KV copy reaches, one
direction. H100 and H200 sit on PCIe Gen5 x16 (64 GB/s raw); pinned-memory copies measure ~55 GB/s one way.
A100 and L4 are PCIe Gen4 x16 (32 GB/s raw, ~25 GB/s measured one way). cpu-here has no link: the "device"
pool is host memory too, so a load-back is a memory copy, ~10 GB/s for a gather/scatter of KV rows on this
2-core machine (an assumed round figure, below the 20.7 GB/s streaming read above). `storage_bw` is the L3
tier's read/write rate: a local NVMe SSD, ~5 GB/s on the GPU servers (PCIe Gen4/5 drives do 3-7 GB/s
sequential), ~3 GB/s for cpu-here's disk (assumed).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # FLOP/s per device at the serving dtype (bf16 on GPUs, float32 on cpu-here)
    mem_bw: float  # bytes/s per device
    mem_bytes: float  # device memory for weights + KV
    link_bw: float  # bytes/s per device for TP collectives (one direction)
    link_latency_s: float  # per collective
    step_overhead_s: float  # per forward pass: launches, host-side batch preparation
    flop_efficiency: float = 0.6
    bw_efficiency: float = 0.8
    mem_fraction: float = 0.85  # of memory for weights + KV (SGLang's mem_fraction_static)
    kv_bytes: float | None = None  # a fixed KV budget per device instead (the CPU engine's default)
    # PD disaggregation: the link from a prefill device to a decode device (bytes/s, one direction), and
    # the fixed cost of one room's transfer (setup, the first byte); see the module docstring.
    pd_link_bw: float = 50 * 1e9
    pd_link_latency_s: float = 10e-6
    # HiCache: device <-> host memory (bytes/s, one direction) and the storage tier (bytes/s); module docstring.
    host_link_bw: float = 55 * 1e9
    storage_bw: float = 5 * 1e9


GB = 1e9

HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("h100", 989e12, 3.35e12, 80 * GB, 450 * GB, 8e-6, 4e-4),
    "h200": Hardware("h200", 989e12, 4.8e12, 141 * GB, 450 * GB, 8e-6, 4e-4),
    "a100-80g": Hardware(
        "a100-80g", 312e12, 2.039e12, 80 * GB, 300 * GB, 1e-5, 5e-4, pd_link_bw=25 * GB, host_link_bw=25 * GB
    ),
    "l4": Hardware(
        "l4",
        121e12,
        300 * GB,
        24 * GB,
        32 * GB,
        2e-5,
        5e-4,
        pd_link_bw=25 / 8 * GB,
        pd_link_latency_s=50e-6,
        host_link_bw=25 * GB,
    ),
    # This machine at two threads, float32; the KV budget is the engine's CPU default (0.5 GiB).
    "cpu-here": Hardware(
        "cpu-here",
        112e9,
        35 * GB,
        8 * GB,
        10 * GB,
        5e-5,
        2e-3,
        flop_efficiency=0.55,
        bw_efficiency=0.75,
        kv_bytes=0.5 * 2**30,
        pd_link_bw=10 / 8 * GB,
        pd_link_latency_s=50e-6,
        host_link_bw=10 * GB,
        storage_bw=3 * GB,
    ),
}


def get_hardware(name: str) -> Hardware:
    try:
        return HARDWARE[name.lower()]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}") from None
