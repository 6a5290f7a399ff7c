"""A feature-level drafter (in the style of EAGLE): drafts from the LLM's own hidden states.

The LLM's final (normed) hidden state ``f_t`` at token ``t`` is what its LM head turns into
the next-token distribution. The drafter learns one step of the LLM's hidden-state dynamics:
from ``(f_t, x_{t+1})`` (the state and the next token's embedding, fused by a linear layer) one
decoder block predicts ``f_{t+1}``, which the LLM's head (restricted to a draft vocabulary of
its rows) turns into the draft of ``x_{t+2}``. Feeding predicted states back in drafts deeper.
Knowing the LLM's true state of every token it has verified makes the first draft step very
accurate; a token-only small model has to guess it.

:class:`~treeserve.ops.feature_speculator.FeatureSpeculator` follows the speculator protocol plus ``uses_features = True``:
``generate_speculative`` (and the serving path) call :meth:`~treeserve.ops.feature_speculator.FeatureSpeculator.add_features`
with the LLM's states of the tokens it processed, in order. The drafter's KV cache holds one
entry per consecutive pair ``(f_i, x_{i+1})`` with true states; each proposal adds the pairs
that became known, then drafts a greedy spine (``widths[d]`` children at depth ``d``, the first
extended) with predicted states, whose KV is dropped at the next proposal.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from treeserve.ops.decode_step import CompiledStep, artifact_name, begin_step, blocks_hidden
from treeserve.ops.embedding import embedding_rows
from treeserve.ops.formats import WeightFormat
from treeserve.ops.linears import Q8Linear, q8_buffers
from treeserve.ops.kernels import q8_amx
from treeserve.ops.kv_cache import KVCache
from treeserve.ops.model import Block, Transformer
from treeserve.ops.model_config import ModelConfig
from treeserve.ops.ssm import SSMConfig

DEFAULT_FEATURE_DRAFTER_FILE = Path(__file__).parent / "data" / "feature_drafter_smollm2-135m-instruct.safetensors"
"""The shipped feature drafter of the default model (``treeserve distill-features`` writes it)."""

_FORMAT = "treeserve-feature-drafter-1"


class FeatureDrafter(Transformer):
    """Predicts the LLM's next hidden state from ``(state, next token)``; scores a draft vocabulary.

    It shares the LLM's token embedding (frozen, never stored) and uses the LLM's LM-head rows
    of ``draft_ids`` as its head (``head_weight``: the LLM's head matrix; default the embedding,
    for tied models).
    :meth:`features` runs over a KV cache like :meth:`Transformer.forward` (chains and token
    trees; no ``inference_mode``, so it trains); :meth:`head` gives draft-vocabulary logits.
    """

    draft_ids: Tensor  # (K,) int64, ascending
    head_weight: Tensor  # (K, D)

    def __init__(self, config: SSMConfig, embedding: nn.Embedding, head_weight: Tensor | None = None) -> None:
        shape = (embedding.num_embeddings, embedding.embedding_dim)
        if shape != (config.vocab_size, config.dim):
            raise ValueError(f"the shared embedding is {shape}, the drafter needs ({config.vocab_size}, {config.dim})")
        full = config.model_config()
        super().__init__(ModelConfig(**{**full.__dict__, "vocab_size": 1}))  # no full-size embedding
        self.config = full
        self.drafter_config = config
        self.embed_tokens = embedding
        self.fc = nn.Linear(2 * config.dim, config.dim, bias=True)
        if head_weight is not None and head_weight.shape != (config.vocab_size, config.dim):
            raise ValueError(f"the LM head is {tuple(head_weight.shape)}, the drafter needs ({config.vocab_size}, {config.dim})")
        # The full head's rows come from the embedding (tied) or head_weight: a list, so that it
        # is not a submodule or buffer and is never stored.
        self._full_head: list[nn.Module | Tensor] = [embedding if head_weight is None else head_weight]
        self.register_buffer("draft_ids", torch.arange(config.draft_vocab_size), persistent=False)
        self.register_buffer("head_weight", self._head_rows(torch.arange(config.draft_vocab_size)), persistent=False)
        self.draft_step: DraftStep | None = None  # formatted (format_drafter), compiled by compile_draft_step

    def _head_rows(self, ids: Tensor) -> Tensor:
        """Rows ``ids`` of the full LM head, a copy."""
        source = self._full_head[0]
        if isinstance(source, Tensor):
            return source.detach()[ids.to(source.device)].clone()
        return embedding_rows(source, ids).clone()

    def set_draft_ids(self, draft_ids: Tensor) -> None:
        """Use ``draft_ids`` (``K`` distinct ascending ids) as the draft vocabulary."""
        ids = draft_ids.to(torch.long).reshape(-1).cpu()
        k, vocab = self.drafter_config.draft_vocab_size, self.drafter_config.vocab_size
        if ids.numel() != k or int(ids.min()) < 0 or int(ids.max()) >= vocab or bool((ids[1:] <= ids[:-1]).any()):
            raise ValueError(f"draft_ids must be {k} distinct ascending ids in [0, {vocab})")
        self.draft_ids = ids.to(self.head_weight.device)
        self.head_weight = self._head_rows(self.draft_ids).to(self.head_weight.dtype)
        if self.head_kernel is not None:  # formatted: the head's codes follow the rows
            self.head_kernel = Q8Linear(q8_buffers(self.head_weight.float()), k)

    def features(
        self, states: Tensor, tokens: Tensor, cache: KVCache, *,
        tree_mask: Tensor | None = None, positions: Tensor | None = None, slot_mask: Tensor | None = None,
    ) -> Tensor:
        """Predicted next states ``(B, T, D)`` from ``states`` ``(B, T, D)`` and ``tokens`` ``(B, T)``
        (the token following each state), appended to ``cache`` as pending slots."""
        batch, num_new = tokens.shape
        if states.shape != (batch, num_new, self.drafter_config.dim):
            raise ValueError(f"states must be (B, T, D) = {(batch, num_new, self.drafter_config.dim)}, "
                             f"got {tuple(states.shape)}")
        if batch != cache.batch_size or cache.num_layers != len(self.layers):
            raise ValueError(f"cache (batch {cache.batch_size}, {cache.num_layers} layers) does not fit this drafter")
        if self.draft_step is not None and slot_mask is None:  # formatted (format_drafter), or captured: serving only
            return self.draft_step(states, tokens, cache, tree_mask, positions)
        return self.eager_features(states, tokens, cache, tree_mask=tree_mask, positions=positions, slot_mask=slot_mask)

    def eager_features(
        self, states: Tensor, tokens: Tensor, cache: KVCache, *,
        tree_mask: Tensor | None = None, positions: Tensor | None = None, slot_mask: Tensor | None = None,
    ) -> Tensor:
        """:meth:`features` op by op, whatever ``draft_step`` is attached (inputs unchecked)."""
        h = self.run_blocks(self.fuse(states, tokens), cache, positions, tree_mask, slot_mask)
        return cast(Tensor, self.norm(h))

    def fuse(self, states: Tensor, tokens: Tensor) -> Tensor:
        """The block's input states ``(B, T, D)``: the fusion of the LLM's ``states`` with the
        embeddings of ``tokens`` (the embedding is the LLM's, frozen)."""
        return cast(Tensor, self.fc(torch.cat([states.to(self.dtype), self.embed_tokens(tokens).detach()], dim=-1)))

    def head(self, states: Tensor) -> Tensor:
        """Draft-vocabulary logits ``(..., K)`` (float32) of (predicted) states."""
        if self.head_kernel is not None:
            return cast(Tensor, self.head_kernel(states.to(self.dtype)))
        return F.linear(states, self.head_weight).float()

    def to_full_vocab(self, draft_logits: Tensor) -> Tensor:
        """Scatter ``(..., K)`` draft logits into ``(..., V)`` logits, ``-inf`` outside the draft vocabulary."""
        shape = (*draft_logits.shape[:-1], self.drafter_config.vocab_size)
        full = torch.full(shape, float("-inf"), dtype=draft_logits.dtype, device=draft_logits.device)
        full[..., self.draft_ids] = draft_logits
        return full

    def stored_state_dict(self) -> dict[str, Tensor]:
        """What a weights file stores: everything but the shared embedding."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}


def format_drafter(drafter: FeatureDrafter) -> FeatureDrafter:
    """Put a bfloat16 drafter's linears and draft head on the Q8_0 kernel (Q/K/V and gate/up
    fused, as :func:`~treeserve.ops.formats.apply_format` does for a model), in place, where
    that kernel runs and the shapes fit its 32-wide blocks; else leave it as it is.

    The int formats' verify step is 4-bit and fast, so the drafter's eager bf16 linears and
    torch's attention (a few ms a proposal here) would eat what speculation wins: formatted, a
    draft forward runs :func:`~treeserve.ops.decode_step.blocks_hidden` (the verifier's fused
    attention and cache writes) on Q8_0 weights (about 0.5% error a linear), inference only.
    """
    if drafter.dtype != torch.bfloat16 or not drafter.fc.weight.is_cpu or drafter.head_kernel is not None:
        return drafter
    config = drafter.config
    qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    shapes = [(config.dim, 2 * config.dim), tuple(drafter.head_weight.shape), (qkv_rows, config.dim),
              (config.dim, config.num_heads * config.head_dim), (2 * config.ffn_dim, config.dim),
              (config.dim, config.ffn_dim)]  # fc, head, qkv, o, gate|up, down
    if not q8_amx.available() or not all(q8_amx.supports(n, k) for n, k in shapes):
        return drafter

    def q8(parts: list[nn.Linear]) -> Q8Linear:
        weight = torch.cat([p.weight.detach().float() for p in parts])
        bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts if p.bias is not None])
        return Q8Linear(q8_buffers(weight), weight.shape[0], bias=bias, out_dtype=torch.bfloat16)

    for module in drafter.layers:
        block = cast(Block, module)
        attn, mlp = block.self_attn, block.mlp
        attn.qkv_proj = q8([attn.q_proj, attn.k_proj, attn.v_proj])
        mlp.gate_up_proj = q8([mlp.gate_proj, mlp.up_proj])
        attn.o_proj = cast(nn.Linear, q8([attn.o_proj]))
        mlp.down_proj = cast(nn.Linear, q8([mlp.down_proj]))
        for name in ("q_proj", "k_proj", "v_proj"):
            delattr(attn, name)
        for name in ("gate_proj", "up_proj"):
            delattr(mlp, name)
    drafter.fc = cast(nn.Linear, q8([drafter.fc]))
    drafter.head_kernel = Q8Linear(q8_buffers(drafter.head_weight.float()), drafter.head_weight.shape[0])
    drafter.draft_step = DraftStep(drafter)  # eager until compile_draft_step
    return drafter


def draft_hidden(drafter: FeatureDrafter, states: Tensor, tokens: Tensor, positions: Tensor, tree_mask: Tensor,
                 lengths: Tensor, keys: list[Tensor], values: list[Tensor], num_slots: Tensor) -> Tensor:
    """A formatted drafter's predicted states ``(B, T, D)``: the fusion of ``states`` and the
    embeddings of ``tokens``, then its block as :func:`~treeserve.ops.decode_step.step_hidden`
    runs the verifier's (the same arguments after ``tokens``)."""
    return blocks_hidden(drafter, drafter.fuse(states, tokens), positions, tree_mask, lengths, keys, values, num_slots)


