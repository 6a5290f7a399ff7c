"""Weight formats: how a loaded model's linear layers store and multiply their weights.

A format is chosen at load time and applied to a float32 :class:`~treeserve.ops.model.Transformer`
by :func:`apply_format`, a transform in the manner of gpt-fast's ``quantize`` and this
project's ``apply_tp``: it fuses each block's Q/K/V projections into one ``qkv_proj`` and its
gate/up projections into one ``gate_up_proj`` (the state dict on disk keeps the Hugging Face
names), and swaps every linear, the LM head included, for the format's kernel.

=========== ============ ==================================================================
format      activations  weights and kernel (CPU)
=========== ============ ==================================================================
float32     float32      float32: ``kernels/dense_cpu`` (AVX-512 or AVX2; one summation
                         order at every row count), else ``F.linear``
bfloat16    bfloat16     bfloat16 prepacked for oneDNN (AMX/AVX512-BF16 on this CPU;
                         ``F.linear`` where oneDNN has no bf16, :func:`onednn_bf16`)
int8        bfloat16     int8 per output row (symmetric, bf16 scale), ``_weight_int8pack_mm``
q4_1        bfloat16     4-bit codes, group 32, bf16 scale and zero: ``kernels/q4_amx``
                         (int8 rows on AVX512-VNNI at every shape; without
                         AVX-512, int8 rows on AVX2, ``kernels/q_avx2.cpp``; the
                         whole forward in one op, ``kernels/decode_layers``), else
                         ``_weight_int4pack_mm_for_cpu``
gguf        bfloat16     each linear in its GGUF block type (``block_types``): Q4_0, Q4_1,
                         Q4_K on q4_1's kernels; Q5_0, Q5_1, Q5_K, Q6_K, Q8_0 as int8
                         codes with float32 scales and zeros, ``kernels/codes8`` (int8
                         rows, the same one-op forward); Q/K/V of mixed types fused on
                         ``codes8``; from float weights, q4_1
=========== ============ ==================================================================

The int formats' LM head is Q8_0 (int8 codes, a float16 scale per 32, fp32 logits) on
``kernels/q8_amx``'s packing where its kernels run, else bfloat16: on every CPU with AVX2 the
int16-row kernel (``kernels/q_avx2.cpp``, faster than the AVX-512 fp32 path at every row count
measured), else that AVX-512 path.

**One set of weight values.** Every kernel of a format computes with the same weight values
at every shape (one token, a tree, a batch): a format never switches to another
representation by shape, so a server's speculative output equals its own incremental
decoding up to float summation order.

**One answer in q4_1.** Where its kernels run (x86 with AVX2 or AVX512-VNNI), q4_1 rounds
each group of 32 activations to int8 at every row count, so a row's products are the same bits
at every row count (AMX hosts too: the bf16 tile path, whose sums depend on the shape, is not
used), the Q8_0 head runs one kernel at every row count for the same reason, and every
forward runs the one op of ``kernels/decode_layers``, whose norms and attention do not depend
on the other rows either: greedy speculation, batching, prefill chunking and ``--compile`` give
the same tokens as incremental decoding, bit for bit (``tests/ops/test_row_invariance.py``).
The gguf format makes the same promise on the same kernels (``tests/ops/test_gguf_format.py``).
float32's products on ``kernels/dense_cpu`` sum in one order at every row count too (its
attention does not promise it yet); bfloat16 and int8 do not promise it: oneDNN's and torch's
GEMMs change their summation order with the row count. The unformatted float32 model
(``nn.Linear``, ``F.linear``) stays the reference of the tests.

**q4_1 and the GGUF.** A Q4_1 block of 32 weights is ``w = d * q + m`` with ``q`` in 0..15 and
``d, m`` float16. The int4 kernel computes ``(q - 8) * scale + zero`` with ``scale = d`` and
``zero = m + 8 d``, both held in bfloat16 (the kernel's scale dtype): the codes are the GGUF's
own, and each weight differs from the dequantized Q4_1 value only by the bf16 rounding of
``d`` and ``m + 8 d`` (relative 2^-9 of each). Weights that do not come from Q4_1 blocks
(float checkpoints) are quantized group-wise from float32.

**The head and the GGUF.** The default model's embedding is tied and Q8_0 in its GGUF:
``w = d * q``, ``q`` in -127..127, ``d`` float16 per 32. :func:`q8_0_from_float` quantizes as
llama.cpp does (``d = amax / 127``), which recovers those codes and scales exactly from the
dequantized weights (the largest code of a block is always 127), and the kernel multiplies by
``d * q`` unrounded: the head serves the GGUF's own values, where a bf16 head rounded them.

On CUDA, float32 and bfloat16 run ``F.linear`` on plain weights (cuBLAS); int8 and q4_1
refuse with :class:`FormatUnsupportedError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from treeserve.ops.format_names import AUTO_FORMAT as AUTO_FORMAT  # re-exported: formats' names live there
from treeserve.ops.format_names import DEFAULT_FORMAT as DEFAULT_FORMAT
from treeserve.ops.format_names import FORMAT_NAMES as FORMAT_NAMES
from treeserve.ops.format_names import WeightFormat as WeightFormat
from treeserve.ops.block_types import Codes8Blocks, Q4Blocks, StoredBlocks, concat_rows
from treeserve.ops.kernels import codes8, dense_cpu, q4_amx, q8_amx
from treeserve.ops.model import Block, ModelConfig, Transformer

Q4_GROUP = 32
"""Weights per Q4_1 block (and per group of the int4 kernel's scales)."""

Q8_GROUP = 32
"""Weights per Q8_0 block (one float16 scale each)."""

INT4_INNER_K_TILES = 8
"""Packing parameter of ``torch._convert_weight_to_int4pack_for_cpu``."""


class FormatUnsupportedError(ValueError):
    """The weight format cannot run on this device or for this model's shapes."""


def resolve_format(name: str | WeightFormat, config: ModelConfig, device: torch.device | None = None,
                   stored_types: Mapping[str, str] | None = None) -> WeightFormat:
    """The format ``name`` stands for on a model of ``config`` on ``device``: ``auto`` is, on
    CPU when every linear's input size is a multiple of 32, the format the weights are stored in
    (``stored_types``: a GGUF's linear weights' block types by parameter name): ``q4_1`` where
    they are all Q4_1 or the weights are floats, else ``gguf`` (each in its own block type);
    elsewhere bfloat16 (the int formats have CPU kernels only). Any other name is that format."""
    if name != AUTO_FORMAT:
        return WeightFormat.parse(name)
    if device is not None and device.type != "cpu":
        return WeightFormat.BFLOAT16
    inputs = (config.dim, config.num_heads * config.head_dim, config.ffn_dim)
    if not all(size % Q4_GROUP == 0 for size in inputs):
        return WeightFormat.BFLOAT16
    linears = {kind for name, kind in (stored_types or {}).items() if _is_linear(name)}
    return DEFAULT_FORMAT if linears <= {"Q4_1", "F32", "F16", "BF16"} else WeightFormat.GGUF


def _is_linear(name: str) -> bool:
    """Whether a parameter name is a block's linear weight (the formats' kernels' weights)."""
    return name.startswith("layers.") and name.endswith("_proj.weight")


def q4_blocks_from_float(weight: Tensor) -> Q4Blocks:
    """Quantize a float ``(N, K)`` weight to Q4_1 blocks the way llama.cpp does (min/max per 32)."""
    n, k = weight.shape
    if k % Q4_GROUP:
        raise FormatUnsupportedError(f"q4_1 needs in_features divisible by {Q4_GROUP}, got {k}")
    groups = weight.float().reshape(n, k // Q4_GROUP, Q4_GROUP)
    low = groups.amin(-1)
    high = groups.amax(-1)
    scale = ((high - low) / 15).half()
    minimum = low.half()
    safe = torch.where(scale.float() == 0, torch.ones_like(low), scale.float())
    codes = ((groups - minimum.float()[..., None]) / safe[..., None]).round().clamp(0, 15)
    return Q4Blocks(codes.reshape(n, k).to(torch.uint8), scale, minimum)


class DenseLinear(nn.Module):
    """``F.linear`` on a plain weight (float32 on CPU; float32/bfloat16 on CUDA)."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.contiguous(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def num_weight_bytes(self) -> int:
        """Bytes one forward reads of this weight."""
        return self.weight.numel() * self.weight.element_size()


class Float32Linear(DenseLinear):
    """The float32 format's linear on CPU: ``kernels/dense_cpu`` (every product split over the
    threads as they come free, one summation order at every row count)."""

    def forward(self, x: Tensor) -> Tensor:
        return dense_cpu.mm(x, self.weight, self.bias)


@torch.library.custom_op("treeserve::onednn_linear", mutates_args=())
def onednn_linear(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """``x @ W.T + bias`` with ``W`` reordered for oneDNN: an opaque op to ``torch.compile``
    (inductor cannot lower the eager oneDNN op on a prepacked weight), so the compiled decode
    step calls the same prepacked kernel as the eager forward."""
    result: Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")
    return result


@onednn_linear.register_fake
def _onednn_linear_shape(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def onednn_bf16() -> bool:
    """True when oneDNN multiplies bf16 on this CPU (AVX512-BW/VL/DQ or AVX-NE-CONVERT): it
    refuses to reorder a bf16 weight elsewhere (an AVX2-only CPU, AMD's Zen 3 among them)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class OneDnnLinear(nn.Module):
    """bfloat16 linear on a weight reordered once for oneDNN (``mkldnn._linear_pointwise``).

    At one token this runs about twice as fast as ``F.linear`` on a plain bf16 weight, and at
    16-64 tokens it uses AMX tiles; every shape multiplies by the same bf16 values.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        plain = weight.to(torch.bfloat16).contiguous()
        self.out_features, self.in_features = plain.shape
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(plain, None))
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.bfloat16).contiguous(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            return onednn_linear(x, self.packed, self.bias, self.out_features)
        # Eagerly, the kernel itself: a custom op's first eager call imports torch._dynamo
        # (1.7 s of a server's first token).
        result: Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")
        return result

    @property
    def num_weight_bytes(self) -> int:
        return self.out_features * self.in_features * 2  # bf16


class Int8Linear(nn.Module):
    """Weight-only int8: ``x @ (q * scale).T`` with one bf16 scale per output row.

    ``buffers`` are :func:`int8_buffers`'s (or the same, read back from a saved format).
    """

    def __init__(self, buffers: Mapping[str, Tensor], bias: Tensor | None) -> None:
        super().__init__()
        # ``_weight_int8pack_mm`` crashed (a segmentation fault, the tiny test model's shapes) on
        # codes read back from a saved format, which safetensors places at 8-byte offsets of
        # its file: such tensors are copied to an allocation of their own (64-byte aligned).
        self.register_buffer("codes", _own_aligned(buffers["codes"]))
        self.register_buffer("scale", _own_aligned(buffers["scale"]))
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.bfloat16), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        out = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.codes, self.scale)
        out = out.reshape(*shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias

    @property
    def num_weight_bytes(self) -> int:
        return self.codes.numel() + self.scale.numel() * self.scale.element_size()


def _own_aligned(tensor: Tensor) -> Tensor:
    """``tensor``, or a copy of it where it is a view into a larger storage or not 64-byte aligned."""
    if tensor.storage_offset() == 0 and tensor.data_ptr() % 64 == 0 and tensor.is_contiguous():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def int8_buffers(weight: Tensor) -> dict[str, Tensor]:
    """Int8 codes ``(N, K)`` and bf16 per-row scales ``(N,)`` of a float weight."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(torch.bfloat16)  # (N,)
    codes = (w / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)  # (N, K)
    return {"codes": codes.contiguous(), "scale": scale}


class Int4Linear(nn.Module):
    """Weight-only 4-bit, group 32: ``w = (q - 8) * scale + zero`` (see the module docstring).

    Where the kernel of ``kernels/q4_amx`` runs (:func:`~treeserve.ops.kernels.q4_amx.available`
    and both sizes multiples of 32) it holds that kernel's packing, which serves every row
    count; elsewhere torch's ``_weight_int4pack_mm_for_cpu`` packing. ``source``: Q4_1 blocks,
    or their :func:`int4_buffers` (read back from a saved format).
    """

    def __init__(self, source: Q4Blocks | Mapping[str, Tensor], bias: Tensor | None) -> None:
        super().__init__()
        buffers = int4_buffers(source) if isinstance(source, Q4Blocks) else source
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.bfloat16), requires_grad=False)
        self.amx_codes: Tensor | None
        self.amx_scales_zeros: Tensor | None
        self.packed: Tensor | None
        self.scales_and_zeros: Tensor | None
        if "amx_codes" in buffers:
            amx_scales_zeros = buffers["amx_scales_zeros"]  # (N/32, K/32, 2, 32)
            self.out_features, self.in_features = amx_scales_zeros.shape[0] * Q4_GROUP, amx_scales_zeros.shape[1] * Q4_GROUP
        else:
            scales_and_zeros = buffers["scales_and_zeros"]  # (K/32, N, 2)
            self.in_features, self.out_features = scales_and_zeros.shape[0] * Q4_GROUP, scales_and_zeros.shape[1]
        for name in ("amx_codes", "amx_scales_zeros", "packed", "scales_and_zeros"):
            self.register_buffer(name, buffers.get(name))
        # A constant of this machine, read once: the compiled step traces it as one.
        self.int8_rows = self.amx_codes is not None and q4_amx.int8_rows()
        self.avx2 = self.amx_codes is not None and q4_amx.avx2()

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if self.amx_codes is not None and self.amx_scales_zeros is not None:
            out = q4_amx.mm(rows, self.amx_codes, self.amx_scales_zeros, self.out_features, int8_rows=self.int8_rows,
                            avx2=self.avx2)
        else:
            out = torch._weight_int4pack_mm_for_cpu(rows, self.packed, Q4_GROUP, self.scales_and_zeros)
        out = out.reshape(*shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    @property
    def num_weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers(recurse=False) if t is not None)


