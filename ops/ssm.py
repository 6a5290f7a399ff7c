"""Distilled small speculative models (SSMs): architecture, speculator, weights file.

An SSM is a tiny LLaMA-style decoder that borrows the verifier's token embedding (shared,
frozen, never stored) as its input embedding, and scores only a *draft vocabulary*: ``K`` token
ids whose head rows are the verifier's (tied) embedding rows, plus a learned bias. Tokens
outside the draft vocabulary get logit ``-inf`` (drafting probability 0), which is fine for
greedy drafting and for multi-step speculative sampling alike. Only the blocks, the final
norm scale, the head bias and the ids are stored, in float16.

:class:`DistilledSpeculator` drafts a *greedy spine*: at depth ``d`` the node on the spine gets
``widths[d]`` children (greedy: the SSM's top tokens; otherwise i.i.d. draws from its ``q``) and
only the first child is extended. The spine's KV is committed to the SSM cache as it is
drafted, so each depth costs one 1-token forward, and :meth:`DistilledSpeculator.accept` keeps
the KV of the accepted spine prefix.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from treeserve.ops.drafting import Speculator, start_request, validate_expansion
from treeserve.ops.embedding import embedding_rows
from treeserve.ops.kv_cache import KVCache
from treeserve.ops.model import Block, Transformer
from treeserve.ops.model_config import ModelConfig
from treeserve.ops.sampling import SamplingParams, logits_to_probs, sample_from_probs
from treeserve.ops.token_tree import TokenTree, TokenTreeBuilder

DEFAULT_WIDTHS: tuple[int, ...] = (2, 1, 1, 1)
"""Default spine widths: two alternatives at depth 1, then a chain (4 deep). On 10 MT-Bench
prompts this (with the early stop below) accepted about as much as ``(2, 2, 1, 1, 1, 1)``
at 35% more tokens/s, since deeper drafts were rarely accepted."""

DEFAULT_MIN_CONFIDENCE = 0.3
"""Default greedy early stop: extend the spine only while the SSM's top probability is at least this."""


@dataclass(frozen=True)
class SSMConfig:
    """Shape of a distilled SSM: its decoder and the size of its draft vocabulary.

    ``vocab_size`` and ``dim`` must equal the verifier's (the embedding is shared).
    """

    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    draft_vocab_size: int
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        self.model_config()  # validates the decoder fields
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"SSMConfig.draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got {self.draft_vocab_size}"
            )

    def model_config(self) -> ModelConfig:
        """The :class:`ModelConfig` of the decoder (tied: the head is taken from the embedding)."""
        fields = {k: v for k, v in asdict(self).items() if k != "draft_vocab_size"}
        return ModelConfig(**fields, tie_embeddings=True)


