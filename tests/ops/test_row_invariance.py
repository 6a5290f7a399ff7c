"""One answer in q4_1: every forward gives a request's row the same bits as the one-token step
computes for it alone (the checks of ``row_invariance.py``: chains of 3/16/64, trees of 16 and
40 nodes, prefills whole and in pieces, a batched prefill, steps among 1/3/16/64 rows).

On the real default model (marked ``model``) on this host's own ISA path and on every lesser
one it can force (``TREESERVE_ISA``, each in a process of its own, since a process loads its
kernels once), with ``compile_decode`` on and off; on a tiny random model for the fast path,
with prompts that stay in one of the attention's 128-key segments and that cross two.

Across ISA paths as well: the fused op's AVX-512 and AVX2 builds compute the same bits (a tiny
model, on the AVX2 product), and a process capped at a lesser path gives the default model the
host's own logits.

The checks catch a row-count-dependent kernel: a head that sums its products in another order
above four rows (the same weights, a reordered reduction, as a GEMM that picks its kernel by
shape does) fails the batched ones. The previous forward (bf16 tiles for prefill attention, a
slot-ordered softmax, inductor's fusions) failed ten of the thirteen checks it then had (all
but the 40-node tree) on the default model.
"""

from __future__ import annotations

import json
import os
from importlib import resources
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from treeserve.ops.decode_step import DecodeStep
from treeserve.ops.formats import apply_format
from treeserve.ops.kernels import cpp_build
from treeserve.ops.model import Transformer

from . import row_invariance
from .conftest import make_tiny_model
from .row_invariance import PROMPT, other_prompts

HERE = Path(__file__).parent


