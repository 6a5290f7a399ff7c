#!/bin/sh
# Prepare, on a machine with network, what bench/gpu_check.py needs on the GPU machine (no
# network there; Python 3.12, torch with CUDA, cupy-cuda13x, msgpack, uvloop, pytest already in):
#
#   .whl/                 pyzmq, gguf and pytest-asyncio as cp312 manylinux wheels (about 1 MB)
#   .gpu/tokenizer/       the default model's tokenizer files and shapes (3.5 MB), for the
#                         random-weight twin used when its weights cannot travel
#   .gpu/mtbench.jsonl    MT-Bench's prompts (bench/data/fetch.py), for the speed step
#   .gpu-a/, .gpu-b/      with --gguf: the default model's GGUF (98 MB) cut in two halves, one
#                         per device call (a call carries at most 64 MiB with the repo)
#
# All of them are ignored through .git/info/exclude. Run from anywhere in the checkout:
#
#   sh bench/gpu_wheels.sh [--gguf]
#
# The default model must have been pulled here first (`treeserve pull`) for the tokenizer and
# the GGUF. The README's GPU section gives the device calls that use these.
set -eu
cd "$(git rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
for path in /.whl/ /.gpu/ /.gpu-a/ /.gpu-b/; do
    grep -qxF "$path" "$exclude" 2>/dev/null || echo "$path" >> "$exclude"
done

PY=${PYTHON:-python3}
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    pyzmq==27.3.0 gguf==0.19.0 pytest-asyncio==1.5.0
ls -l .whl

cache="${TREESERVE_CACHE:-$HOME/.cache/treeserve}"
converted="$(ls -d "$cache"/converted/SmolLM2-135M-Instruct* 2>/dev/null | head -n 1 || true)"
if [ -n "$converted" ]; then
    mkdir -p .gpu/tokenizer
    cp "$converted/tokenizer.json" "$converted/tokenizer_config.json" "$converted/treeserve-config.json" .gpu/tokenizer/
    ls -l .gpu/tokenizer
else
    echo "no converted default model under $cache: run \`treeserve pull\` first for the twin's tokenizer" >&2
fi

if [ -f bench/data/mtbench.jsonl ]; then  # the speed step's prompts (bench/data/*.jsonl are not committed)
    mkdir -p .gpu && cp bench/data/mtbench.jsonl .gpu/mtbench.jsonl
fi

if [ "${1:-}" = "--gguf" ]; then
    gguf="$cache/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
    [ -f "$gguf" ] || { echo "no GGUF at $gguf: run \`treeserve pull\` first" >&2; exit 1; }
    rm -rf .gpu-a .gpu-b && mkdir -p .gpu-a .gpu-b
    half=$(( ($(wc -c < "$gguf") + 1) / 2 ))
    head -c "$half" "$gguf" > .gpu-a/part
    tail -c +"$(( half + 1 ))" "$gguf" > .gpu-b/part
    ls -l .gpu-a .gpu-b
fi
