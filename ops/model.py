"""LLaMA-family decoder (SmolLM2, LLaMA 2/3, TinyLlama, Qwen2/2.5/3, Phi-3, Gemma 3) with
tree-aware forward.

RMSNorm, rotate-half RoPE, grouped-query attention, a gated MLP (SiLU, or Gemma's tanh GELU),
optional q/k/v bias and a tied or separate LM head; and what Gemma 3 adds: sliding-window
layers beside global ones (each kind with its own rope base), norms on the attention's and
the MLP's outputs, and scaled embeddings. Parameter names follow the Hugging Face layout minus the ``model.``
prefix (``layers.0.self_attn.q_proj.weight``...), so HF checkpoints map one to one.

One :meth:`Transformer.forward` scores ``T`` new tokens per row against the committed KV
cache; with a ``tree_mask`` and depth-based ``positions`` those tokens are a token tree and
every node's logits equal those of a plain causal pass over its root-to-node path.
"""

from __future__ import annotations

from typing import Literal, Protocol, cast, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from treeserve.ops.embedding import PackedEmbedding
from treeserve.ops.kernels import tree_attention_cuda
from treeserve.ops.kv_cache import KVCache
from treeserve.ops.model_config import ModelConfig, activation, apply_rope, rope_tables
from treeserve.ops.tree_attention import (
    ancestor_bits_from_mask,
    attention_under_mask,
    build_attention_mask,
    uses_tree_kernel,
    window_mask,
)


class AttachedStep(Protocol):
    """What a model asks of the step attached for serving (``decode_step.DecodeStep``): it runs
    every forward of at most ``max_new`` new tokens per row, or every forward once fused."""

    max_new: int

    @property
    def is_fused(self) -> bool: ...

    def __call__(self, tokens: Tensor, cache: KVCache, tree_mask: Tensor | None, positions: Tensor) -> Tensor: ...


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale (no bias)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    """GQA self-attention that writes its new K/V into the cache and reads the visible slots:
    through SDPA under ``mask``, or, given ``ancestor_bits`` (a token tree on CUDA), through the
    CuPy tree kernel straight from the cache (no mask)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.dim, config.num_heads * config.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.dim, config.num_kv_heads * config.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.dim, config.num_kv_heads * config.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.dim, bias=False)
        self.qkv_proj: nn.Module | None = None  # set by formats.apply_format (q|k|v rows fused)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None
        self.scale = config.attn_scale  # None: SDPA's 1 / sqrt(head_dim)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        cache: KVCache,
        layer: int,
        lengths: list[int],
        mask: Tensor | None,
        num_slots: int,
        is_causal: bool,
        ancestor_bits: Tensor | None = None,
    ) -> Tensor:
        batch, num_new, _ = x.shape
        if self.qkv_proj is not None:
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q_flat, k_flat, v_flat = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        else:
            q_flat, k_flat, v_flat = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q_flat.view(batch, num_new, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k_flat.view(batch, num_new, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hd)
        v = v_flat.view(batch, num_new, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hd)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        cache.write(layer, k, v, lengths)
        if ancestor_bits is not None:
            # The whole cache storage: the kernel reads each row's own prefix and tree slots.
            out = tree_attention_cuda.tree_attention_cuda(
                q, cache.keys[layer], cache.values[layer], cache.lengths, ancestor_bits,
                max_prefix_length=num_slots - num_new)  # (B, H, T, hd)
        else:
            keys = cache.keys[layer][:, :, :num_slots]  # (B, n_kv, S, hd)
            values = cache.values[layer][:, :, :num_slots]
            out = attention_under_mask(q, keys, values, mask, is_causal=is_causal, scale=self.scale)  # (B, H, T, hd)
        out = out.transpose(1, 2).reshape(batch, num_new, self.num_heads * self.head_dim)  # (B, T, H*hd)
        result: Tensor = self.o_proj(out)
        return result


class MLP(nn.Module):
    """Gated feed-forward: ``down(act(gate(x)) * up(x))``, ``act`` SiLU (SwiGLU) or tanh GELU
    (GeGLU) as the config says."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.activation = config.activation
        self.gate_proj = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.up_proj = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.down_proj = nn.Linear(config.ffn_dim, config.dim, bias=False)
        self.gate_up_proj: nn.Module | None = None  # set by formats.apply_format (gate|up rows fused)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        result: Tensor = self.down_proj(activation(self.activation, gate) * up)
        return result


