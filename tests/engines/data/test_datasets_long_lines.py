"""Prompt files are read in bounded memory: a line (a CSV record) over `max_line_bytes`
(data.max_line_bytes) is measured before it is decoded or parsed, dropped unread and counted, and
the good rows around it load with their own line numbers (engines/data/text_lines.py)."""

from __future__ import annotations

import gzip
import json
import tracemalloc

import pytest

from engines.data.datasets import load_prompts
from engines.data.text_lines import DEFAULT_MAX_LINE_BYTES


def _row(i: int) -> bytes:
    return json.dumps({"prompt": f"What is {i} + 1?", "domain": "math", "answer": str(i + 1)}).encode() + b"\n"


def test_a_300_mb_line_is_dropped_unread_and_memory_stays_near_the_limit(tmp_path):
    """Was: the file was read whole, decoded whole and split into lines before any line was measured;
    one 1 GB line appended to 300 good rows took the dataset task past 8 GiB (OOM-killed). Here, with
    the default limit, 300 MB in one line: Python's peak allocation while loading was 1,203 MiB before
    (4x the line) and is ~6 MiB now."""
    path = tmp_path / "p.jsonl"
    block = b"7" * (1 << 20)
    with open(path, "wb") as f:         # written in 1 MiB blocks: the test never holds the line
        for i in range(300):
            f.write(_row(i))
            if i == 149:
                f.write(b'{"prompt": "')
                for _ in range(300):
                    f.write(block)
                f.write(b'", "domain": "math", "answer": "1"}\n')
    try:
        tracemalloc.start()
        res = load_prompts(str(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        path.unlink()
    assert peak < DEFAULT_MAX_LINE_BYTES + (100 << 20), f"peak {peak >> 20} MiB while reading"
    assert len(res.table) == 300 and not res.errors
    assert res.table["prompt"].iloc[150] == "What is 150 + 1?"
    assert (res.long_lines.count, res.long_lines.line) == (1, 151) and res.long_lines.longest > 300 << 20
    assert f"1 line(s) longer than data.max_line_bytes={DEFAULT_MAX_LINE_BYTES} bytes dropped unread" in res.summary()
    assert "line 151" in res.summary() and res.rows_read == 301


def test_the_limit_is_inclusive_and_counts_bytes_not_characters(tmp_path):
    """A line of exactly max_line_bytes bytes is kept, one byte more is dropped; a non-ASCII character
    counts its UTF-8 bytes (é is two)."""
    def line(prompt: str) -> bytes:
        return json.dumps({"prompt": prompt, "domain": "math", "answer": "1"}, ensure_ascii=False).encode()

    limit = len(line("x" * 100))
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join([line("x" * 100), line("x" * 101), line("é" * 50), line("é" * 51)]) + b"\n")
    res = load_prompts(str(path), max_line_bytes=limit)
    assert res.table["prompt"].tolist() == ["x" * 100, "é" * 50]
    assert (res.long_lines.count, res.long_lines.longest, res.long_lines.line) == (2, limit + 2, 4)


def test_a_gzip_file_and_crlf_lines_are_bounded_too(tmp_path):
    path = tmp_path / "p.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(_row(0).replace(b"\n", b"\r\n"))
        f.write(b'{"prompt": "' + b"y" * (3 << 20) + b'", "domain": "math", "answer": "1"}\r\n')
        f.write(_row(2).replace(b"\n", b"\r\n"))
    res = load_prompts(str(path), max_line_bytes=1 << 20)
    assert res.table["prompt"].tolist() == ["What is 0 + 1?", "What is 2 + 1?"] and not res.errors
    assert (res.long_lines.count, res.long_lines.line) == (1, 2)


def test_a_csv_record_is_bounded_as_a_whole_and_later_line_numbers_hold(tmp_path):
    """A quoted cell may span lines: the record ends at a newline outside quotes, and the limit bounds
    the whole record (here 2,000 short lines inside one cell), not one physical line. The rows after
    it keep their line numbers; a long unquoted line is dropped the same way."""
    path = tmp_path / "p.csv"
    long_cell = '"' + "a, \"\"quoted\"\" b\n" * 2000 + '"'
    path.write_text("prompt,domain,answer\n"
                    '"first, with a comma",math,1\n'
                    f"{long_cell},math,2\n"
                    '"two\nlines",math,3\n'
                    + "z" * 5000 + ",math,4\n"
                    ",math,5\n"
                    '"last ""one""",math,6\n')
    res = load_prompts(str(path), max_line_bytes=4096)
    assert res.table["prompt"].tolist() == ["first, with a comma", "two\nlines", 'last "one"']
    assert res.table["answer"].tolist() == ["1", "3", "6"]
    assert (res.long_lines.count, res.long_lines.line) == (2, 3)     # the cell's record starts on line 3
    # lines: 1 header, 2 first, 3-2003 the long record (2,000 newlines in its cell), 2004-2005 "two lines", 2006 z..., 2007
    assert [(e.line, e.reason) for e in res.errors] == [(2007, "prompt: Field required")]
    # under the limit a cell may be longer than the csv module's own 131,072 characters (which crashed the load)
    path.write_text('prompt,domain,answer\n"' + "w" * 300_000 + '",math,1\n')
    assert len(load_prompts(str(path)).table["prompt"].iloc[0]) == 300_000


def test_a_file_whose_only_rows_are_too_long_names_the_setting(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "' + b"q" * 5000 + b'", "domain": "math", "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"no valid row.*1 line\(s\) longer than data\.max_line_bytes=1024 bytes"):
        load_prompts(str(path), max_line_bytes=1024)
    with pytest.raises(ValueError, match=r"data\.max_line_bytes=0; expected a positive number"):
        load_prompts(str(path), max_line_bytes=0)
