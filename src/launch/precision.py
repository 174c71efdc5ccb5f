"""Precision that fits the hardware: `trainer.mixed_precision=auto` is bf16 where the device computes bf16
natively and fp32 elsewhere; an explicit bf16 on a CPU that would emulate it is warned about.

Without native support, bf16 matmuls on a CPU are converted element by element: measured on a 2-core AMD EPYC
(no AVX-512-BF16), `experiment=shakespeare_char` took 4.7 minutes per optimizer step in bf16.
"""

import functools
import logging
import os
from pathlib import Path

import torch

from src.launcher import launched_rank

log = logging.getLogger(__name__)

# /proc/cpuinfo flags of CPUs with bf16 arithmetic: x86 (AVX-512-BF16, AMX) and Arm (the BF16 extension).
CPU_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


def cpu_bf16_flags(cpuinfo: str | None = None) -> list[str]:
    """The bf16 flags this CPU reports (Linux; elsewhere none are known)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    return sorted(flags & CPU_BF16_FLAGS)


def native_bf16(cpuinfo: str | None = None) -> tuple[bool, str]:
    """Whether the device this process trains on computes bf16 natively, and that device in words."""
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        major, minor = torch.cuda.get_device_capability(index)
        return major >= 8, f"{torch.cuda.get_device_name(index)} (compute capability {major}.{minor})"
    flags = cpu_bf16_flags(cpuinfo)
    if flags:
        return True, f"a CPU with {', '.join(flags)}"
    return False, "a CPU without bf16 instructions (AVX-512-BF16, AMX)"


def resolve_precision(value: str, source: str, cpuinfo: str | None = None) -> tuple[str, str]:
    """(precision, where it came from) with `auto` decided; warns about a bf16 this device would emulate."""
    if value == "auto":
        native, device = native_bf16(cpuinfo)
        return ("bf16" if native else "no"), f"auto: {device}"
    if value == "bf16" and not torch.cuda.is_available():
        native, device = native_bf16(cpuinfo)
        if not native:
            warn_emulated_bf16(source, device)
    return value, source


@functools.cache  # once per process: the config check before the run dir and train.py both resolve it
def warn_emulated_bf16(source: str, device: str) -> None:
    if launched_rank() != 0:  # every process resolves the precision; one warns
        return
    log.warning("mixed precision bf16 (%s) on %s: bf16 is emulated there, typically tens of times slower than fp32 "
                "(4.7 minutes per optimizer step for experiment=shakespeare_char on a 2-core AMD EPYC). "
                "trainer.mixed_precision=auto picks fp32 here and bf16 where it is native.", source, device)
