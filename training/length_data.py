"""The length predictor's training data: recorded output lengths (``bench/data/predictor_lengths_*.csv``,
:func:`read_length_csv`) joined with their prompts (:func:`load_length_data`), and the fixed
split of every prompt set into training and test prompts (:func:`is_test_prompt`)."""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treeserve.ops.length_predictor import PredictorError

TEST_FRACTION = 0.2
"""Share of every prompt set held out as test prompts (:func:`is_test_prompt`)."""


def is_test_prompt(dataset: str, prompt_id: str) -> bool:
    """Whether ``(dataset, id)`` is in the held-out test split: about :data:`TEST_FRACTION` of
    every set, fixed by a hash (no seed, no file). The predictor never trains on these, and the
    scheduling benchmark's traces take their prompts only from them."""
    digest = hashlib.sha256(f"{dataset}/{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") < TEST_FRACTION * 2**32


@dataclass(frozen=True)
class LengthExample:
    """One recorded prompt: where it came from, its chat-templated ids and the real output length."""

    dataset: str
    id: str
    prompt_ids: tuple[int, ...]
    num_output_tokens: int
    is_capped: bool


def read_length_csv(path: str | Path) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """The provenance header (``# key: json``) and the rows of a ``bench/predictor_data.py`` CSV."""
    header: dict[str, Any] = {}
    lines = Path(path).read_text(encoding="utf-8").split("\n")
    body = []
    for line in lines:
        if line.startswith("# "):
            key, _, value = line[2:].partition(": ")
            header[key] = json.loads(value)
        elif line.strip():
            body.append(line)
    return header, list(csv.DictReader(body))


def load_length_data(csv_path: str | Path | Sequence[str | Path], prompts_dir: str | Path,
                     tokenizer: Any) -> tuple[dict[str, Any], list[LengthExample]]:
    """Join the CSV rows (one file or several) with the prompt files (``<prompts_dir>/<dataset>.jsonl``) by id.

    Each prompt is checked against the row's ``prompt_sha256`` and re-tokenized with the chat
    template; a row whose prompt is missing or differs raises :class:`PredictorError`. The
    header returned is the first file's; a later file's ``max_tokens`` must agree with it.
    """
    paths = [csv_path] if isinstance(csv_path, str | Path) else list(csv_path)
    header: dict[str, Any] = {}
    rows: list[dict[str, str]] = []
    for path in paths:
        file_header, file_rows = read_length_csv(path)
        if header and file_header.get("max_tokens") != header.get("max_tokens"):
            raise PredictorError(f"{path} was recorded with max_tokens {file_header.get('max_tokens')}, "
                                 f"not {header.get('max_tokens')}")
        header = header or file_header
        rows.extend(file_rows)
    prompts: dict[tuple[str, str], str] = {}
    for dataset in sorted({r["dataset"] for r in rows}):
        path = Path(prompts_dir) / f"{dataset}.jsonl"
        if not path.exists():
            raise PredictorError(f"{path} is missing: run python bench/data/fetch.py {dataset}")
        for line in path.read_text(encoding="utf-8").split("\n"):
            if line.strip():
                record = json.loads(line)
                prompts[(dataset, str(record["id"]))] = record["prompt"]
    examples = []
    for row in rows:
        prompt = prompts.get((row["dataset"], row["id"]))
        if prompt is None or hashlib.sha256(prompt.encode("utf-8")).hexdigest() != row["prompt_sha256"]:
            raise PredictorError(f"prompt {row['dataset']}/{row['id']} is missing or differs from the recorded one")
        ids = tuple(int(t) for t in tokenizer.encode_chat([{"role": "user", "content": prompt}]))
        examples.append(LengthExample(row["dataset"], row["id"], ids, int(row["num_output_tokens"]),
                                      row["is_capped"] == "1"))
    return header, examples


