"""The decode step with static shapes, built for ``torch.compile``: one token per row, or a
token tree of up to 64 nodes.

A decode step (every row adds one token) is the forward that batch-1 latency, adaptive
speculation's fallback and large batches run, and a tree of a few dozen nodes is the
verifier's step. In eager mode their ~1,500 small ops cost more than their weight reads.
:class:`DecodeStep` runs them as one function of tensors only:

* the KV cache is the model's preallocated :class:`~treeserve.ops.kv_cache.KVCache` storage,
  written in place after each row's committed tokens by an opaque op (no host read of the
  lengths in the graph, no per-row Python loop; an indexed store would be compiled into a copy
  of the whole cache per step);
* attention is the tree-mask kernel of :mod:`~treeserve.ops.kernels.tree_attention_cpu` on
  CPUs with AVX-512: each row reads only its own committed slots and its tree-visible new
  ones, under no dense mask. Elsewhere it is torch's fused attention over slots
  ``[0, num_slots)``, ``num_slots = max(lengths) + T``, under a ``(B, 1, T, S)`` mask built
  once from the tree mask. The row count ``B``, the new tokens ``T`` and the slots ``S`` are
  symbolic, so neither a growing sequence nor another batch or tree size recompiles
  (gpt-fast's ``decode_one_token``, with a dynamic instead of a maximal slot count so the
  attention reads only the slots in use);
* the compiled function is saved to one file (``torch.compile``'s ``aot_compile``), so a
  second start loads it in a few seconds instead of tracing and compiling (75-180 s for the
  default model on 2 cores, as measured).

The step computes what ``Transformer.forward`` computes for the same tokens, with the same
kernels (one set of weight values), so it can replace it anywhere. Prefills of more than 64
tokens stay eager: their ops are few per token, and their time is in the matrix products.

Where the model fits :meth:`DecodeStep.fuse` (the q4_1 format on a CPU with AVX2, the CLI's
default), none of the above runs: every forward of the model, prefills of any length included,
goes through the one C++ op of :mod:`~treeserve.ops.kernels.decode_layers`, whose rows do not
depend on each other, and nothing is compiled (``--compile`` changes nothing there).
"""


from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
from torch import Tensor

from treeserve.ops import fused_step
from treeserve.ops.kernels import tree_attention_cpu, tree_attention_cuda
from treeserve.ops.kv_cache import KVCache, write_pending
from treeserve.ops.model import Block, Transformer
from treeserve.ops.model_config import apply_rope
from treeserve.ops.tree_attention import attention_under_mask, build_attention_mask, window_mask

logger = logging.getLogger(__name__)

PREFILL_PIECE = 256
"""New tokens per row the fused op takes in one call of a causal chain (longer prefills run in
pieces of it)."""

MAX_NEW_TOKENS = 64
"""The most new tokens per row the step takes (the verifier's largest trees); longer inputs are
prefills, which the eager forward runs with torch's flash attention."""


def step_hidden(
    model: Transformer, tokens: Tensor, positions: Tensor, tree_mask: Tensor, lengths: Tensor,
    keys: list[Tensor], values: list[Tensor], num_slots: Tensor,
) -> Tensor:
    """Final-normed hidden states ``(B, T, D)`` of ``T`` new tokens per row (a one-token decode,
    a token tree or a short chain); writes their K/V at slots ``lengths[b] + t``. The LM head
    runs outside (eagerly, on the format's prepacked kernel).

    ``tokens``/``positions`` ``(B, T)``, ``tree_mask`` ``(B, T, T)`` bool (new token ``t``
    sees new token ``s`` iff set; a chain passes the lower triangle), ``lengths`` ``(B,)`` long
    (committed lengths, not advanced here), ``keys``/``values`` the cache's per-layer
    ``(B, n_kv, C, hd)`` storage, and ``num_slots`` a ``(S,)`` tensor whose *length* is
    ``max(lengths) + T`` (a shape, so compiling keeps it symbolic). Pure tensor code: no host
    reads, no data-dependent branches.
    """
    return blocks_hidden(model, model.embed(tokens), positions, tree_mask, lengths, keys, values, num_slots)