class Block(nn.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual
    (``post_attention_layernorm`` is the MLP's input norm, as in HF's LLaMA), and with Gemma's
    ``post_norms`` a norm on each one's output before its residual add."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)
        self.attn_out_norm = RMSNorm(config.dim, config.norm_eps) if config.post_norms else None
        self.mlp_out_norm = RMSNorm(config.dim, config.norm_eps) if config.post_norms else None

    def add_attention(self, h: Tensor, out: Tensor) -> Tensor:
        """The residual after attention: ``h + out`` (``out`` normed first under post norms)."""
        return h + (out if self.attn_out_norm is None else self.attn_out_norm(out))

    def add_mlp(self, h: Tensor) -> Tensor:
        """The MLP over ``h`` and its residual."""
        out = self.mlp(self.post_attention_layernorm(h))
        return h + (out if self.mlp_out_norm is None else self.mlp_out_norm(out))


class Transformer(nn.Module):
    """A LLaMA-family decoder whose forward scores new tokens (a chain or a token tree).

    ``forward(tokens (B, T), cache, *, tree_mask=None, positions=None, return_hidden=False)``
    writes the new tokens' K/V to the cache's pending slots ``[lengths[b], lengths[b]+T)``
    (it never advances ``cache.lengths``; use ``cache.commit``) and returns float32 logits
    ``(B, T, V)``, plus the final-normed hidden states ``(B, T, D)`` if ``return_hidden``.
    New token ``t`` attends to the committed slots and to new token ``s`` iff
    ``tree_mask[b, t, s]`` (``None``: causal). ``positions`` default to ``lengths[b] + t``; for a
    token tree pass ``lengths[b] + depth`` (roots have depth 0). Runs under
    ``torch.inference_mode`` (inference only; the cache is updated in place). On CUDA a tree's
    attention runs the CuPy tree kernel on ancestor words (no dense mask is built); chains,
    plain decode and CPU devices run SDPA (:func:`~treeserve.ops.tree_attention.uses_tree_kernel`).
    """

    rope_cos: Tensor  # (max_seq_len, hd) float32 buffers, not saved in state dicts
    rope_sin: Tensor
    rope_cos_local: Tensor  # the windowed layers' own (config.local_rope), else the same tables
    rope_sin_local: Tensor

    def __init__(self, config: ModelConfig, *, init: bool = True) -> None:
        super().__init__()
        self.config = config
        # init=False (from_state_dict, on the meta device): no random embedding, whose normal_
        # on meta dispatches to Python references that import torch._dynamo (1.6 s of a
        # server's start) for values never used.
        weight = None if init else torch.empty(config.vocab_size, config.dim)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim, _weight=weight)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head: nn.Linear | None = (
            None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        )
        self.head_kernel: nn.Module | None = None  # set by formats.apply_format: the LM head in the format
        self.weight_format: str | None = None  # the formats.WeightFormat value once applied
        # decode_step.DecodeStep, attached for serving: runs every forward of at most
        # decode_step.max_new new tokens per row (decode steps and trees), or, once fused (q4_1),
        # every forward; see _hidden_states.
        self.decode_step: AttachedStep | None = None
        # Under init=False from_state_dict sets the tables (torch.arange on meta would also
        # import torch._dynamo).
        if init:
            self.set_rope_tables()
        else:
            for name in ("rope_cos", "rope_sin", "rope_cos_local", "rope_sin_local"):
                self.register_buffer(name, torch.empty(0), persistent=False)

    def set_rope_tables(self) -> None:
        """(Re)compute the rope tables of the config (on the CPU: they are float64 math)."""
        cos, sin = rope_tables(self.config)
        local = rope_tables(self.config, local=True) if self.config.local_rope else (cos, sin)
        for name, table in zip(("rope_cos", "rope_sin", "rope_cos_local", "rope_sin_local"), (cos, sin, *local)):
            self.register_buffer(name, table, persistent=False)

    def rope_rows(self, positions: Tensor, dtype: torch.dtype) -> list[tuple[Tensor, Tensor]]:
        """Each layer's cos and sin rows ``(B, T, hd)`` in ``dtype`` at ``positions`` ``(B, T)``,
        gathered once per table (the windowed layers' own, the others')."""
        gathered: dict[bool, tuple[Tensor, Tensor]] = {}
        rows = []
        local_rope = self.config.local_rope
        for layer in range(len(self.layers)):
            local = local_rope and self.config.window(layer) is not None
            if local not in gathered:
                cos, sin = (self.rope_cos_local, self.rope_sin_local) if local else (self.rope_cos, self.rope_sin)
                gathered[local] = (cos[positions].to(dtype), sin[positions].to(dtype))
            rows.append(gathered[local])
        return rows

    def embed(self, tokens: Tensor) -> Tensor:
        """The first block's input states ``(B, T, D)`` of ``tokens``: their embeddings (times
        ``embed_scale``, in float32, for Gemma)."""
        h = self.embed_tokens(tokens)
        scale = self.config.embed_scale
        return h if scale is None else (h.float() * scale).to(h.dtype)

    @classmethod
    def from_state_dict(
        cls, config: ModelConfig, state_dict: dict[str, Tensor], *, dtype: torch.dtype = torch.float32
    ) -> Transformer:
        """Build a model that adopts ``state_dict`` (our parameter names) without random init.

        The tensors are cast to ``dtype`` (no copy when they already have it) and must match
        the config's shapes exactly; missing or unexpected names raise ``ValueError``.
        """
        with torch.device("meta"):
            model = cls(config, init=False)
        try:
            model.load_state_dict({k: v.to(dtype) for k, v in state_dict.items()}, strict=True, assign=True)
        except RuntimeError as exc:
            raise ValueError(f"state dict does not fit the model config: {exc}") from exc
        model.set_rope_tables()
        return model.eval()

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weights (and of caches made by :meth:`new_cache`)."""
        return self.embed_tokens.dtype if isinstance(self.embed_tokens, PackedEmbedding) else self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        """Device of the weights."""
        return self.embed_tokens.device if isinstance(self.embed_tokens, PackedEmbedding) else self.embed_tokens.weight.device

    @property
    def lm_head_weight(self) -> Tensor:
        """The ``(V, D)`` matrix that turns final-normed hidden states into logits (the
        embedding when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: Tensor) -> Tensor:
        """float32 logits ``(..., V)`` of final-normed hidden states ``(..., D)`` (the format's
        LM-head kernel once :func:`~treeserve.ops.formats.apply_format` has run)."""
        if self.head_kernel is not None:
            return cast(Tensor, self.head_kernel(hidden)).float()
        return F.linear(hidden, self.lm_head_weight).float()

    def new_cache(self, batch_size: int = 1, capacity: int | None = None, *, headroom: int = 0) -> KVCache:
        """An empty :class:`KVCache` for this model (capacity: default ``max_seq_len``; headroom: see KVCache)."""
        capacity = self.config.max_seq_len if capacity is None else capacity
        if capacity > self.config.max_seq_len:
            raise ValueError(f"cache capacity {capacity} exceeds the model's max_seq_len {self.config.max_seq_len}")
        return KVCache(
            num_layers=self.config.num_layers,
            batch_size=batch_size,
            num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim,
            capacity=capacity,
            dtype=self.dtype,
            device=self.device,
            headroom=headroom,
        )

    def truncated(self, num_layers: int) -> Transformer:
        """A model that shares this one's first ``num_layers`` blocks, final norm and LM head.

        No weights are copied. It needs its own cache (``truncated_model.new_cache(...)``).
        """
        if not 1 <= num_layers <= self.config.num_layers:
            raise ValueError(f"truncated num_layers must be in [1, {self.config.num_layers}], got {num_layers}")
        windows = self.config.window_layers
        config = ModelConfig(**{**self.config.__dict__, "num_layers": num_layers,
                                "window_layers": None if windows is None else windows[:num_layers]})
        with torch.device("meta"):
            small = Transformer(config)
        small.embed_tokens = self.embed_tokens
        small.layers = nn.ModuleList(list(self.layers)[:num_layers])
        small.norm = self.norm
        small.lm_head = self.lm_head
        small.head_kernel = self.head_kernel
        small.weight_format = self.weight_format
        for name in ("rope_cos", "rope_sin", "rope_cos_local", "rope_sin_local"):
            setattr(small, name, getattr(self, name))
        return small

    def run_blocks(self, h: Tensor, cache: KVCache, positions: Tensor | None, tree_mask: Tensor | None,
                   slot_mask: Tensor | None = None) -> Tensor:
        """Every block over the new tokens' input states ``h`` ``(B, T, D)``, appending their
        K/V to ``cache`` as pending slots (``positions`` None: right after each row's committed
        tokens; ``tree_mask`` ``(B, T, T)`` or None for a causal chain); returns the last block's
        output, before the final norm. :meth:`forward` validates its inputs first; subclasses
        that feed other input states (drafters) call this directly, outside inference mode.
        ``slot_mask`` ``(B, 1, T, S)`` (True = attend, ``S`` = longest row + ``T``) replaces the
        prefix + ``tree_mask`` rule, for training that must hide committed slots."""
        batch, num_new = h.shape[:2]
        if positions is None:
            positions = cache.lengths[:, None] + torch.arange(num_new, device=h.device)  # (B, T)
        lengths = cache.begin_write(num_new)
        num_slots = max(lengths) + num_new
        # One mask for all layers; None when every visible slot is attended (plain decode).
        same_lengths = all(length == lengths[0] for length in lengths)
        is_causal = tree_mask is None and num_new > 1 and max(lengths) == 0
        ancestor_bits = None
        if slot_mask is not None:
            if slot_mask.shape != (batch, 1, num_new, num_slots):
                raise ValueError(f"slot_mask must be {(batch, 1, num_new, num_slots)}, got {tuple(slot_mask.shape)}")
            mask, is_causal = slot_mask, False
        elif (num_new == 1 and same_lengths) or is_causal:
            mask = None
        elif uses_tree_kernel(h.device, tree_mask, num_new) and not self.config.windowed:
            assert tree_mask is not None
            mask, ancestor_bits = None, ancestor_bits_from_mask(tree_mask)  # (B, T) words, no (B, 1, T, S) mask
        else:
            mask = build_attention_mask(cache.lengths, tree_mask, num_new, num_slots)
        # A windowed layer's mask: the slots in its window among those the others see, built once
        # per window (None where no token's window cuts anything: the other layers' mask).
        windowed: dict[int, Tensor | None] = {}
        for window in {self.config.window(i) for i in range(len(self.layers))} - {None}:
            assert window is not None
            if int(positions.max()) >= window:
                full = mask if mask is not None else build_attention_mask(cache.lengths, tree_mask, num_new, num_slots)
                windowed[window] = full & window_mask(cache.lengths, positions, num_slots, window)
            else:
                windowed[window] = None
        rope = self.rope_rows(positions, self.dtype)
        for index, module in enumerate(self.layers):
            block = cast(Block, module)
            cos, sin = (r[:, None] for r in rope[index])  # (B, 1, T, hd)
            window = self.config.window(index)
            layer_mask, causal = mask, is_causal
            if window is not None and windowed[window] is not None:
                layer_mask, causal = windowed[window], False
            out = block.self_attn(block.input_layernorm(h), cos, sin, cache, index, lengths, layer_mask, num_slots, causal,
                                  ancestor_bits if layer_mask is mask else None)
            h = block.add_mlp(block.add_attention(h, out))
        return h

    @overload
    def forward(
        self, tokens: Tensor, cache: KVCache, *, tree_mask: Tensor | None = ..., positions: Tensor | None = ...,
        return_hidden: Literal[False] = ..., logits_to_keep: int | None = ...,
    ) -> Tensor: ...

    @overload
    def forward(
        self, tokens: Tensor, cache: KVCache, *, tree_mask: Tensor | None = ..., positions: Tensor | None = ...,
        return_hidden: Literal[True], logits_to_keep: int | None = ...,
    ) -> tuple[Tensor, Tensor]: ...

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,
        cache: KVCache,
        *,
        tree_mask: Tensor | None = None,
        positions: Tensor | None = None,
        return_hidden: bool = False,
        logits_to_keep: int | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """See the class docstring. ``logits_to_keep=k`` scores only the last ``k`` new tokens
        (logits ``(B, k, V)``; the hidden states stay ``(B, T, D)``): decoding from a prompt needs
        the last position's logits only, and the LM head is a fifth of a 135M model's prefill."""
        if logits_to_keep is not None and not 1 <= logits_to_keep <= tokens.shape[-1]:
            raise ValueError(f"logits_to_keep must be in [1, {tokens.shape[-1]}] (or None for all), got {logits_to_keep}")
        positions = self._check_inputs(tokens, cache, tree_mask, positions)
        h = self._hidden_states(tokens, cache, tree_mask, positions)  # (B, T, D)
        scored = h if logits_to_keep is None else h[:, h.shape[1] - logits_to_keep:]
        logits = self.logits(scored)  # (B, T or k, V)
        return (logits, h) if return_hidden else logits

    @torch.inference_mode()
    def hidden_states(
        self, tokens: Tensor, cache: KVCache, *, tree_mask: Tensor | None = None, positions: Tensor | None = None,
    ) -> Tensor:
        """:meth:`forward` without the LM head: the final-normed hidden states ``(B, T, D)``.

        Writes the same pending K/V as :meth:`forward`. A prefill that keeps only the cache (the
        verifier's, whose first token comes from the next tree step) runs this.
        """
        positions = self._check_inputs(tokens, cache, tree_mask, positions)
        return self._hidden_states(tokens, cache, tree_mask, positions)

    def _hidden_states(self, tokens: Tensor, cache: KVCache, tree_mask: Tensor | None, positions: Tensor) -> Tensor:
        # Inputs are validated: only now mark slots pending (a rejected call leaves the cache as it was).
        step = self.decode_step
        if step is not None and (tokens.shape[1] <= step.max_new or step.is_fused):
            return step(tokens, cache, tree_mask, positions)
        h = self.run_blocks(self.embed(tokens), cache, positions, tree_mask)  # (B, T, D)
        return self.norm(h)

    def _check_inputs(self, tokens: Tensor, cache: KVCache, tree_mask: Tensor | None, positions: Tensor | None) -> Tensor:
        """Validate a forward's inputs (``ValueError``); return the positions (defaulted)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (B, T), got shape {tuple(tokens.shape)}")
        batch, num_new = tokens.shape
        if num_new == 0:
            raise ValueError("forward needs at least one new token per row (tokens of shape (B, 0) given)")
        if batch != cache.batch_size or cache.num_layers != len(self.layers):
            raise ValueError(
                f"cache (batch {cache.batch_size}, {cache.num_layers} layers) does not fit tokens batch "
                f"{batch} and a {len(self.layers)}-layer model"
            )
        if tree_mask is not None and (tree_mask.shape != (batch, num_new, num_new) or tree_mask.dtype != torch.bool):
            raise ValueError(
                f"tree_mask must be a bool tensor of shape (B, T, T) = {(batch, num_new, num_new)}, "
                f"got {tree_mask.dtype} {tuple(tree_mask.shape)}"
            )
        if positions is None:
            positions = cache.lengths[:, None] + torch.arange(num_new, device=tokens.device)  # (B, T)
        elif positions.shape != (batch, num_new):
            raise ValueError(f"positions must be (B, T) = {(batch, num_new)}, got {tuple(positions.shape)}")
        if positions.device.type != "cpu":  # checked on the device: a host read would stall every step
            torch._assert_async((positions.max() < self.config.max_seq_len) & (positions.min() >= 0))
        elif int(positions.max()) >= self.config.max_seq_len or int(positions.min()) < 0:
            raise ValueError(f"positions must lie in [0, max_seq_len={self.config.max_seq_len})")
        return positions