def int4_buffers(blocks: Q4Blocks) -> dict[str, Tensor]:
    """The 4-bit kernel's buffers of Q4_1 blocks, scales and zeros in bf16: the packing of
    ``kernels/q4_amx`` where it runs, else torch's int4 kernel's."""
    n, k = blocks.codes.shape
    if k % Q4_GROUP:
        raise FormatUnsupportedError(f"q4_1 needs in_features divisible by {Q4_GROUP}, got {k}")
    scale = blocks.scale.float()
    zero = blocks.minimum.float() + 8 * scale
    if q4_amx.supports(n, k) and q4_amx.available():
        codes, scales_zeros = q4_amx.pack(blocks.codes, scale, zero)
        return {"amx_codes": codes, "amx_scales_zeros": scales_zeros}
    scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()  # (K/32, N, 2)
    return {
        "packed": torch._convert_weight_to_int4pack_for_cpu(blocks.codes.to(torch.int32), INT4_INNER_K_TILES),
        "scales_and_zeros": scales_and_zeros,
    }


def q8_0_from_float(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Q8_0 blocks of a float ``(N, K)`` weight as llama.cpp quantizes them: codes ``(N, K)`` int8
    and float16 scales ``(N, K // 32)``, ``d = amax / 127`` per block of 32, ``q = round(w / d)``.

    On weights that are already Q8_0 values (the GGUF's dequantized embedding) this returns
    their own codes and scales: a block's largest ``|q|`` is 127, so ``amax / 127`` is its ``d``.
    """
    n, k = weight.shape
    if k % Q8_GROUP:
        raise FormatUnsupportedError(f"a Q8_0 head needs in_features divisible by {Q8_GROUP}, got {k}")
    groups = weight.float().reshape(n, k // Q8_GROUP, Q8_GROUP)
    scale = (groups.abs().amax(-1) / 127).half()
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    codes = (groups / safe[..., None]).round().clamp(-127, 127).to(torch.int8)
    return codes.reshape(n, k), scale


class Q8Linear(nn.Module):
    """Q8_0 weights (``w = q * d``, ``d`` float16 per 32) on ``kernels/q8_amx``, for bf16 rows:
    float32 outputs (the int formats' LM head), or ``out_dtype`` ones plus ``bias`` (a feature
    drafter's inner linears, :func:`~treeserve.ops.feature_drafter.format_drafter`).

    ``buffers``: ``codes`` and ``scales`` in that kernel's packing (:func:`q8_buffers`, or the
    same read back from a saved format).
    """

    def __init__(self, buffers: Mapping[str, Tensor], out_features: int, *, bias: Tensor | None = None,
                 out_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if not q8_amx.available():
            raise FormatUnsupportedError("the Q8_0 kernel does not run on this machine")
        self.out_features = out_features
        self.in_features = buffers["codes"].numel() // out_features
        self.register_buffer("codes", _own_aligned(buffers["codes"]))
        self.register_buffer("scales", _own_aligned(buffers["scales"]))
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.out_dtype = out_dtype
        self.avx2 = q8_amx.int16_rows()  # a constant of this machine, traced as one

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        # The int16-row kernel wherever it runs (q8_amx.int16_rows), else the AVX-512 vector
        # path, at every row count: a row's logits the same bits in a step, a tree, a batch or a
        # prefill.
        out = q8_amx.mm(x.reshape(-1, shape[-1]), self.codes, self.scales, self.out_features,
                        min_rows=q8_amx.VECTORS_ONLY, avx2=self.avx2)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features).to(self.out_dtype)

    @property
    def num_weight_bytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * self.scales.element_size()


def q8_buffers(weight: Tensor) -> dict[str, Tensor]:
    """The Q8_0 kernel's packed ``codes`` and ``scales`` of a float ``(N, K)`` weight."""
    codes, scales = q8_amx.pack(*q8_0_from_float(weight))
    return {"codes": codes, "scales": scales}


def q8_head_fits(weight: Tensor) -> bool:
    """True when the int formats' head can be Q8_0 here: the kernel runs on this CPU and the
    ``(V, D)`` weight's sizes are multiples of 32."""
    return weight.device.type == "cpu" and q8_amx.supports(*weight.shape) and q8_amx.available()


class Codes8Linear(nn.Module):
    """Integer codes by group (``w = scale * q + zero``, a float32 scale per 16 or 32 weights, an
    optional zero per 32) on ``kernels/codes8``: the gguf format's Q8_0, Q5_0, Q5_1, Q5_K and
    Q6_K weights (and any linear whose fused parts mix block types), with their own codes,
    scales and zeros. Rows are quantized to int8 per group of 32 and summed exactly in int32, so
    a row's result is the same bits at every row count. bf16 outputs, or float32 ones for an LM
    head (``float_out``).

    ``source``: :class:`~treeserve.ops.block_types.Codes8Blocks`, or their packed buffers read
    back from a saved format.
    """

    def __init__(self, source: Codes8Blocks | Mapping[str, Tensor], bias: Tensor | None, *,
                 float_out: bool = False) -> None:
        super().__init__()
        if not codes8.available():
            raise FormatUnsupportedError("the 8-bit-code kernel does not run on this machine (it needs AVX2)")
        if isinstance(source, Codes8Blocks):
            packed = codes8.pack(source.codes, source.scales, source.zeros)
            buffers = {"c8_codes": packed[0], "c8_scales": packed[1], "c8_zeros": packed[2],
                       "c8_shape": torch.tensor(list(source.codes.shape), dtype=torch.int64)}  # (N, K)
        else:
            buffers = dict(source)
        for name in ("c8_codes", "c8_scales", "c8_zeros", "c8_shape"):
            self.register_buffer(name, _own_aligned(buffers[name]))
        self.out_features, self.in_features = (int(v) for v in self.c8_shape)
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.bfloat16), requires_grad=False)
        self.float_out = float_out
        self.avx2 = codes8.avx2()  # a constant of this machine, traced as one

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        out = codes8.mm(x.reshape(-1, shape[-1]), self.c8_codes, self.c8_scales, self.c8_zeros,
                        self.out_features, float_out=self.float_out, avx2=self.avx2)
        out = out.reshape(*shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    @property
    def num_weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for n, t in self.named_buffers(recurse=False) if n != "c8_shape")


PREPARED_KERNELS = (Int8Linear, Int4Linear, Q8Linear, Codes8Linear)
"""The kernels whose buffers take long to compute from the weights (packing, quantizing):
:func:`prepared_buffers` collects them so a later load can pass them back to :func:`apply_format`."""


def make_linear(
    fmt: WeightFormat, weight: Tensor | None, bias: Tensor | None, *, blocks: StoredBlocks | None = None,
    prepared: Mapping[str, Tensor] | None = None, device: torch.device | None = None,
) -> nn.Module:
    """The format's kernel for a float ``(N, K)`` weight (``blocks``: its stored values, if any;
    ``prepared``: the int kernels' buffers, computed before, which replace both).

    The q4_1 format takes 4-bit blocks (Q4_0, Q4_1, Q4_K); the gguf format takes every stored
    block type, each on its kernel. ``weight`` may be None only when ``blocks`` or ``prepared``
    stand in for it. The int formats' LM head is not made here (see ``_head``).
    """
    device = device if device is not None else weight.device if weight is not None else torch.device("cpu")
    if device.type == "cuda" and fmt.is_int:
        raise FormatUnsupportedError(f"the {fmt.value} format has CPU kernels only; on CUDA use float32 or bfloat16")
    if prepared and fmt is WeightFormat.INT8:
        return Int8Linear(prepared, bias)
    if prepared and fmt in (WeightFormat.Q4_1, WeightFormat.GGUF):
        return Codes8Linear(prepared, bias) if "c8_codes" in prepared else Int4Linear(prepared, bias)
    if fmt is WeightFormat.GGUF and isinstance(blocks, Codes8Blocks):
        return Codes8Linear(blocks, bias)
    if fmt in (WeightFormat.Q4_1, WeightFormat.GGUF) and isinstance(blocks, Q4Blocks):
        return Int4Linear(blocks, bias)
    if weight is None:
        raise ValueError(f"make_linear: the {fmt.value} format needs the float weight here")
    if device.type == "cuda":
        dtype = fmt.activation_dtype
        return DenseLinear(weight.to(device, dtype), None if bias is None else bias.to(device, dtype))
    if fmt is WeightFormat.FLOAT32:
        kind = Float32Linear if dense_cpu.available() else DenseLinear
        return kind(weight.float(), None if bias is None else bias.float())
    if fmt is WeightFormat.BFLOAT16:
        if not onednn_bf16():
            return DenseLinear(weight.to(torch.bfloat16), None if bias is None else bias.to(torch.bfloat16))
        return OneDnnLinear(weight, bias)
    if fmt is WeightFormat.INT8:
        return Int8Linear(int8_buffers(weight), bias)
    return Int4Linear(int4_buffers(q4_blocks_from_float(weight)), bias)


def prepared_buffers(model: nn.Module) -> dict[str, Tensor]:
    """The buffers of ``model``'s int kernels by ``<module path>.<buffer>``: what
    :func:`apply_format`'s ``prepared`` takes back (a saved format, so a second start skips
    packing and quantizing)."""
    return {
        f"{name}.{buffer}": tensor
        for name, module in model.named_modules() if isinstance(module, PREPARED_KERNELS)
        for buffer, tensor in module.named_buffers(recurse=False) if tensor is not None
    }


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights (codes, scales and zeros included) one decode step reads: every
    format kernel of ``model``, the LM head included; embeddings and norms are left out (a
    step reads one embedding row and a few KB of norms)."""
    total = 0
    for module in model.modules():
        if isinstance(module, (DenseLinear, OneDnnLinear, *PREPARED_KERNELS)):
            total += module.num_weight_bytes
    return total


def _head(fmt: WeightFormat, weight: Tensor, prepared: Mapping[str, Tensor], stored: StoredBlocks | None) -> nn.Module:
    """The LM head's kernel: for the int formats Q8_0 where it fits (else bfloat16), or in the
    gguf format the file's own values of a head stored in another block type (``stored``, float32
    logits); the format's own kernel for the float ones."""
    if fmt.is_int:
        if prepared:
            if "c8_codes" in prepared:
                return Codes8Linear(prepared, None, float_out=True)
            return Q8Linear(prepared, weight.shape[0])
        if fmt is WeightFormat.GGUF and stored is not None and codes8.available() and codes8.supports(*weight.shape):
            values = stored.as_codes8() if isinstance(stored, Q4Blocks) else stored
            return Codes8Linear(values, None, float_out=True)
        if q8_head_fits(weight):
            return Q8Linear(q8_buffers(weight), weight.shape[0])
        return make_linear(WeightFormat.BFLOAT16, weight, None)
    return make_linear(fmt, weight, None, device=weight.device)


