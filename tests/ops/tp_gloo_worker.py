"""One rank of the gloo tensor-parallel check (run as a script by test_ops_tp.py)."""

from __future__ import annotations

import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from treeserve.ops.model import Transformer
from treeserve.ops.model_config import ModelConfig
from treeserve.ops.tp import apply_tp, distributed_all_reduce
from treeserve.ops.tree_attention import tree_mask_from_parents

CONFIG = dict(vocab_size=64, dim=48, num_layers=2, num_heads=6, num_kv_heads=3, head_dim=8, ffn_dim=40, max_seq_len=64)
PARENTS = [-1, 0, 0, 1, 1, 2, 5]


GEMMA3 = dict(qk_norm=True, sliding_window=3, window_layers=(True, False), rope_base_local=500.0, post_norms=True,
              activation="gelu_tanh", embed_scale=2.0)
"""Gemma 3's parts: a window of 3 keys on the first layer (shorter than the prompt), output norms
after each all-reduced product."""


def build_model(seed: int = 0, **overrides: object) -> Transformer:
    """The tiny random model every rank (and the unsharded reference) builds identically."""
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(ModelConfig(**{**CONFIG, **overrides}))  # type: ignore[arg-type]
    with torch.no_grad():
        for name, param in model.named_parameters():
            base, scale = (1.0, 0.5) if "norm" in name else (0.0, 0.2)
            param.copy_(base + scale * torch.randn(param.shape, generator=gen))
    return model.eval()


def run(model: Transformer) -> torch.Tensor:
    """Prefill 5 tokens, then score a 7-node token tree: returns tree logits (1, 7, V)."""
    cache = model.new_cache(1, 64)
    prompt = torch.tensor([[3, 17, 42, 5, 9]])
    model(prompt, cache)
    cache.commit(0, range(5))
    parents = torch.tensor(PARENTS)
    mask = tree_mask_from_parents(parents)
    depths = mask.sum(-1) - 1
    tokens = torch.tensor([[11, 12, 13, 14, 15, 16, 17]])
    return model(tokens, cache, tree_mask=mask[None], positions=(5 + depths)[None])


def main() -> None:
    rank, world_size, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        model = apply_tp(build_model(), rank, world_size, distributed_all_reduce())
        logits = run(model)
        np.save(out, logits.numpy())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