def blocks_hidden(
    model: Transformer, h: Tensor, positions: Tensor, tree_mask: Tensor, lengths: Tensor,
    keys: list[Tensor], values: list[Tensor], num_slots: Tensor, *,
    write_at: Tensor | None = None, ancestor_bits: Tensor | None = None,
) -> Tensor:
    """:func:`step_hidden` from the first block's input states ``h`` ``(B, T, D)`` instead of
    tokens (a feature drafter feeds its own); the same arguments otherwise.

    A captured step (:mod:`~treeserve.ops.graph_step`) adds two: ``write_at`` ``(B,)``, where
    each row's new K/V go when that is not ``lengths`` (its padding rows write into the cache's
    headroom and attend over nothing), and ``ancestor_bits`` ``(B, T)``, the tree as words for
    the CUDA tree kernel, which then attends straight from the cache (no mask; its launch is
    planned for ``num_slots`` keys, so one captured launch serves every length)."""
    write_at = lengths if write_at is None else write_at
    config = model.config
    batch, num_new = h.shape[:2]
    num_heads, num_kv, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    q_size, kv_size = num_heads * head_dim, num_kv * head_dim
    dtype = model.dtype
    # The CPU tree kernel attends to every visible key at 1 / sqrt(hd): not for sliding windows
    # or another scale (Gemma 3).
    fused = (ancestor_bits is None and tree_attention_cpu.fits(h.device, dtype, num_heads, num_kv, head_dim)
             and not config.windowed and config.attn_scale is None)
    # Otherwise, the eager forward's mask: committed slots, tree-visible new ones; slots past a
    # row's new tokens (another request's leftovers) hidden; and each sliding window's own.
    mask = None if fused or ancestor_bits is not None else build_attention_mask(
        lengths, tree_mask, num_new, num_slots.shape[0])  # (B, 1, T, S)
    windows = {w: window_mask(lengths, positions, num_slots.shape[0], w) for w in
               {config.window(i) for i in range(config.num_layers)} if w is not None}
    rope = model.rope_rows(positions, dtype)
    for index, module in enumerate(model.layers):
        block = cast(Block, module)
        attn = block.self_attn
        cos, sin = (r[:, :, None, :] for r in rope[index])  # (B, T, 1, hd)
        window = config.window(index)
        x = block.input_layernorm(h)
        if attn.qkv_proj is not None:  # a formatted model: q|k|v in one product
            q, k, v = attn.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        else:  # a drafter on a GPU, unformatted
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q, k = q.view(batch, num_new, num_heads, head_dim), k.view(batch, num_new, num_kv, head_dim)
        if attn.q_norm is not None and attn.k_norm is not None:  # Qwen3's per-head norms
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = apply_rope(q, cos, sin)  # (B, T, H, hd)
        k = apply_rope(k, cos, sin)  # (B, T, n_kv, hd)
        v = v.view(batch, num_new, num_kv, head_dim)
        if fused:
            tree_attention_cpu.write_kv(keys[index], values[index], k, v, write_at)
            out = tree_attention_cpu.tree_decode(q, keys[index], values[index], lengths, tree_mask)  # (B, T, H*hd)
        elif ancestor_bits is not None:
            write_pending(keys[index], values[index], k, v, write_at)
            out = tree_attention_cuda.tree_attention_cuda(
                q.transpose(1, 2), keys[index], values[index], lengths, ancestor_bits,
                max_prefix_length=num_slots.shape[0] - num_new)  # (B, H, T, hd)
            out = out.transpose(1, 2).reshape(batch, num_new, q_size)  # (B, T, H*hd)
        else:
            assert mask is not None
            write_pending(keys[index], values[index], k, v, write_at)
            # torch's fused attention (flash; GQA without expanding K/V), as in the eager forward.
            # At one query per head, attention written as products and sums for inductor to
            # fuse measured no faster at one row and slower at 64 (a 130 ms step against 99 ms).
            visible_k = keys[index][:, :, : num_slots.shape[0]]  # (B, n_kv, S, hd)
            visible_v = values[index][:, :, : num_slots.shape[0]]
            layer_mask = mask if window is None else mask & windows[window]
            out = attention_under_mask(q.transpose(1, 2), visible_k, visible_v, layer_mask, scale=attn.scale)  # (B, H, T, hd)
            out = out.transpose(1, 2).reshape(batch, num_new, q_size)  # (B, T, H*hd)
        h = block.add_mlp(block.add_attention(h, attn.o_proj(out)))
    return model.norm(h)  # (B, T, D)


