"""The one-token decode step with static shapes, built for ``torch.compile``.

A plain decode step (every row adds one token) is the forward that batch-1 latency, adaptive
speculation's fallback and large batches all run, and in eager mode its ~1,000 small ops cost
more than its weight reads. :class:`DecodeStep` runs it as one function of tensors only:

* the KV cache is the model's preallocated :class:`~treeserve.ops.kv_cache.KVCache` storage,
  written in place at each row's committed length with an indexed store (no host read of the
  lengths, no per-row Python loop);
* attention reads slots ``[0, num_slots)``, ``num_slots = max(lengths) + 1``, under a
  ``(B, 1, 1, S)`` mask that hides each row's slots past its own new token; ``S`` and the row
  count ``B`` are marked dynamic, so neither a growing sequence nor a different row block
  recompiles (gpt-fast's ``decode_one_token``, with a dynamic instead of a maximal slot count
  so the attention reads only the slots in use);
* the compiled function is saved to one file (``torch.compile``'s ``aot_compile``), so a
  second start loads it in a few seconds instead of tracing and compiling (about two minutes
  for the default model on 2 cores).

The step computes exactly what ``Transformer.forward`` computes for one new token per row with
the same kernels (one set of weight values), so it can replace it anywhere. Trees and prefills
stay eager: their shapes vary and their time is in the matrix products, not in op overhead.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
import torch._inductor.config
from torch import Tensor

from treeserve.ops.kv_cache import KVCache
from treeserve.ops.model import Block, Transformer, apply_rope


def decode_hidden(
    model: Transformer, tokens: Tensor, lengths: Tensor, keys: list[Tensor], values: list[Tensor], num_slots: Tensor
) -> Tensor:
    """Final-normed hidden states ``(B, D)`` of one new token per row; writes its K/V at slot
    ``lengths[b]``. The LM head runs outside (eagerly, on the format's prepacked kernel).

    ``tokens`` ``(B,)``, ``lengths`` ``(B,)`` long (committed lengths, not advanced here),
    ``keys``/``values`` the cache's per-layer ``(B, n_kv, C, hd)`` storage, and ``num_slots`` a
    ``(S,)`` tensor whose *length* is ``max(lengths) + 1`` (a shape, so compiling keeps it
    symbolic). Pure tensor code: no host reads, no data-dependent branches.
    """
    config = model.config
    batch = tokens.shape[0]
    num_heads, num_kv, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    dtype = model.dtype
    slots = torch.arange(num_slots.shape[0], device=tokens.device)  # (S,)
    mask = (slots[None, :] <= lengths[:, None])[:, None, None, :]  # (B, 1, 1, S) True = attend
    cos = model.rope_cos[lengths].to(dtype)[:, None, None, :]  # (B, 1, 1, hd)
    sin = model.rope_sin[lengths].to(dtype)[:, None, None, :]
    rows = torch.arange(batch, device=tokens.device)
    h = model.embed_tokens(tokens)[:, None, :]  # (B, 1, D)
    for index, module in enumerate(model.layers):
        block = cast(Block, module)
        attn = block.self_attn
        x = block.input_layernorm(h)
        q_size, kv_size = attn.num_heads * head_dim, attn.num_kv_heads * head_dim
        if attn.qkv_proj is None:
            raise ValueError("the decode step needs a formatted model (formats.apply_format fuses its projections)")
        q, k, v = attn.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rope(q.view(batch, 1, attn.num_heads, head_dim).transpose(1, 2), cos, sin)  # (B, H, 1, hd)
        k = apply_rope(k.view(batch, 1, attn.num_kv_heads, head_dim).transpose(1, 2), cos, sin)  # (B, n_kv, 1, hd)
        v = v.view(batch, 1, attn.num_kv_heads, head_dim).transpose(1, 2)
        keys[index][rows, :, lengths] = k[:, :, 0]  # (B, n_kv, hd) into slot lengths[b]
        values[index][rows, :, lengths] = v[:, :, 0]
        visible_k = keys[index][:, :, : num_slots.shape[0]]  # (B, n_kv, S, hd)
        visible_v = values[index][:, :, : num_slots.shape[0]]
        group = attn.num_heads // attn.num_kv_heads
        q_grouped = q.view(batch, attn.num_kv_heads, group, 1, head_dim)  # (B, n_kv, g, 1, hd): GQA, K/V not expanded
        # Written as products and sums (not bmm) so inductor fuses the whole attention of a
        # row into one loop over its slots; at one query per head that beats any GEMM call.
        scores = (q_grouped.float() * visible_k[:, :, None].float()).sum(-1) * head_dim**-0.5  # (B, n_kv, g, S)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # (B, n_kv, g, S) float32
        out = (probs[..., None] * visible_v[:, :, None].float()).sum(-2).to(dtype)  # (B, n_kv, g, hd)
        out = out.view(batch, attn.num_heads, 1, head_dim)  # (B, H, 1, hd)
        h = h + attn.o_proj(out.transpose(1, 2).reshape(batch, 1, q_size))
        h = h + block.mlp(block.post_attention_layernorm(h))
    return model.norm(h[:, 0])  # (B, D)


class DecodeStep:
    """``step(tokens (B,), cache) -> (logits (B, V) float32, hidden (B, D))``, one token per row.

    Writes each row's new K/V at its committed length and marks one pending slot per row, as
    ``Transformer.forward`` does (keep it with ``cache.commit(row, [0])``). Without
    ``artifact`` the function runs eagerly (the tests' reference, and the path wherever
    compiling is off). With ``artifact`` (a file path) it is compiled ahead of time by
    ``torch.compile``'s ``aot_compile`` on first use, saved there, and later processes load it
    without tracing or compiling again; ``compile_seconds`` / ``load_seconds`` say which
    happened and how long it took.

    The compiled function is traced once with the batch, the cache capacity and the number of
    visible slots symbolic, and runs without dynamo's guards (they cost about 1 ms a step).
    What the guards would have checked is covered instead by the artifact's name, which
    :func:`artifact_name` derives from the model's config, format, dtype and device (a step is
    only loaded for the model it was compiled for), and by each call's check that the cache
    belongs to the model.
    """

    def __init__(self, model: Transformer, *, artifact: str | Path | None = None) -> None:
        self.model = model
        self.artifact = None if artifact is None else Path(artifact)
        self.compile_seconds: float | None = None
        self.load_seconds: float | None = None
        self._compiled: Callable[..., Tensor] | None = None

    @property
    def is_compiled(self) -> bool:
        """True once the compiled function is in use."""
        return self._compiled is not None

    def prepare(self) -> None:
        """Load the artifact, or compile it and save it there. Does nothing without an
        artifact path or when already prepared."""
        if self.artifact is None or self._compiled is not None:
            return
        started = time.perf_counter()
        if self.artifact.exists():
            try:
                # Loading probes each vector ISA by compiling and dlopen-ing a test library in
                # a subprocess (about 2 s); the saved kernels were built for this CPU (the
                # file name covers its capability), so the probe is skipped.
                with self.artifact.open("rb") as file, torch._inductor.config.patch({"cpp.vec_isa_ok": True}):
                    self._compiled = torch.compiler.load_compiled_function(file)
                self.load_seconds = time.perf_counter() - started
                return
            except Exception:  # a truncated or foreign file: compile afresh below
                self.artifact.unlink(missing_ok=True)
        # Two rows and a few slots: dynamo specializes dimensions of size 1, so an example of
        # one row would compile a function for batch 1 only.
        example_cache = self.model.new_cache(2, 16)
        tokens = torch.zeros(example_cache.batch_size, dtype=torch.long, device=example_cache.device)
        num_slots = torch.empty(3, dtype=torch.bool)
        for tensor in (tokens, example_cache.lengths, num_slots):
            torch._dynamo.mark_dynamic(tensor, 0)
        for tensor in example_cache.keys + example_cache.values:
            torch._dynamo.mark_dynamic(tensor, 0)
            torch._dynamo.mark_dynamic(tensor, 2)
        fn = torch.compile(decode_hidden, fullgraph=True, options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe})
        with torch.inference_mode():
            compiled = fn.aot_compile(((self.model, tokens, example_cache.lengths, example_cache.keys,
                                        example_cache.values, num_slots), {}))
        self.artifact.parent.mkdir(parents=True, exist_ok=True)
        partial = self.artifact.with_suffix(f".partial-{os.getpid()}")
        compiled.save_compiled_function(str(partial))
        os.replace(partial, self.artifact)
        self._compiled = compiled
        self.compile_seconds = time.perf_counter() - started

    @torch.inference_mode()
    def __call__(self, tokens: Tensor, cache: KVCache) -> tuple[Tensor, Tensor]:
        if tokens.dim() != 1 or tokens.shape[0] != cache.batch_size:
            raise ValueError(f"tokens must be (B,) = ({cache.batch_size},), got {tuple(tokens.shape)}")
        if cache.dtype != self.model.dtype or cache.num_layers != len(self.model.layers):
            raise ValueError("the cache does not belong to this decode step's model")
        lengths = cache.begin_write(1)
        num_slots = torch.empty(max(lengths) + 1, dtype=torch.bool)  # only its length is read
        fn = self._compiled if self._compiled is not None else decode_hidden
        hidden = fn(self.model, tokens, cache.lengths, cache.keys, cache.values, num_slots)  # (B, D)
        return self.model.logits(hidden), hidden


def artifact_name(model: Transformer) -> str:
    """A file name that changes whenever what a compiled decode step depends on changes: the
    model's shapes, its format and dtype, torch's version, the CPU's features and the source
    of the modules the step traces."""
    import hashlib
    import platform

    from treeserve.ops import formats, model as model_module

    sources = b"".join(Path(m.__file__).read_bytes() for m in (model_module, formats) if m.__file__) + Path(__file__).read_bytes()
    key = "|".join([
        repr(sorted(model.config.__dict__.items())), str(model.weight_format), str(model.dtype), str(model.device),
        torch.__version__, platform.machine(), torch.backends.cpu.get_cpu_capability(),
        hashlib.sha256(sources).hexdigest(),
    ])
    return f"decode-{model.weight_format}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.aot"
