"""The ``zephon-torch`` command, run as a user would: ``python -m zephon_torch.cli ...``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from corpus import documents, write_jsonl
from fixtures_tokenizer import train_test_tokenizer

from zephon_torch import _cli_bench, cli
from zephon_torch.runners.iterator import PipelineIterator

pytestmark = pytest.mark.timeout(120)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zephon_torch.cli", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("runner", ["threads", "process"])
def test_demo_resumes_identically_and_reports_shapes_and_throughput(
        tmp_path: Path, runner: str) -> None:
    result = _cli("demo", "--docs", "800", "--seq-len", "64", "--runner", runner,
                  "--num-workers", "2", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout

    compared = re.search(r"resume: identical \((\d+) batches compared\)", out)
    assert compared and int(compared.group(1)) > 0, out
    batches = int(re.search(r"stop after (\d+) of (\d+) batches", out).group(2))
    assert int(compared.group(1)) == batches - batches // 2

    # Each tensor's own dtype (cu_seqlens is int32, as to_training makes it).
    assert re.search(r"input_ids \[8, 64\], labels \[8, 64\], positions \[8, 64\] "
                     r"\(torch.int64\), cu_seqlens \[8, \d+\] \(torch.int32\)", out), out
    rate = re.search(r": ([\d,]+) samples/s, ([\d,]+) tokens/s", out)
    assert rate and int(rate.group(1).replace(",", "")) > 0
    assert int(rate.group(2).replace(",", "")) > 0
    assert re.search(r"800 documents read = \d+ delivered \+ \d+ tombstoned", out)
    assert "positions (restart at each document): 0 1 2" in out

    # What --out keeps: the corpus, the tokenizer and a JSON checkpoint.
    assert len(list((tmp_path / "corpus").glob("*.jsonl"))) == 4
    assert (tmp_path / "tokenizer.json").is_file()
    state = json.loads((tmp_path / "checkpoint.json").read_text())
    assert {"version", "fingerprint", "lanes"} <= set(state)


def test_demo_fails_with_status_1_when_the_resume_is_not_exact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A loader that ignores the checkpoint restarts from the beginning: the
    # demo must notice and say so rather than print success.
    monkeypatch.setattr(PipelineIterator, "load_state_dict", lambda self, state: None)
    status = cli.main(["demo", "--docs", "300", "--seq-len", "64", "--runner", "inline",
                       "--out", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert status == 1
    assert "resume: DIFFERENT" in out and "resume: identical" not in out


def test_importing_the_cli_does_not_import_torch() -> None:
    code = "import sys, zephon_torch.cli; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"


def test_inspect_previews_batches_of_a_users_jsonl(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "a.jsonl", documents(150, seed=1))
    write_jsonl(data / "b.jsonl", documents(150, seed=2))
    _, tokenizer = train_test_tokenizer(tmp_path / "tok")

    result = _cli("inspect", str(data / "*.jsonl"), "--tokenizer", str(tokenizer),
                  "--seq-len", "32", "--batch-size", "4", "--batches", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "(jsonl; 300 documents)" in out
    assert re.search(r"^batch 0 \(lane \d+\): 4 rows", out, re.M)
    assert re.search(r"^batch 1 \(lane \d+\): 4 rows", out, re.M)
    assert "input_ids [4, 32], labels [4, 32], positions [4, 32]" in out
    assert re.search(r"padding \d+\.\d%", out)
    assert re.search(r"doc 0 \(\d+ tokens\): '\w", out)
    assert re.search(r"stats\(\): read [\d,]+, delivered \d+, tombstoned \d+", out)
    assert "stage fetch+decode_text+tokenize: {'microbatches'" in out  # one fused stage


def test_inspect_says_clearly_when_nothing_matches(tmp_path: Path) -> None:
    result = _cli("inspect", str(tmp_path / "missing" / "*.jsonl"))
    assert result.returncode == 2
    assert "matches no file" in result.stderr
    assert "Traceback" not in result.stderr


def test_bench_passes_arguments_through_to_the_benchmark() -> None:
    result = _cli("bench", "--help")
    assert result.returncode == 0, result.stderr
    assert "benchmarks/bench_NAME.py" in result.stdout
    assert "usage: bench_pipeline.py" in result.stdout


def test_bench_names_the_available_benchmarks_for_an_unknown_one() -> None:
    result = _cli("bench", "no_such_thing")
    assert result.returncode == 2
    assert "no benchmark 'no_such_thing'; available:" in result.stderr
    assert "pipeline" in result.stderr


def test_bench_without_a_source_checkout_explains_itself(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(_cli_bench, "_BENCHMARKS", tmp_path / "benchmarks")
    assert cli.main(["bench"]) == 2
    assert "source checkout" in capsys.readouterr().err


# --------------------------------------------------------------------------- errors and help


def _one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The command failed with status 2 and a single ``error:`` line, no traceback."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_inspect_of_a_parquet_file_without_a_text_column_names_its_columns(
        tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": [1, 2, 3], "content": ["a b", "c d", "e f"]}), path)
    for extra in ([], ["--tokenizer", str(train_test_tokenizer(tmp_path / "tok")[1])]):
        line = _one_line_error(_cli("inspect", str(path), *extra))
        assert "has no field 'text' (its fields: 'id', 'content')" in line
        assert "pass --field" in line
        assert str(path) in line


def test_inspect_with_a_missing_tokenizer_says_what_it_takes(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "a.jsonl", documents(20, seed=1))
    missing = tmp_path / "nope" / "tokenizer.json"
    line = _one_line_error(_cli("inspect", str(data), "--tokenizer", str(missing)))
    assert f"--tokenizer {missing}: tokenizer file '{missing}' does not exist" in line
    assert "nothing is downloaded" in line
    # A hub name is a path that does not exist either.
    line = _one_line_error(_cli("inspect", str(data), "--tokenizer", "gpt2"))
    assert line.startswith("error: --tokenizer gpt2: ") and "does not exist" in line


def test_inspect_with_a_file_that_is_not_a_tokenizer_says_so(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "a.jsonl", documents(20, seed=1))
    bogus = tmp_path / "tokenizer.json"
    bogus.write_text('{"not": "a tokenizer"}')
    line = _one_line_error(_cli("inspect", str(data), "--tokenizer", str(bogus)))
    assert f"--tokenizer {bogus}: could not load the tokenizer from '{bogus}'" in line


def test_inspect_of_a_chat_field_says_it_holds_chat_messages(tmp_path: Path) -> None:
    chat = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"},
                          {"role": "assistant", "content": "hello"}]} for i in range(20)]
    chat.write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = _one_line_error(_cli("inspect", str(chat), "--field", "messages"))
    assert "field 'messages' of " in line and " holds chat messages, not text" in line
    assert "Pipeline.tokenize_chat()" in line
    # Without --field (text): the record has no text field at all, only chat messages.
    line = _one_line_error(_cli("inspect", str(chat)))
    assert "has no field 'text' (its fields: 'messages') and its 'messages' holds chat " \
           "messages" in line
    assert "Pipeline.tokenize_chat()" in line


def test_inspect_of_json_lines_that_hold_no_text_says_what_they_hold(tmp_path: Path) -> None:
    arrays = tmp_path / "arrays.jsonl"
    arrays.write_text("[1, 2]\n[3]\n")
    line = _one_line_error(_cli("inspect", str(arrays)))
    assert "line 1 holds a list, not an object with a 'text' field" in line
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text('{"n": 3}\n')
    line = _one_line_error(_cli("inspect", str(numbers), "--field", "n"))
    assert f"field 'n' of {numbers} line 1 holds an int, not text; pass --field" in line


def test_help_shows_each_options_default() -> None:
    for command, expected in (("inspect", ["--seq-len SEQ_LEN", "(default: 2048)",
                                           "(default: text)", "(default: threads)"]),
                              ("demo", ["(default: 4000)", "(default: 256)"])):
        result = _cli(command, "--help")
        assert result.returncode == 0, result.stderr
        text = " ".join(result.stdout.split())  # argparse wraps lines
        for part in expected:
            assert part in text, (command, part, result.stdout)
        assert "(default: None)" not in text and "(default: False)" not in text


def test_the_progress_bar_counts_batches_in_words(tmp_path: Path) -> None:
    pytest.importorskip("tqdm")
    import fcntl
    import os
    import pty
    import struct
    import termios

    # tqdm draws its bar only on a terminal: give the command a real one, 120 columns wide.
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "zephon_torch.cli", "demo", "--docs", "300", "--seq-len", "64",
         "--runner", "inline", "--out", str(tmp_path)],
        stdin=subprocess.DEVNULL, stdout=follower, stderr=follower)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 1 << 16)
        except OSError:  # EIO: the command closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert proc.wait(timeout=120) == 0
    screen = b"".join(chunks).decode("utf-8", "replace")
    assert re.search(r"\d batches/s", screen), screen
    assert re.search(r"\d+ batches \[", screen), screen  # the uninterrupted run: no total
    assert not re.search(r"\dbatch", screen), screen


# --------------------------------------------------------------------------- issue 21: rough edges


@pytest.mark.parametrize(("option", "typed"), [("--seq-len", "0"), ("--seq-len", "-5"),
                                                ("--batch-size", "0"), ("--num-lanes", "0")])
def test_inspect_refuses_a_value_out_of_range_as_it_was_typed(tmp_path: Path, option: str,
                                                              typed: str) -> None:
    write_jsonl(tmp_path / "a.jsonl", documents(20, seed=1))
    result = _cli("inspect", str(tmp_path / "a.jsonl"), option, typed)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"error: argument {option}: must be at least 1, got {typed}" in result.stderr
    assert "max_length" not in result.stderr and "Traceback" not in result.stderr


def test_inspect_with_a_small_shuffle_buffer_names_this_commands_default(
        tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", documents(20, seed=1))
    line = _one_line_error(_cli("inspect", str(tmp_path / "a.jsonl"), "--shuffle-buffer", "4"))
    assert "--shuffle-buffer 4 over --num-lanes 8" in line
    assert "Pass --shuffle-buffer 9 or more (this command's default is 1024)" in line
    assert "8192" not in line


def test_inspect_of_a_folder_reads_the_files_of_its_one_format(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "a.jsonl", documents(60, seed=1))
    write_jsonl(data / "b.jsonl", documents(60, seed=2))
    _, tokenizer = train_test_tokenizer(tmp_path / "tok")
    result = _cli("inspect", str(data), "--tokenizer", str(tokenizer), "--seq-len", "32",
                  "--batch-size", "4", "--batches", "1", "--runner", "inline")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "(jsonl; 120 documents)" in result.stdout
    # The tensors' dtypes as to_training makes them: cu_seqlens is int32.
    assert re.search(r"input_ids \[4, 32\], labels \[4, 32\], positions \[4, 32\] "
                     r"\(torch.int64\), cu_seqlens \[4, \d+\] \(torch.int32\)", result.stdout)


def test_inspect_of_a_folder_of_several_formats_or_none_says_what_to_pass(
        tmp_path: Path) -> None:
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_jsonl(mixed / "a.jsonl", documents(5, seed=1))
    (mixed / "b.txt").write_text("a text file\n")
    line = _one_line_error(_cli("inspect", str(mixed)))
    assert "holds files of several formats (1 jsonl, 1 text); pass --format jsonl or text" in line
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "holds no JSONL, Parquet or text file" in _one_line_error(_cli("inspect", str(empty)))
    line = _one_line_error(_cli("inspect", str(tmp_path / "data.bin")))
    assert "cannot tell the format of" in line and "pass --format jsonl, parquet or text" in line