class DistilledSSM(Transformer):
    """A :class:`Transformer` scoring only ``draft_ids`` (other tokens get ``-inf``).

    ``forward`` keeps the :class:`Transformer` contract (full-vocabulary float32 logits over a
    KV cache, chains or token trees) so any code that drives a Transformer can drive it;
    :meth:`draft_logits` returns the ``(B, T, K)`` logits over the draft vocabulary only (the
    cheap path used for drafting and training). Unlike the verifier, ``forward`` does not run
    under ``inference_mode``, so it can be trained; wrap inference in ``torch.no_grad``. The
    embedding module *is* the verifier's: moving or casting the SSM (``.to``) moves the
    verifier's embedding too, so build it in the verifier's dtype and device instead.
    """

    draft_ids: Tensor  # (K,) int64, ascending
    head_weight: Tensor  # (K, D): embedding rows of draft_ids (not stored)

    def __init__(self, config: SSMConfig, embedding: nn.Embedding) -> None:
        shape = (embedding.num_embeddings, embedding.embedding_dim)
        if shape != (config.vocab_size, config.dim):
            raise ValueError(f"the shared embedding is {shape}, the SSM needs ({config.vocab_size}, {config.dim})")
        # Build with a 1-token vocabulary so no full-size embedding is allocated, then adopt
        # the verifier's embedding and the real config.
        full = config.model_config()
        super().__init__(ModelConfig(**{**full.__dict__, "vocab_size": 1}))
        self.config = full
        self.ssm_config = config
        self.embed_tokens = embedding
        self.head_bias = nn.Parameter(torch.zeros(config.draft_vocab_size))
        self.register_buffer("draft_ids", torch.arange(config.draft_vocab_size), persistent=False)
        first = torch.arange(config.draft_vocab_size)
        self.register_buffer("head_weight", embedding_rows(embedding, first).clone(), persistent=False)

    def set_draft_ids(self, draft_ids: Tensor) -> None:
        """Use ``draft_ids`` (``K`` distinct ascending ids) as the draft vocabulary and its head rows."""
        ids = draft_ids.to(torch.long).reshape(-1).cpu()
        k, vocab = self.ssm_config.draft_vocab_size, self.ssm_config.vocab_size
        if ids.numel() != k or int(ids.min()) < 0 or int(ids.max()) >= vocab or bool((ids[1:] <= ids[:-1]).any()):
            raise ValueError(f"draft_ids must be {k} distinct ascending ids in [0, {vocab})")
        self.draft_ids = ids.to(self.head_weight.device)
        self.head_weight = embedding_rows(self.embed_tokens, self.draft_ids).clone()

    def stored_state_dict(self) -> dict[str, Tensor]:
        """The tensors a weights file stores: everything except the shared embedding."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}

    def hidden_states(
        self, tokens: Tensor, cache: KVCache, *, tree_mask: Tensor | None = None, positions: Tensor | None = None
    ) -> Tensor:
        """Final-normed hidden states ``(B, T, D)`` of the new tokens (same cache rules as forward)."""
        batch, num_new = tokens.shape
        if batch != cache.batch_size or cache.num_layers != len(self.layers):
            raise ValueError(f"cache (batch {cache.batch_size}, {cache.num_layers} layers) does not fit this SSM")
        h = self.run_blocks(self.embed(tokens), cache, positions, tree_mask)  # (B, T, D)
        return cast(Tensor, self.norm(h))

    def head(self, hidden: Tensor) -> Tensor:
        """Draft-vocabulary logits ``(..., K)`` (float32) of final-normed hidden states."""
        return (F.linear(hidden, self.head_weight) + self.head_bias).float()

    def draft_logits(
        self, tokens: Tensor, cache: KVCache, *, tree_mask: Tensor | None = None, positions: Tensor | None = None
    ) -> Tensor:
        """Logits ``(B, T, K)`` over the draft vocabulary (index ``i`` is token ``draft_ids[i]``)."""
        return self.head(self.hidden_states(tokens, cache, tree_mask=tree_mask, positions=positions))

    def to_full_vocab(self, draft_logits: Tensor) -> Tensor:
        """Scatter ``(..., K)`` draft logits into ``(..., V)`` full-vocabulary logits, ``-inf`` elsewhere."""
        shape = (*draft_logits.shape[:-1], self.ssm_config.vocab_size)
        full = torch.full(shape, float("-inf"), dtype=draft_logits.dtype, device=draft_logits.device)
        full[..., self.draft_ids] = draft_logits
        return full

    def forward(  # type: ignore[override]
        self,
        tokens: Tensor,
        cache: KVCache,
        *,
        tree_mask: Tensor | None = None,
        positions: Tensor | None = None,
        return_hidden: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        hidden = self.hidden_states(tokens, cache, tree_mask=tree_mask, positions=positions)
        logits = self.to_full_vocab(self.head(hidden))  # (B, T, V)
        return (logits, hidden) if return_hidden else logits


def ssm_config_for(verifier: Transformer, *, num_layers: int = 1, ffn_dim: int = 1024, draft_vocab_size: int = 4096) -> SSMConfig:
    """An :class:`SSMConfig` with the verifier's width, heads and RoPE, and the given depth/FFN/vocab."""
    c = verifier.config
    return SSMConfig(
        vocab_size=c.vocab_size, dim=c.dim, num_layers=num_layers, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim, ffn_dim=ffn_dim, draft_vocab_size=draft_vocab_size, rope_base=c.rope_base,
        norm_eps=c.norm_eps, max_seq_len=c.max_seq_len,
    )