class DraftStep(CompiledStep):
    """``step(states (B, T, D), tokens (B, T), cache, tree_mask, positions) -> (B, T, D)``: a
    formatted drafter's forward (:func:`draft_hidden`), compiled ahead of time and saved as the
    verifier's decode step is (:class:`~treeserve.ops.decode_step.CompiledStep`). Eagerly, a
    draft forward is about 60 small ops in Python around its five Q8_0 products; a proposal
    runs three forwards (3.4 ms eager, 2.2 ms compiled for the default model's drafter on
    the AVX2 host, beside a 6.6 ms step: ``bench/RESULTS.md``)."""

    what = "draft step"
    function = staticmethod(draft_hidden)

    def _example_args(self) -> tuple[object, ...]:
        cache, positions, tree_mask, num_slots = self._example_cache()
        tokens = torch.zeros(2, 2, dtype=torch.long, device=cache.device)
        states = torch.zeros(2, 2, self.model.config.dim, dtype=self.model.dtype, device=cache.device)
        for tensor in (tokens, states):
            torch._dynamo.mark_dynamic(tensor, 0)
            torch._dynamo.mark_dynamic(tensor, 1)
        return (self.model, states, tokens, positions, tree_mask, cache.lengths, cache.keys, cache.values, num_slots)

    @torch.inference_mode()
    def __call__(self, states: Tensor, tokens: Tensor, cache: KVCache, tree_mask: Tensor | None = None,
                 positions: Tensor | None = None) -> Tensor:
        # A catch-up of more pairs than the step takes (a long prompt's first proposal) runs
        # the same function eagerly.
        num_new = tokens.shape[1]
        self._check(tokens[:, :self.max_new], cache)
        positions, tree_mask, num_slots = begin_step(cache, tokens.shape[0], num_new, tree_mask, positions)
        args = (states.to(self.model.dtype).contiguous(), tokens.contiguous(), positions, tree_mask,
                cache.lengths, cache.keys, cache.values, num_slots)
        return self._call(*args) if num_new <= self.max_new else draft_hidden(self.model, *args)


