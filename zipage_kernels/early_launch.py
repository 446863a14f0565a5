"""Programmatic dependent launch (PDL) on NVIDIA Hopper and later: a decode step's kernels start
while the kernel before them finishes, instead of after it.

A kernel launched with `launch_pdl=True` may begin as soon as every program of the kernel before
it has called `gdc_launch_dependents`. It must not read what that kernel writes, nor write
anything, before `gdc_wait`, which returns once that kernel has finished and its writes are
visible. Each kernel here calls `gdc_launch_dependents` only after its own `gdc_wait`, so a kernel
that starts early overlaps only the end of the one kernel before it. Ahead of its wait a kernel
here reads nothing but weights, which no kernel writes, so a caller may write any other input with
a kernel just before the call. See docs/design-notes.md, "Model" (decode kernels start early).

ENABLED is the switch for comparisons (benchmarks/gpu_decode.py's fused-no-pdl variant)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

ENABLED = True
LAUNCH_ARGS = {"PDL": True, "launch_pdl": True}  # a kernel's constexpr and Triton's launch option


@functools.lru_cache(maxsize=None)
def _device_has_pdl(index: int) -> bool:
    """NVIDIA Hopper or later (ROCm reports its own capabilities through the same call)."""
    return (torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9
            and hasattr(tl.extra.cuda, "gdc_wait"))


def available(device: torch.device) -> bool:
    """Kernels on this device launch early (ENABLED, CUDA, Hopper; never the interpreter's CPU tensors)."""
    if not ENABLED or device.type != "cuda":
        return False
    return _device_has_pdl(device.index if device.index is not None else torch.cuda.current_device())


def launch_args(device: torch.device) -> dict:
    """Extra launch arguments for a kernel taking a PDL constexpr: launch early where available."""
    return dict(LAUNCH_ARGS) if available(device) else {}


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """Wait for the kernel before this one to finish, then let the kernel after this one start."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
