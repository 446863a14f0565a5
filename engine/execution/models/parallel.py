"""Tensor parallelism inside one model: which share of the heads, MLP columns and vocabulary a rank
holds, and the collectives that put the shares back together.

Attention heads and KV heads are split evenly (a rank keeps whole GQA groups), so each rank owns
its heads' KV cache, query slots and compression decisions. The MLP is split by intermediate
columns. Row-parallel outputs (o_proj, down_proj) and the vocab-parallel embedding are summed
with an all-reduce; the vocab-parallel LM head is gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object = None  # torch.distributed process group; None when size == 1

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def share(self, total: int, what: str) -> int:
        if total % self.size:
            raise ValueError(f"tensor_parallel_size={self.size}: {what} ({total}) must divide evenly")
        return total // self.size

    def take(self, full: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's equal share of `full` along `dim`."""
        n = full.shape[dim] // self.size
        return full.narrow(dim, self.rank * n, n)

    def take_padded_rows(self, full: torch.Tensor, rows_per_rank: int) -> torch.Tensor:
        """This rank's rows of a vocabulary-sized tensor, zero-padded to `rows_per_rank * size`."""
        start = self.rank * rows_per_rank
        local = full[start:start + rows_per_rank]
        if local.shape[0] < rows_per_rank:
            pad = full.new_zeros((rows_per_rank - local.shape[0],) + tuple(full.shape[1:]))
            local = torch.cat([local, pad])
        return local

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension, in rank order."""
        if not self.enabled:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def min_over_ranks(self, values: list[int]) -> list[int]:
        """The element-wise minimum of an integer list across ranks (pool sizes every rank can hold)."""
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        if dist.get_backend(self.group) == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return [int(v) for v in t.tolist()]


def check_tensor_parallel(hf_config, size: int, device: torch.device) -> None:
    """Refuse a tensor_parallel_size the model or the machine cannot be split over, before any
    process starts."""
    for what, total in (("attention heads", hf_config.num_attention_heads),
                        ("KV heads", hf_config.num_key_value_heads),
                        ("intermediate size", hf_config.intermediate_size)):
        if total % size:
            raise ValueError(f"tensor_parallel_size={size}: the model's {what} ({total}) do not divide evenly")
    if device.type == "cuda" and size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size}: only {torch.cuda.device_count()} GPUs are visible")