def compile_draft_step(drafter: FeatureDrafter, cache_dir: str | Path | None = None, *,
                       background: bool = False) -> FeatureDrafter:
    """Attach a formatted drafter's compiled :class:`DraftStep`, saved under
    ``<cache>/compiled`` beside the verifier's step (compiled once per drafter shape, format
    and torch build: about 25 s for the default model's, beside other work; loaded in well
    under a second later).
    ``background``: compile on a thread while drafting runs eagerly (a speculator actor; a
    saved step is loaded at once). An unformatted drafter, a failed compile or a GPU device
    leaves drafting eager."""
    from treeserve.ops.loaders.registry import resolve_cache_dir

    if drafter.draft_step is None or drafter.draft_step.artifact is not None or drafter.device.type != "cpu":
        return drafter
    compiled_dir = resolve_cache_dir(cache_dir) / "compiled"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compiled_dir / "inductor"))
    name = artifact_name(drafter, kind="draft", weight_format="q8_0", extra_files=(Path(__file__),))
    step = DraftStep(drafter, artifact=compiled_dir / name)
    if step.attach(background=background):
        drafter.draft_step = step
    return drafter


def _untied_head(verifier: Transformer) -> Tensor | None:
    """The verifier's LM head matrix, or None where it is the embedding (tied: its rows are read
    from the embedding, which may be the head's own codes, :mod:`~treeserve.ops.embedding`)."""
    return None if verifier.lm_head is None else verifier.lm_head.weight


