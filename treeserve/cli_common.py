"""What every ``treeserve`` subcommand shares: the user-error type, progress lines on stderr, the
model flags and the expansion flag. It imports nothing heavy (no torch): the command line reads
the model flags before anything else (:func:`treeserve.cli.prestart_verifier`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from treeserve.ops.expansion import DEFAULT_EXPANSION
from treeserve.ops.format_names import AUTO_FORMAT, FORMAT_NAMES

EXPANSION_HELP = f"expansion config of model speculators, e.g. {','.join(map(str, DEFAULT_EXPANSION))}"


class UserError(Exception):
    """A mistake in the command line or its inputs: reported as one line, exit status 2."""


def progress(report: Any) -> None:
    """Print a progress line (a ``treeserve.models.Progress`` or a plain string) to stderr."""
    text = report if isinstance(report, str) else f"{report.stage}: {report.message}"
    print(f"[treeserve] {text}", file=sys.stderr, flush=True)


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """``--model`` and ``--cache-dir``."""
    parser.add_argument("--model", default=None, help="registry name, .gguf file or HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="weight cache (default: $TREESERVE_CACHE or ~/.cache/treeserve)")


def add_format_flag(parser: argparse.ArgumentParser) -> None:
    """``--format`` (alias ``--dtype``): the weight format, as :mod:`treeserve.ops.formats` names them."""
    parser.add_argument(
        "--format", "--dtype", dest="dtype", choices=FORMAT_NAMES, default=AUTO_FORMAT,
        help=f"weight format (default {AUTO_FORMAT}: q4_1 where the model's shapes allow, else bfloat16; q4_1 keeps "
             "the GGUF's own 4-bit blocks and is fastest; float32 is the exact reference); --dtype is an alias")


def add_expansion_flag(parser: argparse.ArgumentParser) -> None:
    """``--expansion``, read by :func:`parse_expansion`."""
    parser.add_argument("--expansion", default=",".join(map(str, DEFAULT_EXPANSION)), help=EXPANSION_HELP)


def parse_expansion(text: str) -> tuple[int, ...]:
    """The ``--expansion`` value as widths per depth; :class:`UserError` when it is not one."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"--expansion must be comma-separated integers such as "
                        f"{','.join(map(str, DEFAULT_EXPANSION))}, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise UserError(f"--expansion values must be >= 1, got {text!r}")
    return values


def model_name(args: argparse.Namespace) -> str:
    """``--model``, or the default model."""
    from treeserve.ops.loaders.registry import DEFAULT_MODEL

    return str(args.model or DEFAULT_MODEL)


__all__ = ["UserError", "add_expansion_flag", "add_format_flag", "add_model_flags", "model_name", "parse_expansion", "progress"]
