"""Weights asked into L2 ahead of the products that read them, in one-row decode steps on CUDA.

A one-row step of a small model streams each projection's weights once, but its chain of products,
attention and norms leaves the memory idle between products: Qwen3-0.6B's 112 products move 0.88 GB
at about 1.5 TB/s, a third of what the device copies. Here a side stream, forked from the step's
stream before each product, asks L2 for the weights of the product AHEAD products later, so memory
streams while the chain waits on its own latencies, and each product finds most of its weights in
L2. The side stream writes nothing, so the step computes the same bits; the forward joins it before
it returns, so a captured CUDA graph holds both branches. See docs/design-notes.md, "Model"
(weights warmed in L2).

AHEAD 0 leaves it off: it has not been timed on a GPU yet (benchmarks/gpu_decode.py's warm-l2-N
variants time it, benchmarks/gpu_check.py checks that the tokens stay the same).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zipage.kernels.triton_linear import prefetch_l2

AHEAD = 0  # products between the one a fork precedes and the one whose weights it warms (0: off)
MAX_BYTES = 16 << 20  # only models whose every product is this small: a few of them fit L2 together
LINE_BYTES = 128
LINES_PER_PROGRAM = 1024

forks = 0  # side-stream launches made (captures and eager forwards), for checks that it ran


@triton.jit
def _warm_kernel(ptr, n_lines, LINES: tl.constexpr):
    """Ask L2 for LINES 128-byte lines from ptr (bytes) on; the last program repeats the last line."""
    lines = tl.program_id(0) * LINES + tl.arange(0, LINES)
    prefetch_l2(ptr + tl.minimum(lines, n_lines - 1).to(tl.int64) * 128)


def warm(weight: torch.Tensor) -> None:
    """Launch the requests for weight's bytes on the current stream (nothing waits for them)."""
    data = weight.detach().reshape(-1).view(torch.uint8)
    lines = triton.cdiv(data.numel(), LINE_BYTES)
    _warm_kernel[(triton.cdiv(lines, LINES_PER_PROGRAM),)](data, lines, LINES=LINES_PER_PROGRAM, num_warps=4)


def warm_order(count: int, ahead: int) -> list[list[int]]:
    """For each of `count` products in turn, the products whose weights are warmed just before it:
    the first `ahead + 1` before the first, then the one `ahead` later before each."""
    if count <= 0 or ahead <= 0:
        return [[] for _ in range(max(count, 0))]
    return [list(range(min(ahead + 1, count)))] + [[k + ahead] if k + ahead < count else []
                                                  for k in range(1, count)]


_side_streams: dict[int, torch.cuda.Stream] = {}


class WeightWarmer:
    """One forward's warming: call `before_product()` just before each product, in the order of
    `weights`, then `join()` before the forward returns."""

    def __init__(self, weights: list[torch.Tensor], ahead: int):
        self.weights = weights
        self.order = warm_order(len(weights), ahead)
        self.next = 0
        device = weights[0].device
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _side_streams:
            _side_streams[index] = torch.cuda.Stream(device=device)
        self.side = _side_streams[index]

    def before_product(self) -> None:
        global forks
        due = self.order[self.next] if self.next < len(self.order) else []
        self.next += 1
        if not due:
            return
        self.side.wait_stream(torch.cuda.current_stream())  # after what the step launched so far
        with torch.cuda.stream(self.side):
            for k in due:
                warm(self.weights[k])
        forks += 1

    def join(self) -> None:
        torch.cuda.current_stream().wait_stream(self.side)


def warmer(weights: list[torch.Tensor]) -> WeightWarmer | None:
    """A warmer for a forward over these product weights (in their order), or None where warming is
    off: AHEAD 0, not NVIDIA CUDA, or a product over MAX_BYTES (whose weights L2 cannot hold ahead)."""
    if AHEAD <= 0 or not weights or weights[0].device.type != "cuda" or torch.version.hip is not None:
        return None
    if max(w.numel() * w.element_size() for w in weights) > MAX_BYTES:
        return None
    return WeightWarmer(weights, AHEAD)
