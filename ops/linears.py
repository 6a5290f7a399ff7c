"""The weight formats' linear layers (``nn.Module`` kernels) and the buffers they are built from:
plain float32 (ours, or ``F.linear``), oneDNN's prepacked bfloat16, int8 rows, the 4-bit
codes of q4_1, the Q8_0 head, and 8-bit codes by group (the gguf format). Which format uses
which, and how a model is put into one, is :mod:`~treeserve.ops.formats`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from treeserve.ops.block_types import Codes8Blocks, Q4Blocks
from treeserve.ops.kernels import codes8, dense_cpu, q4_amx, q8_amx

Q4_GROUP = 32
"""Weights per Q4_1 block (and per group of the int4 kernel's scales)."""

Q8_GROUP = 32
"""Weights per Q8_0 block (one float16 scale each)."""

INT4_INNER_K_TILES = 8
"""Packing parameter of ``torch._convert_weight_to_int4pack_for_cpu``."""


class FormatUnsupportedError(ValueError):
    """The weight format cannot run on this device or for this model's shapes."""


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
