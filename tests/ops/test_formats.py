"""Weight formats (``treeserve.ops.formats``): each format's logits against float32, fused
projections, and the q4_1 kernel's weights against the Q4_1 blocks they come from."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treeserve.ops.formats import AUTO_FORMAT, Q4Blocks, WeightFormat, apply_format, make_linear, resolve_format, weight_bytes_per_token
from treeserve.ops.linears import FormatUnsupportedError, Int4Linear, q4_blocks_from_float, q8_0_from_float
from treeserve.ops.kernels import q4_amx
from treeserve.ops.block_types import BLOCK_TYPES
from treeserve.ops.tree_attention import tree_mask_from_parents

from .conftest import make_tiny_model

FORMATS = tuple(f.value for f in WeightFormat)

# Dimensions that are multiples of the Q4_1 and Q8_0 blocks (32); the default tiny model's 48
# is not (nor its vocabulary of 101, so its int formats keep a bf16 head).
FORMAT_DIMS = dict(dim=64, ffn_dim=128, num_heads=8, num_kv_heads=2, head_dim=8, vocab_size=128)

# Largest |logit - float32 logit| relative to the float32 logits' spread (max - min over the
# vocabulary), per format, on the tiny random model whose linear weights are Q4_1 values (as
# the GGUF's are), so every format starts from the float32 reference's exact weights.
# bfloat16 keeps 8 significant bits, so its activations and weights move logits by about
# 2^-8 of their scale per layer; int8 also rounds each weight to 1/254 of its row's range;
# q4_1 keeps the Q4_1 codes and rounds only scale and zero to bf16, and computes in bf16;
# where it multiplies by int8 rows (a CPU without AMX, ``q4_amx.int8_rows``) each group of 32
# activations is also rounded to 1/254 of its range, which measured 0.092 here.
LOGIT_TOLERANCE = {"float32": 1e-5, "bfloat16": 0.05, "int8": 0.08, "q4_1": 0.12 if q4_amx.int8_rows() else 0.05}
LOGIT_TOLERANCE["gguf"] = LOGIT_TOLERANCE["q4_1"]  # the same 4-bit blocks, on the same kernel


def q4_model(seed: int) -> tuple[torch.nn.Module, dict[str, Q4Blocks]]:
    """A tiny float32 model whose linear weights are exactly Q4_1 values and whose tied
    embedding is exactly Q8_0 values (as the GGUF's are), and the Q4_1 blocks."""
    model = make_tiny_model(seed, **FORMAT_DIMS)
    blocks: dict[str, Q4Blocks] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("layers.") and name.endswith("proj.weight"):
                blocks[name] = q4_blocks_from_float(param)
                param.copy_(blocks[name].dequantize())
        codes, scale = q8_0_from_float(model.embed_tokens.weight)
        model.embed_tokens.weight.copy_((codes.float().reshape(128, -1, 32) * scale.float()[..., None]).reshape(128, -1))
    return model, blocks


def _tree_inputs(num_nodes: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    parents = torch.tensor([-1, 0, 0, 1, 1, 2][:num_nodes])
    mask = tree_mask_from_parents(parents)[None]
    tokens = torch.tensor([[3, 17, 42, 5, 99, 64][:num_nodes]])
    return tokens, mask, mask.sum(-1) - 1


def _logits(model: torch.nn.Module, prompt: torch.Tensor) -> torch.Tensor:
    """Logits of a prompt, then of a token tree over it (both paths of the forward)."""
    cache = model.new_cache(1, 32)
    first = model(prompt, cache)
    cache.commit(0, range(prompt.shape[1]))
    tokens, mask, depth = _tree_inputs()
    tree = model(tokens, cache, tree_mask=mask, positions=prompt.shape[1] + depth)
    return torch.cat([first, tree], dim=1)[0]  # (T, V)


@pytest.mark.parametrize("name", FORMATS)
def test_format_logits_match_float32(name: str) -> None:
    prompt = torch.tensor([[1, 7, 9, 33, 2, 8, 60, 11]])
    reference = _logits(q4_model(3)[0], prompt)
    model, blocks = q4_model(3)
    formatted = apply_format(model, name, stored=blocks)
    assert formatted.weight_format == name
    assert formatted.dtype == WeightFormat(name).activation_dtype
    logits = _logits(formatted, prompt)
    assert logits.dtype == torch.float32
    spread = (reference.amax(-1) - reference.amin(-1))[:, None]  # (T, 1)
    error = ((logits - reference).abs() / spread).max().item()
    assert error <= LOGIT_TOLERANCE[name], f"{name}: relative logit error {error:.4f}"
    if name != "float32":  # the check must be able to fail: a format is not float32 exactly
        assert error > 0


def test_float32_format_fuses_projections_exactly_as_unfused() -> None:
    """Fused QKV and gate/up in float32 compute what the separate projections compute."""
    prompt = torch.tensor([[4, 8, 15, 16, 23, 42]])
    reference = _logits(make_tiny_model(5, **FORMAT_DIMS), prompt)
    fused = apply_format(make_tiny_model(5, **FORMAT_DIMS), "float32")
    assert fused.layers[0].self_attn.qkv_proj is not None and not hasattr(fused.layers[0].self_attn, "q_proj")
    torch.testing.assert_close(_logits(fused, prompt), reference, rtol=1e-5, atol=1e-5)


def test_apply_format_refuses_twice_and_non_float32() -> None:
    model = apply_format(make_tiny_model(0, **FORMAT_DIMS), "bfloat16")
    with pytest.raises(ValueError, match="already formatted"):
        apply_format(model, "int8")
    with pytest.raises(ValueError, match="unknown weight format 'int3'"):
        WeightFormat.parse("int3")
    with pytest.raises(FormatUnsupportedError, match="divisible by 32"):
        apply_format(make_tiny_model(0), "q4_1")  # dim 48
    assert apply_format(make_tiny_model(0), AUTO_FORMAT).weight_format == "bfloat16"  # auto: q4_1 only where it fits
    assert apply_format(make_tiny_model(0, **FORMAT_DIMS), AUTO_FORMAT).weight_format == "q4_1"
    config = make_tiny_model(0, **FORMAT_DIMS).config
    assert resolve_format(AUTO_FORMAT, config, torch.device("cuda")) is WeightFormat.BFLOAT16  # int kernels: CPU only
    # auto on a GGUF is its stored format: q4_1 for Q4_1 linears, gguf for any other mix.
    q4_1 = {"layers.0.self_attn.q_proj.weight": "Q4_1", "layers.0.input_layernorm.weight": "F32", "embed_tokens.weight": "Q8_0"}
    assert resolve_format(AUTO_FORMAT, config, None, q4_1) is WeightFormat.Q4_1
    mixed = {**q4_1, "layers.0.mlp.down_proj.weight": "Q6_K"}
    assert resolve_format(AUTO_FORMAT, config, None, mixed) is WeightFormat.GGUF


def test_int_formats_refuse_cuda_with_a_clear_error() -> None:
    weight = torch.zeros(64, 64)
    for fmt in (WeightFormat.INT8, WeightFormat.Q4_1, WeightFormat.GGUF):
        with pytest.raises(FormatUnsupportedError, match="CPU kernels only"):
            make_linear(fmt, weight, None, device=torch.device("cuda"))


def test_q4_1_kernel_computes_with_the_blocks_values() -> None:
    """The int4 kernel multiplies by ``d q + m`` up to the bf16 rounding of its scale and zero
    (relative 2^-9 of each): checked by multiplying the identity through the kernel."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 128, generator=gen)
    blocks = q4_blocks_from_float(weight)
    linear = Int4Linear(blocks, None)
    identity = torch.eye(128, dtype=torch.bfloat16)
    seen = linear(identity).float().t()  # (N, K): the weights as the kernel applies them
    exact = blocks.dequantize()
    scale = blocks.scale.float().abs().repeat_interleave(32, dim=1)
    zero = (blocks.minimum.float() + 8 * blocks.scale.float()).abs().repeat_interleave(32, dim=1)
    # bf16 rounding of scale (times |q - 8| <= 8) and zero, plus the bf16 output of the product.
    bound = 2.0**-8 * (8 * scale + zero) + 2.0**-8 * exact.abs() + 1e-7
    assert bool(((seen - exact).abs() <= bound).all())
    # A wrong code layout (the nibble order flipped) must fail the same check.
    flipped = Int4Linear(Q4Blocks(15 - blocks.codes, blocks.scale, blocks.minimum), None)
    assert not bool(((flipped(identity).float().t() - exact).abs() <= bound).all())


def test_q4_1_raw_blocks_decode_like_ggml() -> None:
    """``block_q4_1``: d, m (float16), then low nibbles = elements 0..15, high = 16..31."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(3, 64), dtype=np.uint8)
    d = rng.standard_normal((3, 2)).astype(np.float16)
    m = rng.standard_normal((3, 2)).astype(np.float16)
    raw = np.zeros((3, 2, 20), dtype=np.uint8)
    for r in range(3):
        for b in range(2):
            block = codes[r, b * 32:(b + 1) * 32]
            raw[r, b, 0:2] = np.frombuffer(d[r, b].tobytes(), dtype=np.uint8)
            raw[r, b, 2:4] = np.frombuffer(m[r, b].tobytes(), dtype=np.uint8)
            raw[r, b, 4:] = block[:16] | (block[16:] << 4)
    blocks = BLOCK_TYPES["Q4_1"].stored(raw.reshape(3, 40), rows=3)
    assert np.array_equal(blocks.codes.numpy(), codes)
    expected = d.astype(np.float32).repeat(32, axis=1) * codes + m.astype(np.float32).repeat(32, axis=1)
    assert np.array_equal(blocks.dequantize().numpy(), expected)


def test_weight_bytes_per_token_counts_the_formats_storage() -> None:
    sizes = {name: weight_bytes_per_token(apply_format(make_tiny_model(0, **FORMAT_DIMS), name)) for name in FORMATS}
    assert sizes["float32"] == 2 * sizes["bfloat16"]
    assert sizes["q4_1"] < sizes["int8"] < sizes["bfloat16"]


@pytest.mark.model
def test_q4_1_reproduces_the_ggufs_blocks(default_model) -> None:
    """On the real GGUF: the blocks decode to exactly the dequantized float32 weights, and the
    served q4_1 model's kernels apply them within the bf16 rounding of scale and zero."""
    from treeserve.models import stored_blocks_of

    blocks = stored_blocks_of(default_model.source)
    state = default_model.model.state_dict()
    assert len(blocks) == 210
    for name, b in blocks.items():
        assert torch.equal(b.dequantize(), state[name]), name
    layer = Int4Linear(blocks["layers.7.self_attn.q_proj.weight"], None)
    seen = layer(torch.eye(layer.in_features, dtype=torch.bfloat16)).float().t()
    exact = state["layers.7.self_attn.q_proj.weight"]
    assert (seen - exact).abs().max().item() <= 2.0**-7 * exact.abs().max().item()


@pytest.mark.parametrize("name", ["q4_1", "int8"])
def test_saved_format_is_read_back_and_computes_the_same(tmp_path, monkeypatch, name: str) -> None:  # type: ignore[no-untyped-def]
    """``prepare_for_serving`` saves the int kernels' buffers on the first load, and a second
    load reads them back instead of packing or quantizing; the weights' files are in the key."""
    from treeserve import models
    from treeserve.ops import formats

    source = tmp_path / "weights"
    source.mkdir()
    (source / "model.safetensors").write_bytes(b"stand-in for the weights' file")
    first = models.prepare_for_serving(make_tiny_model(3, **FORMAT_DIMS), source, name, cache_dir=tmp_path,
                                       compile_decode=False)
    saved = models._formatted_path(make_tiny_model(3, **FORMAT_DIMS), source, WeightFormat(name), tmp_path)
    assert saved.exists()

    def no_packing(*args: object) -> None:
        raise AssertionError("the second load packed the weights again")

    monkeypatch.setattr(formats, "int4_buffers", no_packing)
    monkeypatch.setattr(formats, "int8_buffers", no_packing)
    second = models.prepare_for_serving(make_tiny_model(3, **FORMAT_DIMS), source, name, cache_dir=tmp_path,
                                        compile_decode=False)
    tokens = torch.tensor([[1, 5, 7, 2]])
    assert torch.equal(first(tokens, first.new_cache(1, 8)), second(tokens, second.new_cache(1, 8)))
    (source / "model.safetensors").write_bytes(b"other weights")  # a changed file: another key
    assert models._formatted_path(make_tiny_model(3, **FORMAT_DIMS), source, WeightFormat(name), tmp_path) != saved


def test_bfloat16_needs_no_onednn_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU where oneDNN has no bf16 (AVX2 only: it refuses to reorder the weight), the
    bfloat16 format falls back to ``F.linear`` on the same bf16 values instead of failing to load."""
    from treeserve.ops import formats

    weight = torch.randn(64, 32)
    x = torch.randn(3, 32).bfloat16()
    monkeypatch.setattr(formats, "onednn_bf16", lambda: False)
    plain = formats.make_linear(WeightFormat.BFLOAT16, weight, None)
    assert isinstance(plain, formats.DenseLinear)
    assert torch.equal(plain(x), torch.nn.functional.linear(x, weight.bfloat16()))
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        monkeypatch.setattr(formats, "onednn_bf16", lambda: True)
        packed = formats.make_linear(WeightFormat.BFLOAT16, weight, None)
        assert isinstance(packed, formats.OneDnnLinear)
        assert (packed(x).float() - plain(x).float()).abs().max() <= 0.05


def test_auto_serves_bfloat16_with_one_warning_where_a_stored_type_has_no_kernel(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """A GGUF whose linears need the 8-bit-code kernel, on a machine where it does not run (no
    AVX2 or no compiler): auto names the types and the fallback once, and serves bfloat16; 4-bit
    types alone keep the gguf format (the 4-bit kernel has torch's fallback)."""
    import logging

    from treeserve.ops import formats
    from treeserve.ops.kernels import codes8

    config = make_tiny_model(0, **FORMAT_DIMS).config
    mixed = {"layers.0.mlp.down_proj.weight": "Q6_K", "layers.0.self_attn.q_proj.weight": "Q4_K",
             "embed_tokens.weight": "Q8_0"}
    monkeypatch.setattr(codes8, "available", lambda: False)
    monkeypatch.setattr(formats, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="treeserve.ops.formats"):
        assert resolve_format(AUTO_FORMAT, config, stored_types=mixed) is WeightFormat.BFLOAT16
        assert resolve_format(AUTO_FORMAT, config, stored_types=mixed) is WeightFormat.BFLOAT16
    warnings = [r.getMessage() for r in caplog.records if r.name == "treeserve.ops.formats"]
    assert len(warnings) == 1 and "Q6_K" in warnings[0] and "Q4_K" not in warnings[0] and "bfloat16" in warnings[0]
    four_bit = {"layers.0.mlp.down_proj.weight": "Q4_K", "layers.0.self_attn.q_proj.weight": "Q4_0"}
    assert resolve_format(AUTO_FORMAT, config, stored_types=four_bit) is WeightFormat.GGUF
    monkeypatch.setattr(codes8, "available", lambda: True)
    assert resolve_format(AUTO_FORMAT, config, stored_types=mixed) is WeightFormat.GGUF
