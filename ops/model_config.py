"""A model's shape and the fixed functions it implies: :class:`ModelConfig` (LLaMA-family
hyper-parameters, validated on construction), the activations a block may use
(:data:`ACTIVATIONS`, :func:`activation`) and rotary positions (:func:`rope_tables`,
:func:`apply_rope`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class ModelConfig:
    """Shape hyper-parameters of a LLaMA-family model; validated on construction."""

    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 2048
    qkv_bias: bool = False
    tie_embeddings: bool = True
    qk_norm: bool = False
    """An RMS norm over each head of Q and of K before RoPE (Qwen3's ``q_norm`` / ``k_norm``)."""
    rope_factors: tuple[float, ...] | None = None
    """Per rotary frequency (``head_dim // 2`` of them), the number it divides that frequency by:
    the rope scaling of Llama 3.1 and later (llama.cpp's ``rope_freqs`` tensor), or a linear
    scaling's factor everywhere. None: plain rope."""
    rope_mscale: float = 1.0
    """A factor on cos and sin (Phi-3's long-rope ``attn_factor``; 1: none)."""
    sliding_window: int | None = None
    """Keys a windowed layer's token sees, itself included: the keys at positions ``p - w + 1``
    .. ``p`` (llama.cpp's standard sliding window). None: every layer sees the whole sequence."""
    window_layers: tuple[bool, ...] | None = None
    """Which layers are windowed (``num_layers`` flags); None with a ``sliding_window``: all."""
    rope_base_local: float | None = None
    """The rope base of the windowed layers (Gemma 3's 10000), which take neither ``rope_factors``
    nor ``rope_mscale``; None: the same rope as the other layers."""
    activation: str = "silu"
    """The gated MLP's activation: ``silu`` (SwiGLU) or ``gelu_tanh`` (Gemma's GeGLU)."""
    post_norms: bool = False
    """Gemma's RMS norms on the attention's and the MLP's outputs, before each residual add."""
    embed_scale: float | None = None
    """A factor on the token embeddings (Gemma: ``sqrt(dim)``); None: none."""
    attn_scale: float | None = None
    """The factor on attention scores; None: ``1 / sqrt(head_dim)``."""

    def __post_init__(self) -> None:
        if self.window_layers is not None:  # a list when read back from JSON
            object.__setattr__(self, "window_layers", tuple(bool(w) for w in self.window_layers))
            if len(self.window_layers) != self.num_layers or self.sliding_window is None:
                raise ValueError("ModelConfig.window_layers needs a sliding_window and one flag per layer")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or self.sliding_window <= 0):
            raise ValueError(f"ModelConfig.sliding_window must be a positive int, got {self.sliding_window!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"ModelConfig.activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        if self.rope_factors is not None:  # a list when read back from JSON
            object.__setattr__(self, "rope_factors", tuple(float(f) for f in self.rope_factors))
            if len(self.rope_factors) != self.head_dim // 2 or not all(f > 0 for f in self.rope_factors):
                raise ValueError(f"ModelConfig.rope_factors must be head_dim // 2 = {self.head_dim // 2} positive numbers")
        for name in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rope_base > 0:
            raise ValueError(f"ModelConfig.rope_base must be positive, got {self.rope_base}")
        if not self.norm_eps > 0:
            raise ValueError(f"ModelConfig.norm_eps must be positive, got {self.norm_eps}")

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (keys a token sees), or None for a global layer."""
        if self.sliding_window is None or (self.window_layers is not None and not self.window_layers[layer]):
            return None
        return self.sliding_window

    @property
    def windowed(self) -> bool:
        """True when some layer has a sliding window."""
        return any(self.window(i) is not None for i in range(self.num_layers))

    @property
    def local_rope(self) -> bool:
        """True when the windowed layers take a rope of their own (:func:`rope_tables` ``local``)."""
        return self.rope_base_local is not None and self.windowed


ACTIVATIONS = ("silu", "gelu_tanh")


def activation(name: str, x: Tensor) -> Tensor:
    """The gated MLP's activation ``name`` (:data:`ACTIVATIONS`) of ``x``."""
    return F.silu(x) if name == "silu" else F.gelu(x, approximate="tanh")


def rope_tables(config: ModelConfig, *, local: bool = False) -> tuple[Tensor, Tensor]:
    """Float32 cos/sin tables ``(max_seq_len, head_dim)`` for rotate-half RoPE (each frequency
    divided by its ``rope_factors`` entry and cos/sin times ``rope_mscale``, where the model has
    them); ``local``: the windowed layers' own rope (base ``rope_base_local``, plain)."""
    half = config.head_dim // 2
    base = config.rope_base_local if local and config.rope_base_local is not None else config.rope_base
    inv_freq = 1.0 / (base ** (torch.arange(half, dtype=torch.float64) / half))
    scaled = not (local and config.rope_base_local is not None)
    if config.rope_factors is not None and scaled:
        inv_freq = inv_freq / torch.tensor(config.rope_factors, dtype=torch.float64)
    angles = torch.arange(config.max_seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (P, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (P, hd)
    mscale = config.rope_mscale if scaled else 1.0
    return (angles.cos() * mscale).float(), (angles.sin() * mscale).float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE: x ``(B, n, T, hd)``, cos/sin ``(B, 1, T, hd)`` in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
