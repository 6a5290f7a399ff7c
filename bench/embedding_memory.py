"""Memory of a served model with its tied embedding read out of the LM head's codes
(``ops/embedding.py``) and with the bf16 table it replaces, side by side in one run.

Each variant loads the model as served (``--format auto``) in a fresh process and reports the
bytes of the distinct tensor storages the model holds (parameters and buffers) and the
process's resident set after ``malloc_trim`` (freed memory handed back to the system):

    python bench/embedding_memory.py [--model NAME_OR_FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys

from treeserve.models import DEFAULT_MODEL


def measure(model_name: str, shared: bool) -> dict[str, object]:
    """Load ``model_name`` as served, with the shared embedding or with the table; its figures."""
    from treeserve.models import load_model
    from treeserve.ops import formats

    if not shared:
        formats.packed_embedding = lambda head, table: None  # type: ignore[assignment]
    model = load_model(model_name, weight_format="auto", compile_decode=False).model
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers())}
    status = {line.split(":")[0]: int(line.split()[1]) for line in open("/proc/self/status", encoding="ascii")
              if line.startswith(("VmRSS", "RssAnon", "RssFile"))}
    return {"embedding": type(model.embed_tokens).__name__, "weight_format": model.weight_format,
            "tensor_mb": round(sum(storages.values()) / 2**20, 1), "rss_mb": round(status["VmRSS"] / 1024, 1),
            "rss_anon_mb": round(status["RssAnon"] / 1024, 1), "rss_file_mb": round(status["RssFile"] / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--variant", choices=("shared", "table"), help=argparse.SUPPRESS)  # one process's run
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure(args.model, args.variant == "shared")))
        return
    found = {}
    for variant in ("table", "shared"):
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--variant", variant],
                             check=True, capture_output=True, text=True).stdout
        found[variant] = json.loads(out.strip().splitlines()[-1])
    print(json.dumps({"model": args.model, **found}, indent=1))


if __name__ == "__main__":
    main()
