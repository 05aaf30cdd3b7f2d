"""What the benchmarks divide by: a device's peak HBM bandwidth and dense bf16 FLOP/s, by a
substring of jax's ``device_kind`` (first match wins, so the more specific names come first).
Imports nothing, so gpu_check's driver, which never starts jax, reads the same table."""
from __future__ import annotations

# HBM GB/s (vendors' datasheets)
HBM_PEAK_GBPS = (("H100 80GB HBM3", 3350), ("H100 PCIe", 2000), ("H100", 3350),
                 ("GH200 144G", 4900), ("GH200", 4000), ("H200", 4800),
                 ("A100-SXM4-80GB", 2039), ("A100-SXM4-40GB", 1555), ("A100", 1555),
                 ("MI300X", 5300), ("L40S", 864), ("L40", 864), ("L4", 300))

# dense bf16 FLOP/s (no sparsity)
BF16_PEAK_FLOPS = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("MI300", 1307e12),
                   ("TPU v6", 918e12), ("TPU v5 lite", 197e12), ("TPU v5e", 197e12),
                   ("TPU v5", 459e12), ("TPU v4", 275e12))


def _lookup(table, device_kind: str | None):
    kind = (device_kind or "").lower()
    return next((value for key, value in table if key.lower() in kind), None)


def hbm_peak_gbps(device_kind: str | None) -> float | None:
    """Peak HBM GB/s of a ``device_kind`` (None: not in the table, a CPU)."""
    return _lookup(HBM_PEAK_GBPS, device_kind)


def bf16_peak_flops(device_kind: str | None) -> float | None:
    """Dense bf16 FLOP/s of a ``device_kind`` (None: not in the table, a CPU)."""
    return _lookup(BF16_PEAK_FLOPS, device_kind)