def init_ssm_from_verifier(
    verifier: Transformer, config: SSMConfig, draft_ids: Tensor, *, layer_indices: Sequence[int] | None = None
) -> DistilledSSM:
    """An SSM whose blocks copy verifier blocks ``layer_indices`` (default: the first ones).

    A narrower FFN keeps the ``ffn_dim`` hidden units with the largest
    ``|gate row| * |up row| * |down column|``. The final norm is the verifier's; the head bias is 0.
    """
    if verifier.config.qkv_bias:
        raise ValueError("init_ssm_from_verifier supports verifiers without q/k/v bias")
    indices = list(range(config.num_layers)) if layer_indices is None else [int(i) for i in layer_indices]
    if len(indices) != config.num_layers or not all(0 <= i < verifier.config.num_layers for i in indices):
        raise ValueError(f"layer_indices must name {config.num_layers} verifier layers, got {indices}")
    if config.ffn_dim > verifier.config.ffn_dim:
        raise ValueError(f"SSM ffn_dim {config.ffn_dim} exceeds the verifier's {verifier.config.ffn_dim}")
    ssm = DistilledSSM(config, verifier.embed_tokens).to(verifier.dtype)
    with torch.no_grad():
        for target, index in zip(ssm.layers, indices):
            source = cast(Block, verifier.layers[index])
            block = cast(Block, target)
            for name in ("input_layernorm", "post_attention_layernorm", "self_attn"):
                getattr(block, name).load_state_dict(getattr(source, name).state_dict())
            gate, up, down = source.mlp.gate_proj.weight, source.mlp.up_proj.weight, source.mlp.down_proj.weight
            score = gate.float().norm(dim=1) * up.float().norm(dim=1) * down.float().norm(dim=0)  # (F,)
            keep = torch.topk(score, config.ffn_dim).indices.sort().values
            block.mlp.gate_proj.weight.copy_(gate[keep])
            block.mlp.up_proj.weight.copy_(up[keep])
            block.mlp.down_proj.weight.copy_(down[:, keep])
        ssm.norm.weight.copy_(verifier.norm.weight)
    ssm.set_draft_ids(draft_ids)
    return ssm.eval()


# --------------------------------------------------------------------------- speculator


def fit_spine_widths(
    widths: Sequence[int], max_depth: int | None, max_nodes: int | None, max_spine_depth: int
) -> tuple[int, ...]:
    """The spine widths a proposal may use, cut before any draw (so the cut never depends on
    the draws): at most ``max_depth`` and ``max_spine_depth`` (the drafter cache's room) deep,
    and at most ``max_nodes`` nodes (``1 + sum(widths)``, root included). A node budget below
    the full spine keeps the chain of first choices as deep as it fits, then gives the rest to
    the alternatives, shallowest first: ``(4, 2, 1)`` in 4 nodes is ``(1, 1, 1)``, in 6 is
    ``(3, 1, 1)`` (a first draft is the likeliest to be accepted, and its alternatives next)."""
    cut = tuple(widths) if max_depth is None else tuple(widths)[: max(max_depth, 0)]
    cut = cut[: max(max_spine_depth, 0)]
    if max_nodes is None or 1 + sum(cut) <= max_nodes:
        return cut
    drafted = max(max_nodes - 1, 0)
    fitted = [1] * min(len(cut), drafted)
    spare = drafted - len(fitted)
    for depth, width in enumerate(cut[: len(fitted)]):
        extra = min(width - 1, spare)
        fitted[depth] += extra
        spare -= extra
    return tuple(fitted)


def add_spine_children(
    builder: TokenTreeBuilder,
    node: int,
    draft_logits: Tensor,
    draft_ids: Tensor,
    to_full_vocab: Callable[[Tensor], Tensor],
    params: SamplingParams,
    generator: torch.Generator | None,
    width: int,
) -> int:
    """Give ``node`` ``width`` proposals from draft-vocabulary logits ``(K,)``: greedy, the top
    tokens; otherwise i.i.d. draws from ``q`` (recorded with each proposal, as multi-step
    speculative sampling needs). Returns the first child, where the spine continues."""
    width = min(width, draft_logits.numel())
    if params.is_greedy:
        picks = draft_ids[torch.topk(draft_logits, width).indices].tolist()
        return [builder.add_proposal(node, t) for t in picks][0]
    q = logits_to_probs(to_full_vocab(draft_logits).cpu(), params)  # (V,), zero outside the draft vocabulary
    q_row = builder.add_probs(q)
    # Draw over the draft vocabulary only: the same distribution, at K/V of the sampler's cost.
    ids = draft_ids.cpu()
    draws = ids[sample_from_probs(q[ids][None], generator, width)[0]].tolist()
    return [builder.add_proposal(node, t, q_row=q_row) for t in draws][0]