class CompiledStep:
    """A forward of at most :attr:`max_new` new tokens per row, eager or compiled ahead of
    time and saved: what :class:`DecodeStep` and a feature drafter's step
    (:class:`~treeserve.ops.feature_drafter.DraftStep`) share. A subclass names the eager
    function (:attr:`function`, whose first argument is the model) and builds example
    arguments with their dynamic dimensions marked (:meth:`_example_args`).

    Without ``artifact`` the function runs eagerly (the tests' reference, and the path wherever
    compiling is off). With ``artifact`` (a file path) it is compiled ahead of time by
    ``torch.compile``'s ``aot_compile`` on first use, saved there, and later processes load it
    without tracing or compiling again; ``compile_seconds`` / ``load_seconds`` say which
    happened and how long it took.

    The compiled function is traced once with the batch, the number of new tokens, the cache
    capacity and the number of visible slots symbolic, and runs without dynamo's guards (they
    cost about 1 ms a call). What the guards would have checked is covered instead by the
    artifact's name, which :func:`artifact_name` derives from the model's config, format,
    dtype and device (a step is only loaded for the model it was compiled for), and by each
    call's check that the cache belongs to the model. The weights are the model's own at
    every call (an argument, not baked in).
    """

    max_new = MAX_NEW_TOKENS
    what = "decode step"
    function: Callable[..., Tensor]

    def __init__(self, model: Transformer, *, artifact: str | Path | None = None) -> None:
        self.model = model
        self.artifact = None if artifact is None else Path(artifact)
        self.compile_seconds: float | None = None
        self.load_seconds: float | None = None
        self._compiled: Callable[..., Tensor] | None = None
        self._lock = threading.Lock()
        self._background: str | None = None  # prepare_in_background: "waiting", then "started"
        self._build: Callable[[], None] | None = None  # prepare_in_background's out-of-process build
        tree_attention_cpu.available()  # loaded before tracing: the step reads it as a constant

    @property
    def is_compiled(self) -> bool:
        """True once the compiled function is in use."""
        return self._compiled is not None

    def prepare_in_background(self, *, idle_s: float = 10.0, build: Callable[[], None] | None = None) -> None:
        """:meth:`prepare` on a daemon thread, so that a server answers while its step
        compiles (minutes; :func:`~treeserve.ops.loaders.load.prepare_for_serving` loads a
        saved step in the foreground instead): until the compiled function is in place, calls
        run the eager function (the same weights and kernels, one by one). A failure is
        logged and the step stays eager.

        ``build``: writes the artifact in another process (:mod:`~treeserve.ops.loaders.prepare`);
        the thread only waits for it and then loads the file. Without it the thread traces and
        compiles here, which holds this interpreter's lock for up to a second at a time and
        starves an event loop beside it (a child's heartbeats).

        The thread starts once the first call has returned (a server's first prefill), or
        after ``idle_s`` without a call: tracing and loading import dynamo and inductor and
        hold the interpreter lock for seconds on this project's 2 cores, and a first prefill
        run beside them took 2.6 s instead of 0.1 s.
        """
        self._background = "waiting"
        self._build = build
        timer = threading.Timer(idle_s, self._start_background)
        timer.daemon = True
        timer.start()

    def _start_background(self) -> None:
        with self._lock:
            if self._background != "waiting":
                return
            self._background = "started"

        def run() -> None:
            try:
                if self._build is not None and self.artifact is not None and not self.artifact.exists():
                    self._build()
                self.prepare()
            except Exception:  # no C++ compiler, an inductor failure: serving goes on eagerly
                logger.warning("preparing the compiled %s failed; it stays eager", self.what, exc_info=True)

        threading.Thread(target=run, name=f"{self.what.replace(' ', '-')}-prepare", daemon=True).start()

    def attach(self, *, background: bool = False, build: Callable[[], None] | None = None) -> bool:
        """:meth:`prepare` now, or, with ``background`` and nothing saved to load yet,
        :meth:`prepare_in_background` (with ``build``, if given). False when preparing failed (a
        missing C++ compiler, an inductor failure): it is logged, and the caller keeps its eager path."""
        if background and self.artifact is not None and not self.artifact.exists():
            self.prepare_in_background(build=build)
            return True
        try:
            self.prepare()
        except Exception:  # compiling must never stop serving or drafting
            logger.warning("compiling the %s failed; it stays eager", self.what, exc_info=True)
            return False
        return True

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
                from torch._inductor import config as inductor_config  # 1.8 s of imports: only here

                with self.artifact.open("rb") as file, inductor_config.patch({"cpp.vec_isa_ok": True}):
                    loaded = torch.compiler.load_compiled_function(file)
                # The times first: another thread may read them as soon as is_compiled holds.
                self.load_seconds = time.perf_counter() - started
                self._compiled = loaded
                return
            except Exception:  # a truncated or foreign file: compile afresh below
                self.artifact.unlink(missing_ok=True)
        # The step's Python wrapper checks every intermediate's size, stride and alignment by
        # default (760 checks a step for the default model, a few hundred microseconds of a
        # ~10 ms step); the shapes are fixed by the trace, so they are left out.
        options = {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe,
                   "size_asserts": False, "scalar_asserts": False, "alignment_asserts": False}
        fn = torch.compile(type(self).function, fullgraph=True, options=options)
        with torch.inference_mode():
            compiled = fn.aot_compile((self._example_args(), {}))
        self.artifact.parent.mkdir(parents=True, exist_ok=True)
        partial = self.artifact.with_suffix(f".partial-{os.getpid()}")
        compiled.save_compiled_function(str(partial))
        os.replace(partial, self.artifact)
        self.compile_seconds = time.perf_counter() - started
        self._compiled = compiled

    def _example_args(self) -> tuple[object, ...]:
        raise NotImplementedError

    def _example_cache(self) -> tuple[KVCache, Tensor, Tensor, Tensor]:
        """Two rows, two new tokens and a few slots, dynamic: dynamo specializes dimensions of
        size 1, so an example of one row (or one token) would compile a function for that
        size only. Returns the cache, positions, a tree mask and ``num_slots``."""
        example_cache = self.model.new_cache(2, 16)
        device = example_cache.device
        positions = torch.zeros(2, 2, dtype=torch.long, device=device)
        tree_mask = torch.ones(2, 2, 2, dtype=torch.bool, device=device)
        num_slots = torch.empty(4, dtype=torch.bool)
        for tensor in (positions, tree_mask, example_cache.lengths, num_slots):
            torch._dynamo.mark_dynamic(tensor, 0)
        for tensor in (positions, tree_mask):
            torch._dynamo.mark_dynamic(tensor, 1)
        torch._dynamo.mark_dynamic(tree_mask, 2)
        for tensor in example_cache.keys + example_cache.values:
            torch._dynamo.mark_dynamic(tensor, 0)
            torch._dynamo.mark_dynamic(tensor, 2)
        return example_cache, positions, tree_mask, num_slots

    def _check(self, tokens: Tensor, cache: KVCache, max_new: int | None = None) -> None:
        """Raise ``ValueError`` unless ``tokens`` is ``(B, T)`` with ``1 <= T <= max_new``
        (:attr:`max_new` by default; ``sys.maxsize``: any length) and ``cache`` is this model's."""
        limit = self.max_new if max_new is None else max_new
        if tokens.dim() != 2 or tokens.shape[0] != cache.batch_size or not 1 <= tokens.shape[1] <= limit:
            shown = "1 <= T" if limit == sys.maxsize else f"1 <= T <= {limit}"
            raise ValueError(f"tokens must be (B, T) with B = {cache.batch_size} and {shown}, got {tuple(tokens.shape)}")
        if cache.dtype != self.model.dtype or cache.num_layers != len(self.model.layers):
            raise ValueError(f"the cache does not belong to this {self.what}'s model")

    def _call(self, *args: object) -> Tensor:
        fn = self._compiled if self._compiled is not None else type(self).function
        hidden = fn(self.model, *args)
        if self._background == "waiting":
            self._start_background()
        return hidden


