"""``python -m treeserve.ops.loaders.build_step SOURCE FORMAT ARTIFACT [--cache-dir DIR]``: load a
model, put it into a weight format and compile its decode step into ``ARTIFACT``, at a lower CPU
priority, for a server that serves eagerly meanwhile and loads the file afterwards
(:func:`~treeserve.ops.loaders.prepare.build_out_of_process`, which says why it is a process).
It exits when its stdin closes: the server that started it ended.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from treeserve.ops.loaders.prepare import BUILD_NICENESS

__all__ = ["main"]


def _exit_with_parent() -> None:
    """Exit as soon as stdin reaches EOF: the server that started this build closes it when it
    ends or dies (a death pipe), and a build with minutes of compiling left must not outlive it."""
    def watch() -> None:
        while os.read(0, 4096):  # the raw descriptor: no buffer lock held at interpreter exit
            pass
        os._exit(1)

    threading.Thread(target=watch, name="death-pipe", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    """Load the model, format it and compile its decode step into the given artifact path;
    status 3 when the model's step would be saved under another name (the caller's model
    differs: a tensor-parallel shard, other code), 1 when compiling failed."""
    parser = argparse.ArgumentParser(prog="python -m treeserve.ops.loaders.build_step")
    parser.add_argument("source", help="the .gguf file or folder the model was loaded from")
    parser.add_argument("weight_format")
    parser.add_argument("artifact", type=Path, help="where the compiled step must be saved")
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args(argv)
    _exit_with_parent()
    os.nice(BUILD_NICENESS)  # the compiler processes it starts inherit it
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(args.artifact.parent / "inductor"))
    from treeserve.ops.decode_step import DecodeStep, artifact_name
    from treeserve.ops.loaders.load import load_model

    model = load_model(args.source, weight_format=args.weight_format, cache_dir=args.cache_dir,
                       compile_decode=False).model
    if artifact_name(model) != args.artifact.name:
        print(f"this model's step is {artifact_name(model)}, not {args.artifact.name}", file=sys.stderr)
        return 3
    step = DecodeStep(model, artifact=args.artifact)
    step.prepare()
    return 0 if step.is_compiled else 1


if __name__ == "__main__":
    sys.exit(main())
