"""results/ and the pages that show it: every table a page shows is its result file's, rendered as it is now."""

import json
import os
import re
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import harness  # noqa: E402

KEYS = {"name", "command", "torch", "python", "machine", "date", "commit", "notes", "tables"}


def test_every_page_shows_its_result_files_as_they_are():
    """`python benchmarks/harness.py` leaves every page as it is: what a page shows between its markers is its
    result file's table and the line that says how it was measured."""
    for page in harness.PAGES:
        assert page.read_text() == harness.rendered(page), f"{page.name}: run python benchmarks/harness.py"


def test_every_result_file_says_how_it_was_measured_and_every_table_is_shown():
    shown = {(match["name"], match["table"]) for page in harness.PAGES
             for match in harness.MARKER.finditer(page.read_text())}
    files = sorted((REPO / "results").glob("*.json"))
    assert files
    for path in files:
        result = json.loads(path.read_text())
        assert set(result) == KEYS and result["name"] == path.stem, path
        assert result["command"].startswith("python ") and result["commit"] and result["machine"], path
        for title, table in result["tables"].items():
            assert (path.stem, title) in shown, f"{path.name}: table {title!r} is on no page"
            assert all(len(row) == len(table["columns"]) for row in table["rows"]), (path, title)
    assert {name for name, _ in shown} <= {path.stem for path in files}


def test_a_table_renders_with_its_measurement(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "RESULTS", tmp_path)
    (tmp_path / "demo.json").write_text(json.dumps({
        "name": "demo", "command": "python benchmarks/demo.py", "torch": "2.15.0", "python": "3.11.7",
        "machine": "a CPU, 2 cores", "date": "2026-11-29", "commit": "abc1234", "notes": "Seeds 1-8.",
        "tables": {"Speed": {"columns": ["variant", "s", "runs"], "rows": [["a", 1.23456, 8], ["b", 12345.6, None]]}}}))
    assert harness.table_markdown("demo", "Speed") == (
        "| variant | s | runs |\n| --- | --- | --- |\n| a | 1.235 | 8 |\n| b | 12,346 | – |\n\n"
        "`python benchmarks/demo.py`: torch 2.15.0, Python 3.11.7, a CPU, 2 cores, 2026-11-29, commit abc1234 "
        "([results/demo.json](../results/demo.json)). Seeds 1-8.\n")
    assert harness.table_markdown("demo", "Speed", first=False).endswith(  # a page's next table of the same run
        "| b | 12,346 | – |\n\nThe same run ([results/demo.json](../results/demo.json)).\n")


def test_a_result_that_cannot_be_written_keeps_the_previous_one(tmp_path, monkeypatch):
    """The disk fills up while a benchmark writes its result: Python's error, and the previous file stays whole."""
    harness.write_result("demo", {"Speed": {"columns": ["s"], "rows": [[1.0]]}}, folder=tmp_path)
    before = (tmp_path / "demo.json").read_text()

    def full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        harness.write_result("demo", {"Speed": {"columns": ["s"], "rows": [[2.0]] * 10**5}}, folder=tmp_path)
    assert (tmp_path / "demo.json").read_text() == before and json.loads(before)["tables"]["Speed"]["rows"] == [[1.0]]


def test_no_result_names_a_path_outside_the_repository_or_code_that_no_commit_holds():
    """Every result file's command is one a reader types in a clone, and it was measured on a commit."""
    def strings(value):
        if isinstance(value, dict):
            return [text for item in value.values() for text in strings(item)]
        if isinstance(value, list):
            return [text for item in value for text in strings(item)]
        return [value] if isinstance(value, str) else []
    for path in sorted((REPO / "results").glob("*.json")):
        result = json.loads(path.read_text())
        assert re.fullmatch(r"[0-9a-f]{7,40}", result["commit"]), (path.name, result["commit"])
        for text in strings(result):
            assert not harness.OUTSIDE.search(text), (path.name, text)


@pytest.mark.parametrize("argv, git_status, message", [
    (["--seeds", "1"], " M rpc_rl.py", "the code differs from commit abc1234 (rpc_rl.py): commit first"),
    (["--seeds", "1"], "?? helper.py", "the code differs from commit abc1234 (helper.py): commit first"),
    (["--data-dir", "../shared/data"], "", "names a path outside the repository"),
    (["--python", "/work/venvs/py3.12/bin/python"], "", "names a path outside the repository"),
    (["--out", "~/results"], "", "names a path outside the repository"),
    (["--python", "3.12", "--python", "3.11 torch==2.11.0", "--seeds", "1,2"], "", None),
    (["--lr", "0.1/2", "--note", "https://d2l.ai/x"], "", None),
])
def test_a_result_of_uncommitted_code_or_by_a_path_outside_the_repository_is_refused(argv, git_status, message,
                                                                                      monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", [str(REPO / "benchmarks" / "bench_demo.py"), *argv])
    monkeypatch.setattr(harness, "git", lambda *args: git_status if args[0] == "status" else "abc1234")
    monkeypatch.setattr(harness, "RESULTS", tmp_path)
    tables = {"Speed": {"columns": ["s"], "rows": [[1.0]]}}
    if message is None:
        assert harness.write_result("demo", tables)["command"] == "python benchmarks/bench_demo.py " + " ".join(argv)
        return
    with pytest.raises(SystemExit) as exit_info:
        harness.write_result("demo", tables)
    assert str(exit_info.value).startswith("python benchmarks/bench_demo.py ") and message in str(exit_info.value)
    assert list(tmp_path.iterdir()) == []