class DecodeStep(CompiledStep):
    """``step(tokens (B, T), cache, tree_mask, positions) -> hidden (B, T, D)``: the forward of up
    to :attr:`max_new` new tokens per row (a decode step, or the verifier's token tree), as
    :func:`step_hidden`.

    Writes each row's new K/V after its committed tokens and marks them pending, as
    ``Transformer.forward`` does. Compiled or eager as :class:`CompiledStep` says, or, after
    :meth:`fuse`, every block in one C++ op where the model's format and this CPU allow it.
    Longer inputs (prefill) stay with the model's eager forward, except once fused: the fused
    op takes inputs of any length.
    """

    function = staticmethod(step_hidden)

    def __init__(self, model: Transformer, *, artifact: str | Path | None = None) -> None:
        super().__init__(model, artifact=artifact)
        self._fused: list[Tensor] | None = None  # fused_step.weights once fuse() took
        self._kernel: int | None = None  # fused_step.kernel_of, likewise

    def _example_args(self) -> tuple[object, ...]:
        cache, positions, tree_mask, num_slots = self._example_cache()
        tokens = torch.zeros(2, 2, dtype=torch.long, device=cache.device)
        torch._dynamo.mark_dynamic(tokens, 0)
        torch._dynamo.mark_dynamic(tokens, 1)
        return (self.model, tokens, positions, tree_mask, cache.lengths, cache.keys, cache.values, num_slots)

    def fuse(self) -> bool:
        """Run every block in one C++ op from now on, where the model fits it (the q4_1 format
        on a CPU with AVX2, :mod:`~treeserve.ops.kernels.decode_layers`): the same weights, one
        answer per row at every shape, no Python per op, and nothing to compile or load
        (:meth:`prepare` then does nothing). The step then takes any number of new tokens a row,
        so the model's prefills run it too. Returns whether it does."""
        if self._fused is None and fused_step.fits(self.model):
            self._kernel = fused_step.kernel_of(self.model)
            self._fused = fused_step.weights(self.model)
        return self._fused is not None

    @property
    def is_fused(self) -> bool:
        """True once :meth:`fuse` took."""
        return self._fused is not None

    def prepare(self) -> None:
        if self._fused is None:
            super().prepare()

    @torch.inference_mode()
    def __call__(self, tokens: Tensor, cache: KVCache, tree_mask: Tensor | None = None,
                 positions: Tensor | None = None) -> Tensor:
        if self._fused is not None:
            return self._run_fused(tokens, cache, tree_mask, positions)
        self._check(tokens, cache)
        positions, tree_mask, num_slots = begin_step(cache, tokens.shape[0], tokens.shape[1], tree_mask, positions)
        # The compiled function was traced on dense inputs (it checks their strides).
        return self._call(tokens.contiguous(), positions, tree_mask, cache.lengths, cache.keys, cache.values,
                          num_slots)

    def _run_fused(self, tokens: Tensor, cache: KVCache, tree_mask: Tensor | None, positions: Tensor | None) -> Tensor:
        """The fused op over any number of new tokens a row (a prefill too): a causal chain
        when ``tree_mask`` is None, with no ``(T, T)`` mask built."""
        self._check(tokens, cache, sys.maxsize)
        num_new = tokens.shape[1]
        if positions is None:
            positions = cache.lengths[:, None] + torch.arange(num_new, device=cache.lengths.device)
        cache.begin_write(num_new)
        assert self._fused is not None and self._kernel is not None
        if tree_mask is not None or num_new <= PREFILL_PIECE:
            return fused_step.run(self.model, self._fused, self.model.embed(tokens), positions, tree_mask,
                                     cache.lengths, cache.keys, cache.values, self._kernel)
        # A long causal chain (a prefill) in pieces, each over the pieces before it as its
        # prefix: the same bits (no row depends on the others), and the attention's partial sums
        # stay proportional to a piece, not to the whole prompt.
        pieces = []
        for start in range(0, num_new, PREFILL_PIECE):
            stop = min(num_new, start + PREFILL_PIECE)
            pieces.append(fused_step.run(
                self.model, self._fused, self.model.embed(tokens[:, start:stop]), positions[:, start:stop], None,
                cache.lengths + start, cache.keys, cache.values, self._kernel))
        return torch.cat(pieces, dim=1)