class ReorderedHead(nn.Module):
    """A deliberately row-count-dependent head: above four rows it sums each row's products in
    two halves of K and adds them (the same weights and products, another order)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        if x.reshape(-1, x.shape[-1]).shape[0] <= 4:
            return self.inner(x)
        half = x.shape[-1] // 2
        low, high = x.clone(), x.clone()
        low[..., half:] = 0
        high[..., :half] = 0
        return self.inner(low) + self.inner(high)


def _host_levels() -> list[str]:
    flags = cpp_build.cpu_flags()
    levels = ["avx2"] if {"avx2", "fma", "f16c"} <= flags else []
    if {"avx512bw", "avx512_bf16", "avx512_vnni"} <= flags:
        levels.append("avx512")
    if {"amx_tile", "amx_bf16"} <= flags:
        levels.append("amx")
    return levels


# ------------------------------------------------------------------ a tiny model: the fast path

def tiny_q4() -> Transformer:
    model = apply_format(make_tiny_model(5, vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                         head_dim=16, ffn_dim=128, max_seq_len=512), "q4_1")
    step = DecodeStep(model)
    if not step.fuse():
        pytest.skip("the fused q4_1 forward needs AVX2, FMA and F16C and a C++ compiler")
    model.decode_step = step
    return model


@pytest.mark.parametrize("prompt_length", [37, 250])  # one segment of 128 keys, and three
def test_tiny_q4_1_forward_is_row_invariant(prompt_length: int) -> None:
    model = tiny_q4()
    prompt = torch.randint(3, 256, (prompt_length,), generator=torch.Generator().manual_seed(2)).tolist()
    assert row_invariance.failures(model, prompt, other_prompts(256)) == []


def test_a_row_count_dependent_head_fails_the_checks() -> None:
    model = tiny_q4()
    model.head_kernel = ReorderedHead(model.head_kernel)
    prompt = torch.randint(3, 256, (37,), generator=torch.Generator().manual_seed(2)).tolist()
    failed = row_invariance.failures(model, prompt, other_prompts(256))
    assert "chain of 16" in failed and "step among 16 rows" in failed and "step among 64 rows" in failed
    assert "step among 1 rows" not in failed  # at most four rows it is the real head


# ------------------------------------------------------------------ the default model

@pytest.fixture(scope="module")
def q4_model(default_model_cache_dir: Path):  # type: ignore[no-untyped-def]
    from treeserve.models import DEFAULT_MODEL, load_model

    loaded = load_model(DEFAULT_MODEL, weight_format="q4_1", compile_decode=False, cache_dir=default_model_cache_dir)
    step = loaded.model.decode_step
    if not isinstance(step, DecodeStep) or not step.is_fused:
        pytest.skip("the fused q4_1 forward needs AVX2, FMA and F16C and a C++ compiler")
    return loaded


@pytest.mark.model
def test_default_model_forward_is_row_invariant(q4_model) -> None:  # type: ignore[no-untyped-def]
    prompt = q4_model.tokenizer.encode(PROMPT)
    assert row_invariance.failures(q4_model.model, prompt, other_prompts(q4_model.config.vocab_size)) == []


@pytest.mark.model
def test_default_model_long_prompt_is_row_invariant(q4_model) -> None:  # type: ignore[no-untyped-def]
    """A prompt of about 200 tokens: every token attends across two or three segments."""
    text = resources.files("treeserve.ops").joinpath("data/english.txt").read_text(encoding="utf-8")
    prompt = q4_model.tokenizer.encode_chat([{"role": "user", "content": text[:900]}])
    assert len(prompt) > 150
    assert row_invariance.failures(q4_model.model, prompt, other_prompts(q4_model.config.vocab_size)) == []


@pytest.mark.model
def test_default_model_row_count_dependent_head_is_caught(q4_model) -> None:  # type: ignore[no-untyped-def]
    model = q4_model.model
    real = model.head_kernel
    model.head_kernel = ReorderedHead(real)
    try:
        failed = row_invariance.failures(model, q4_model.tokenizer.encode(PROMPT), other_prompts(model.config.vocab_size))
    finally:
        model.head_kernel = real
    assert {"chain of 16", "16-node tree", "40-node tree", "step among 16 rows", "step among 64 rows"} <= set(failed)


@pytest.mark.model
def test_compiling_changes_nothing_in_q4_1(q4_model, default_model_cache_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """``compile_decode`` (``--compile yes``) serves the same fused op: nothing is compiled, and
    the logits of a prefill, a tree and a step are the same bits."""
    from treeserve.models import DEFAULT_MODEL, load_model

    compiled = load_model(DEFAULT_MODEL, weight_format="q4_1", compile_decode=True, cache_dir=default_model_cache_dir)
    step = compiled.model.decode_step
    assert isinstance(step, DecodeStep) and step.is_fused and not step.is_compiled
    prompt = q4_model.tokenizer.encode(PROMPT)
    eager = row_invariance.reference(q4_model.model, prompt, 8)
    again = row_invariance.reference(compiled.model, prompt, 8)
    assert torch.equal(eager[0], again[0]) and eager[1] == again[1] and torch.equal(eager[2], again[2])


LESSER = [level for level in _host_levels()[:-1]]
LESSER_PARAMS = LESSER or [pytest.param("none", marks=pytest.mark.skip("no lesser ISA path here"))]


def _run_capped(script: str, level: str | None) -> str:
    """``script`` in a fresh interpreter whose kernels are capped at ``level`` (None: the
    host's own path); its stdout."""
    env = {k: v for k, v in os.environ.items() if k != cpp_build.ISA_ENV}
    if level:
        env[cpp_build.ISA_ENV] = level
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout

_BUILD_SCRIPT = """
import sys, torch
sys.path.insert(0, {here!r})
from conftest import make_tiny_model
from treeserve.ops.decode_step import DecodeStep
from treeserve.ops.formats import apply_format
from treeserve.ops.kernels import decode_layers
model = apply_format(make_tiny_model(5, vocab_size=256, dim=64, num_layers=2, num_heads=6, num_kv_heads=2,
                                     head_dim=32, ffn_dim=128, max_seq_len=512), "q4_1")
step = DecodeStep(model)
assert step.fuse()
step._kernel = 0  # the AVX2 q4_1 product (same packing as the int8-row kernel): only the builds differ
model.decode_step = step
gen = torch.Generator().manual_seed(4)
cache = model.new_cache(2, 400)
prefill = model(torch.randint(3, 256, (2, 300), generator=gen), cache)
tree = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])
step_logits = model(torch.randint(3, 256, (2, 3), generator=gen), cache, tree_mask=tree[None].expand(2, 3, 3))
torch.save({{"flags": list(decode_layers.flags()), "prefill": prefill, "tree": step_logits}}, {out!r})
"""


@pytest.mark.skipif("avx512" not in _host_levels(), reason="one build here: the host has no AVX-512")
def test_the_ops_avx512_and_avx2_builds_compute_the_same_bits(tmp_path: Path) -> None:
    """decode_layers.cpp's attention is written on simd16's 16 lanes, folded and summed alike in
    one zmm register or two ymm halves: its AVX-512 build gives the AVX2 build's logits bit for
    bit (a prefill across three 128-key segments and a tree step; both on the AVX2 product)."""
    results = []
    for level in ("avx512", "avx2"):
        out = tmp_path / f"{level}.pt"
        _run_capped(_BUILD_SCRIPT.format(here=str(HERE), out=str(out)), level)
        results.append(torch.load(out))
    wide, narrow = results
    assert "-mavx512f" in wide["flags"] and "-mavx512f" not in narrow["flags"]
    assert torch.equal(wide["prefill"], narrow["prefill"]) and torch.equal(wide["tree"], narrow["tree"])


@pytest.mark.model
@pytest.mark.parametrize("level", LESSER_PARAMS)
def test_lesser_isa_paths_are_row_invariant(level: str, default_model_cache_dir: Path) -> None:
    """The same checks in a process whose kernels are capped at ``level`` (its q4_1 product:
    the AVX2 kernel for ``avx2``, int8 rows on AVX512-VNNI for ``avx512``)."""
    script = (
        "import json, sys, torch\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "import row_invariance as t\n"
        "from treeserve.models import DEFAULT_MODEL, load_model\n"
        f"m = load_model(DEFAULT_MODEL, weight_format='q4_1', compile_decode=False, cache_dir={str(default_model_cache_dir)!r})\n"
        "step = m.model.decode_step\n"
        "failed = t.failures(m.model, m.tokenizer.encode(t.PROMPT), t.other_prompts(m.config.vocab_size))\n"
        "print(json.dumps({'kernel': getattr(step, '_kernel', None), 'failed': failed}))\n"
    )
    result = json.loads(_run_capped(script, level).strip().splitlines()[-1])
    assert result["kernel"] == (0 if level == "avx2" else 1)
    assert result["failed"] == []


_LOGITS_SCRIPT = """
import sys, torch
sys.path.insert(0, {here!r})
import row_invariance as t
from treeserve.models import DEFAULT_MODEL, load_model
m = load_model(DEFAULT_MODEL, weight_format="q4_1", compile_decode=False, cache_dir={cache!r})
ids = m.tokenizer.encode(t.PROMPT)
cache = m.model.new_cache(1, len(ids) + 8)
prefill = m.model(torch.tensor([ids]), cache)
tree = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])[None]
step = m.model(torch.tensor([[5, 6, 7]]), cache, tree_mask=tree)
torch.save({{"prefill": prefill, "tree": step}}, {out!r})
"""


@pytest.mark.model
@pytest.mark.parametrize("level", LESSER_PARAMS)
def test_lesser_isa_paths_give_the_hosts_logits(level: str, default_model_cache_dir: Path, tmp_path: Path) -> None:
    """Across ISA paths too: a process capped at ``level`` gives the README's prompt (a prefill,
    then a 3-node tree) the host's own logits, bit for bit. The int8-row products of the AVX2
    and AVX512-VNNI kernels, the int16 head and the op's two builds all sum alike (measured on
    Zen 4: the AVX2 and AVX-512 paths; an AMX host's is not measured yet)."""
    results = []
    for cap in (None, level):
        out = tmp_path / f"{cap}.pt"
        _run_capped(_LOGITS_SCRIPT.format(here=str(HERE), cache=str(default_model_cache_dir), out=str(out)), cap)
        results.append(torch.load(out))
    host, lesser = results
    assert torch.equal(host["prefill"], lesser["prefill"]) and torch.equal(host["tree"], lesser["tree"])