class DistilledSpeculator:
    """Greedy-spine tree drafting with a :class:`DistilledSSM` (the Speculator protocol).

    ``widths[d]``: children proposed at the spine node of depth ``d`` (greedy params: the
    SSM's top-``w`` tokens; otherwise ``w`` i.i.d. draws from its ``q``, each its own
    proposal); the first child continues the spine. A tree has at most ``1 + sum(widths)``
    nodes; ``max_depth``/``max_nodes`` cut the widths before any draw. With greedy params the
    spine also stops at a node whose most likely child has SSM probability under ``min_confidence``
    (a deterministic function of the drafted path, so greedy verification is unaffected; it
    saves SSM steps and verifier tree nodes where the SSM is unsure). The SSM cache holds a
    prefix of the request's tokens followed by the last spine; :meth:`accept` keeps the spine
    KV that matches the emitted tokens.
    """

    def __init__(self, ssm: DistilledSSM, widths: Sequence[int] = DEFAULT_WIDTHS, *, capacity: int | None = None,
                 min_confidence: float = DEFAULT_MIN_CONFIDENCE) -> None:
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {min_confidence}")
        self.ssm = ssm
        self.widths = validate_expansion(widths)
        self.min_confidence = min_confidence
        self._capacity = capacity
        self._cache: KVCache | None = None
        self._history: list[int] = []
        self._spine: list[int] = []  # drafted spine tokens whose KV sits after the history

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        """Start a request with ``prompt_ids`` (non-empty); the KV is computed lazily by propose."""
        self._cache, self._history = start_request(self._cache, self.ssm, self._capacity, prompt_ids)
        self._spine = []

    def propose(
        self,
        params: SamplingParams,
        generator: torch.Generator | None,
        max_depth: int | None = None,
        max_nodes: int | None = None,
    ) -> TokenTree:
        """Draft a greedy-spine tree rooted at the last token seen (see the class docstring)."""
        if self._cache is None or not self._history:
            raise RuntimeError("DistilledSpeculator.prefill must be called before propose")
        cache, ssm = self._cache, self.ssm
        device = ssm.device
        is_greedy = params.is_greedy
        builder = TokenTreeBuilder(self._history[-1], with_probs=not is_greedy)
        with torch.no_grad():
            start = min(int(cache.lengths[0]), len(self._history) - 1)
            cache.truncate(0, start)
            feed = self._history[start:]  # ends with the root
            logits = ssm.draft_logits(torch.tensor([feed], dtype=torch.long, device=device), cache)[0, -1]  # (K,)
            cache.commit(0, range(len(feed)))
            self._spine = []
            # Depth D feeds D - 1 spine tokens into the cache.
            widths = fit_spine_widths(self.widths, max_depth, max_nodes, cache.capacity - int(cache.lengths[0]) + 1)
            node = 0
            for depth, width in enumerate(widths):
                if depth > 0:  # feed the spine node to get its next-token logits
                    token = builder.token_of(node)
                    logits = ssm.draft_logits(torch.tensor([[token]], dtype=torch.long, device=device), cache)[0, -1]
                    cache.commit(0, [0])
                    self._spine.append(token)
                node = add_spine_children(builder, node, logits, ssm.draft_ids, ssm.to_full_vocab, params,
                                          generator, width)
                # Greedy early stop: extending a spine child the SSM doubts rarely pays for its cost.
                if is_greedy and self.min_confidence > 0 and float(torch.softmax(logits, -1).max()) < self.min_confidence:
                    break
        return builder.build()

    def accept(self, new_tokens: Sequence[int]) -> None:
        """Append the emitted tokens; keep the spine KV equal to their prefix."""
        if self._cache is None:
            raise RuntimeError("DistilledSpeculator.prefill must be called before accept")
        new = [int(t) for t in new_tokens]
        matched = 0
        while matched < min(len(new), len(self._spine)) and new[matched] == self._spine[matched]:
            matched += 1
        # The cache holds the history then the spine: a spine token equal to the emitted token at
        # its place has the same prefix, hence the same KV.
        self._cache.truncate(0, min(int(self._cache.lengths[0]), len(self._history) + matched))
        self._history.extend(new)
        self._spine = []