def _moved_hooks(old: nn.Module, new: nn.Module) -> nn.Module:
    """Carry forward hooks (tensor parallelism's all-reduce) from a replaced linear to its kernel."""
    for hook in old._forward_hooks.values():
        new.register_forward_hook(hook)
    return new


def apply_format(
    model: Transformer, fmt: WeightFormat | str, *, stored: Mapping[str, StoredBlocks] | None = None,
    prepared: Mapping[str, Tensor] | None = None,
) -> Transformer:
    """Put ``model``'s linears into ``fmt`` in place (fusing Q/K/V and gate/up) and return it.

    ``model`` must hold float32 weights and must not have been formatted already; tensor
    parallelism (``apply_tp``) goes first, so each rank formats its own slices. ``stored``
    (parameter name -> stored values, from :func:`~treeserve.ops.loaders.gguf.read_stored_blocks`)
    gives the q4_1 format the GGUF's own 4-bit codes and the gguf format every block type's;
    weights without them are quantized from float (to q4_1). With ``stored``, pass the format
    :func:`resolve_format` gives for their types (``auto`` here knows only float weights).
    ``prepared`` (from :func:`prepared_buffers` of the same model, format and code, saved
    earlier) gives the int kernels their buffers, so nothing is packed or quantized again.
    Embeddings and norms move to the format's activation dtype. The model then serves inference
    only (its fused kernels carry no gradients); :meth:`Transformer.logits` uses the format's head.
    """
    fmt = resolve_format(fmt, model.config, model.device)
    if model.head_kernel is not None:
        raise ValueError("apply_format: this model is already formatted")
    if model.dtype != torch.float32:
        raise ValueError(f"apply_format needs a float32 model (the source values), got {model.dtype}")
    device = model.device
    # The q4_1 format takes the 4-bit blocks, the gguf format every stored type.
    blocks = {name: b for name, b in (stored or {}).items()
              if fmt is WeightFormat.GGUF or (fmt is WeightFormat.Q4_1 and isinstance(b, Q4Blocks))}
    if blocks:
        params = dict(model.named_parameters())
        tp_sliced = [name for name, b in blocks.items() if name in params and b.codes.shape != params[name].shape]
        if tp_sliced:
            raise FormatUnsupportedError(f"a GGUF's stored blocks do not fit a tensor-parallel shard (run {fmt.value} with --tp 1)")

    saved = dict(prepared or {})

    def buffers_of(path: str) -> dict[str, Tensor]:
        return {key[len(path) + 1:]: value for key, value in saved.items() if key.startswith(f"{path}.")}

    def fused(prefix: str, fused_name: str, parts: list[nn.Linear], names: list[str]) -> nn.Module:
        biases = [p.bias for p in parts]
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases if b is not None])
        own = buffers_of(f"{prefix}.{fused_name}")
        part_blocks = [blocks.get(f"{prefix}.{n}.weight") for n in names]
        joined = None
        if all(b is not None for b in part_blocks) and not own:
            joined = concat_rows([b for b in part_blocks if b is not None])
        # The fused float weight only where no blocks or saved buffers stand in for it.
        weight = None if own or joined is not None else torch.cat([p.weight.detach() for p in parts])
        return make_linear(fmt, weight, bias, blocks=joined, prepared=own, device=device)

    def single(prefix: str, linear: nn.Linear) -> nn.Module:
        bias = None if linear.bias is None else linear.bias.detach()
        kernel = make_linear(fmt, linear.weight.detach(), bias, blocks=blocks.get(f"{prefix}.weight"),
                             prepared=buffers_of(prefix), device=device)
        return _moved_hooks(linear, kernel)

    for index, module in enumerate(model.layers):
        block = cast(Block, module)
        attn, mlp = block.self_attn, block.mlp
        attn.qkv_proj = fused(f"layers.{index}.self_attn", "qkv_proj", [attn.q_proj, attn.k_proj, attn.v_proj],
                              ["q_proj", "k_proj", "v_proj"])
        mlp.gate_up_proj = fused(f"layers.{index}.mlp", "gate_up_proj", [mlp.gate_proj, mlp.up_proj], ["gate_proj", "up_proj"])
        attn.o_proj = cast(nn.Linear, single(f"layers.{index}.self_attn.o_proj", attn.o_proj))
        mlp.down_proj = cast(nn.Linear, single(f"layers.{index}.mlp.down_proj", mlp.down_proj))
        for name in ("q_proj", "k_proj", "v_proj"):
            delattr(attn, name)
        for name in ("gate_proj", "up_proj"):
            delattr(mlp, name)
        for norm in (block.input_layernorm, block.post_attention_layernorm, attn.q_norm, attn.k_norm,
                     block.attn_out_norm, block.mlp_out_norm):
            if norm is not None:
                norm.to(fmt.activation_dtype)
    head_name = "embed_tokens.weight" if model.lm_head is None else "lm_head.weight"  # tied or not
    model.head_kernel = _head(fmt, model.lm_head_weight.detach(), buffers_of("head_kernel"), blocks.get(head_name))
    model.embed_tokens.to(fmt.activation_dtype)
    model.norm.to(fmt.activation_dtype)
    if model.lm_head is not None:
        model.lm_head.to(fmt.activation_dtype)
    model.weight_format = fmt.value
    return model