def begin_step(cache: KVCache, batch: int, num_new: int, tree_mask: Tensor | None,
               positions: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Mark ``num_new`` slots per row of ``cache`` pending and return :func:`step_hidden`'s
    ``positions``, ``tree_mask`` (a chain when None) and ``num_slots``, dense."""
    if positions is None:
        positions = cache.lengths[:, None] + torch.arange(num_new, device=cache.lengths.device)
    if tree_mask is None:  # a chain: each new token sees itself and the ones before it
        chain = torch.ones(num_new, num_new, dtype=torch.bool, device=cache.device).tril()
        tree_mask = chain.expand(batch, -1, -1)
    lengths = cache.begin_write(num_new)
    num_slots = torch.empty(max(lengths) + num_new, dtype=torch.bool)  # only its length is read
    return positions.contiguous(), tree_mask.contiguous(), num_slots


def artifact_name(model: Transformer, *, kind: str = "decode", weight_format: str | None = None,
                  extra_files: tuple[Path, ...] = ()) -> str:
    """A file name that changes whenever what a compiled step depends on changes: the model's
    shapes, its format (``weight_format``: the model's own by default) and dtype, torch's
    version, the CPU's features and the source of the modules the step traces (plus
    ``extra_files``); ``kind`` starts it (``decode``, or ``draft`` for a drafter's step)."""
    import hashlib
    import platform

    from treeserve.ops import formats, model as model_module
    from treeserve.ops.kernels import avx2, dense_cpu, q4_amx, q8_amx

    modules = (model_module, formats, q4_amx, q8_amx, avx2, tree_attention_cpu, dense_cpu)
    files = [Path(m.__file__) for m in modules if m.__file__] + [
        Path(__file__), q4_amx.SOURCE, q8_amx.SOURCE, avx2.SOURCE, tree_attention_cpu.SOURCE, dense_cpu.SOURCE]
    sources = b"".join(path.read_bytes() for path in [*files, *extra_files])
    fmt = model.weight_format if weight_format is None else weight_format
    key = "|".join([
        repr(sorted(model.config.__dict__.items())), str(fmt), str(model.dtype), str(model.device),
        torch.__version__, platform.machine(), torch.backends.cpu.get_cpu_capability(),
        hashlib.sha256(sources).hexdigest(), f"q4={(q4_amx.available(), q4_amx.tiles(), q4_amx.int8_rows(), q4_amx.avx2()) if model.weight_format in ('q4_1', 'gguf') else None}",
        f"tree_attention_cpu={tree_attention_cpu.available()}",
        f"dense_cpu={dense_cpu.available() if model.weight_format == 'float32' else None}",
    ])
    return f"{kind}-{fmt}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.aot"