def init_feature_drafter(verifier: Transformer, config: SSMConfig, draft_ids: Tensor) -> FeatureDrafter:
    """A drafter whose block copies the verifier's last one and whose fusion starts as
    "embedding plus a little state", so training starts from a sensible point."""
    drafter = FeatureDrafter(config, verifier.embed_tokens, _untied_head(verifier)).to(verifier.dtype)
    if config.ffn_dim != verifier.config.ffn_dim or config.num_layers < 1:
        raise ValueError("init_feature_drafter copies verifier blocks: use the verifier's ffn_dim")
    with torch.no_grad():
        for offset, target in enumerate(drafter.layers):
            source = verifier.layers[verifier.config.num_layers - len(drafter.layers) + offset]
            target.load_state_dict(source.state_dict())
        drafter.norm.weight.copy_(verifier.norm.weight)
        dim = config.dim
        drafter.fc.weight.zero_()
        drafter.fc.bias.zero_()
        drafter.fc.weight[:, dim:] = torch.eye(dim)
        drafter.fc.weight[:, :dim] = 0.1 * torch.eye(dim)
    drafter.set_draft_ids(draft_ids)
    return drafter.eval()


def save_feature_drafter(drafter: FeatureDrafter, path: str | Path, *, metadata: dict[str, object] | None = None) -> None:
    """Write a safetensors file (float16 weights, the draft ids, config and metadata as JSON)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to(torch.float16).contiguous().cpu() for k, v in drafter.stored_state_dict().items()}
    tensors["draft_ids"] = drafter.draft_ids.to(torch.int64).cpu()
    header = {"format": _FORMAT, "config": json.dumps(asdict(drafter.drafter_config)),
              "metadata": json.dumps(metadata or {})}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=header)


def load_feature_drafter(verifier: Transformer, path: str | Path | None = None) -> FeatureDrafter:
    """Load a drafter written by :func:`save_feature_drafter` onto ``verifier``'s embedding, dtype
    and device (``None``: the shipped one). ``FileNotFoundError`` when absent; ``ValueError``
    when it was trained for a model of another shape."""
    from safetensors import safe_open

    file = Path(path) if path is not None else DEFAULT_FEATURE_DRAFTER_FILE
    if not file.is_file():
        raise FileNotFoundError(f"no feature drafter at {file} (train one with treeserve distill-features)")
    with safe_open(str(file), framework="pt") as handle:
        header = handle.metadata() or {}
        if header.get("format") != _FORMAT:
            raise ValueError(f"{file} is not a treeserve feature drafter (format {header.get('format')!r})")
        config = SSMConfig(**json.loads(header["config"]))
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118 - safe_open has no iterator
    if (config.vocab_size, config.dim) != (verifier.config.vocab_size, verifier.config.dim):
        raise ValueError(f"{file} drafts for vocab {config.vocab_size} / width {config.dim}, the model has "
                         f"{verifier.config.vocab_size} / {verifier.config.dim}")
    drafter = FeatureDrafter(config, verifier.embed_tokens, _untied_head(verifier))
    draft_ids = tensors.pop("draft_ids")
    drafter.load_state_dict(tensors, strict=False)
    missing = {k for k in drafter.stored_state_dict() if k not in tensors}
    if missing:
        raise ValueError(f"{file} lacks tensors {sorted(missing)}")
    drafter = drafter.to(device=verifier.device, dtype=verifier.dtype)
    drafter.set_draft_ids(draft_ids)
    if verifier.weight_format is not None and WeightFormat(verifier.weight_format).is_int:
        format_drafter(drafter)
    return drafter.eval()