# --------------------------------------------------------------------------- weights file


def save_ssms(ssms: Sequence[DistilledSSM], path: str | Path, *, metadata: dict[str, object] | None = None) -> None:
    """Write ``ssms`` (same config and draft vocabulary) to one float16 safetensors file."""
    from safetensors.torch import save_file

    if not ssms:
        raise ValueError("save_ssms needs at least one SSM")
    config = ssms[0].ssm_config
    if any(s.ssm_config != config or not torch.equal(s.draft_ids.cpu(), ssms[0].draft_ids.cpu()) for s in ssms):
        raise ValueError("all SSMs in one file must share the config and the draft vocabulary")
    tensors: dict[str, Tensor] = {"draft_ids": ssms[0].draft_ids.cpu().to(torch.int32).contiguous()}
    for j, ssm in enumerate(ssms):
        for name, value in ssm.stored_state_dict().items():
            tensors[f"ssm{j}.{name}"] = value.detach().cpu().to(torch.float16).contiguous()
    meta = {"config": json.dumps(asdict(config)), "num_ssms": str(len(ssms)), "extra": json.dumps(metadata or {})}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.chmod(0o644)  # a shipped data file, readable by all
    tmp.replace(path)


def load_ssms(verifier: Transformer, path: str | Path) -> list[DistilledSSM]:
    """Load the SSMs of a :func:`save_ssms` file onto ``verifier``'s embedding, in its dtype."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no distilled SSM weights at {path} (train them with `treeserve distill`)")
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata() or {}
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    config = SSMConfig(**json.loads(meta["config"]))
    if (config.vocab_size, config.dim) != (verifier.config.vocab_size, verifier.config.dim):
        raise ValueError(
            f"{path} was distilled for vocab {config.vocab_size} / dim {config.dim}, the verifier has "
            f"{verifier.config.vocab_size} / {verifier.config.dim}"
        )
    ssms: list[DistilledSSM] = []
    for j in range(int(meta["num_ssms"])):
        ssm = DistilledSSM(config, verifier.embed_tokens).to(verifier.dtype)
        prefix = f"ssm{j}."
        state = {k[len(prefix):]: v.to(verifier.dtype) for k, v in tensors.items() if k.startswith(prefix)}
        ssm.load_state_dict(state, strict=False)
        missing = set(ssm.stored_state_dict()) - set(state)
        if missing:
            raise ValueError(f"{path} lacks SSM {j} tensors {sorted(missing)}")
        ssm.set_draft_ids(tensors["draft_ids"].to(torch.long))
        ssm.requires_grad_(False)
        ssms.append(ssm.eval())
    return ssms


def load_distilled_speculators(
    model: Transformer, path: str | Path, expansion: Sequence[int] | None = None, *,
    min_confidence: float = DEFAULT_MIN_CONFIDENCE,
) -> list[Speculator]:
    """One :class:`DistilledSpeculator` per SSM in ``path``, a :func:`save_ssms` file (none is
    shipped: they do not pay off on the default model; ``treeserve distill`` trains them).

    ``expansion`` is the spine widths (default :data:`DEFAULT_WIDTHS`); ``min_confidence`` the
    greedy early stop of :class:`DistilledSpeculator`. Raises
    ``FileNotFoundError`` when there is no weights file, ``ValueError`` when it does not fit
    ``model``. Merge the speculators' trees (``generate_speculative`` does) to use them together.
    """
    ssms = load_ssms(model, path)
    widths = DEFAULT_WIDTHS if expansion is None else tuple(expansion)
    return [DistilledSpeculator(ssm, widths, min_confidence=min_confidence) for ssm in ssms]
