"""Tensor parallelism as a transform over an unsharded :class:`Transformer` (gpt-fast ``apply_tp``).

The model never sees a rank. :func:`apply_tp` slices each block's weights in place for one
rank of ``world_size`` and installs an all-reduce after the two row-parallel projections:

* attention: ``q_proj``/``k_proj``/``v_proj`` are column-parallel by *KV group* (a rank keeps
  whole KV heads and the query heads that share them), ``o_proj`` is row-parallel;
* MLP: ``gate_proj``/``up_proj`` are column-parallel, ``down_proj`` is row-parallel;
* embeddings, norms and the LM head stay replicated, so every rank ends with the same logits.

Heads need not divide evenly: SmolLM2-135M has 3 KV heads, so at TP=2 rank 0 keeps 2 KV
heads (6 query heads) and rank 1 keeps 1 (3 query heads). The sum over ranks of the partial
``o_proj``/``down_proj`` outputs equals the unsharded output, which the all-reduce restores;
results match the unsharded model up to float summation order.

The all-reduce is injected (``torch.distributed.all_reduce`` over gloo on CPU or NCCL on CUDA
in the verifier shard actor; a fake in tests), which keeps this module free of process groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import Tensor, nn

from treeserve.ops.model import Transformer

AllReduce = Callable[[Tensor], None]
"""Sums a tensor in place across all ranks of the tensor-parallel group."""


def split_sizes(total: int, world_size: int) -> list[int]:
    """Split ``total`` units into ``world_size`` contiguous parts, the first ones one larger."""
    base, extra = divmod(total, world_size)
    return [base + (1 if rank < extra else 0) for rank in range(world_size)]


def _bounds(total: int, world_size: int, rank: int) -> tuple[int, int]:
    sizes = split_sizes(total, world_size)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def _slice_linear(linear: nn.Linear, *, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> None:
    """Keep output rows ``[r0, r1)`` (column-parallel) or input columns ``[c0, c1)`` (row-parallel)."""
    weight = linear.weight.data  # (out, in)
    bias = None if linear.bias is None else linear.bias.data
    if rows is not None:
        weight = weight[rows[0] : rows[1]]
        bias = None if bias is None else bias[rows[0] : rows[1]]
    if cols is not None:
        if bias is not None:
            raise ValueError("a row-parallel projection with a bias is not supported (the bias would be summed N times)")
        weight = weight[:, cols[0] : cols[1]]
    linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    linear.out_features, linear.in_features = linear.weight.shape


def _all_reduce_output(all_reduce: AllReduce) -> Callable[[nn.Module, tuple[Tensor, ...], Tensor], Tensor]:
    def hook(_module: nn.Module, _inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
        all_reduce(output)
        return output

    return hook


def apply_tp(model: Transformer, rank: int, world_size: int, all_reduce: AllReduce) -> Transformer:
    """Shard ``model`` in place for ``rank`` of ``world_size`` and return it.

    Every rank must call this on an identical unsharded model and then run identical forwards
    (same tokens, masks and positions) in lockstep: each forward performs two all-reduces per
    block. ``model.config`` is replaced by the rank's local head counts, so
    ``model.new_cache()`` allocates only this rank's KV heads. ``world_size`` may not exceed the
    number of KV heads (a rank needs at least one whole KV group).
    """
    config = model.config
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if world_size > config.num_kv_heads:
        raise ValueError(
            f"tensor-parallel size {world_size} exceeds the model's {config.num_kv_heads} KV heads; "
            f"use a TP size of at most {config.num_kv_heads}"
        )
    if world_size == 1:
        return model
    group = config.num_heads // config.num_kv_heads
    hd = config.head_dim
    kv0, kv1 = _bounds(config.num_kv_heads, world_size, rank)
    ffn0, ffn1 = _bounds(config.ffn_dim, world_size, rank)
    q_rows = (kv0 * group * hd, kv1 * group * hd)
    kv_rows = (kv0 * hd, kv1 * hd)
    hook = _all_reduce_output(all_reduce)
    for block in model.layers:
        attn = block.self_attn
        _slice_linear(attn.q_proj, rows=q_rows)
        _slice_linear(attn.k_proj, rows=kv_rows)
        _slice_linear(attn.v_proj, rows=kv_rows)
        _slice_linear(attn.o_proj, cols=q_rows)
        attn.num_kv_heads = kv1 - kv0
        attn.num_heads = (kv1 - kv0) * group
        mlp = block.mlp
        _slice_linear(mlp.gate_proj, rows=(ffn0, ffn1))
        _slice_linear(mlp.up_proj, rows=(ffn0, ffn1))
        _slice_linear(mlp.down_proj, cols=(ffn0, ffn1))
        attn.o_proj.register_forward_hook(hook)
        mlp.down_proj.register_forward_hook(hook)
    model.config = dataclasses.replace(
        config, num_heads=(kv1 - kv0) * group, num_kv_heads=kv1 - kv0, ffn_dim=ffn1 - ffn0
    )
    return model


def distributed_all_reduce(group: object | None = None) -> AllReduce:
    """An :data:`AllReduce` over ``torch.distributed`` (gloo on CPU, NCCL on CUDA)."""
    import torch.distributed as dist

    def all_reduce(tensor: Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)  # type: ignore[arg-type]

    return all_reduce


__all__ = ["AllReduce", "apply_tp", "distributed_all_reduce", "split_sizes"]

