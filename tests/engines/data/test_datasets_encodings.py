"""A prompt file that is not UTF-8 is refused with the encoding it looks like and the iconv command that
converts it (engines/data/text_lines.py): UTF-16 and UTF-32, with or without a byte-order mark, before
any line is read; latin-1 and Windows-1252 at the first byte that is not UTF-8. Each hint, run, gives
a file that loads."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from engines.data.datasets import load_prompts

ROWS = [{"prompt": f"Combien font {i} + {i} ? café", "domain": "math", "answer": str(2 * i)} for i in range(6)]
TEXT = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ROWS)

# (file name, bytes, what the error says the file is, the iconv source encoding)
CASES = [
    ("bom16.jsonl", TEXT.encode("utf-16"), "UTF-16 (little-endian, byte-order mark FF FE)", "UTF-16"),
    ("be16.jsonl", "\ufeff".encode("utf-16-be") + TEXT.encode("utf-16-be"), "UTF-16 (big-endian, byte-order mark FE FF)", "UTF-16"),
    ("le16.jsonl", TEXT.encode("utf-16-le"), "UTF-16 (little-endian, no byte-order mark", "UTF-16LE"),
    ("nobom-be16.jsonl", TEXT.encode("utf-16-be"), "UTF-16 (big-endian, no byte-order mark", "UTF-16BE"),
    ("bom32.jsonl", TEXT.encode("utf-32"), "UTF-32 (little-endian, byte-order mark FF FE 00 00)", "UTF-32"),
    ("le32.jsonl", TEXT.encode("utf-32-le"), "UTF-32 (little-endian, no byte-order mark", "UTF-32LE"),
    ("be32.jsonl", TEXT.encode("utf-32-be"), "UTF-32 (big-endian, no byte-order mark", "UTF-32BE"),
]


@pytest.mark.parametrize("name,data,what,source", CASES, ids=[c[0] for c in CASES])
def test_utf16_and_utf32_files_are_named_and_get_the_iconv_that_converts_them(tmp_path, name, data, what, source):
    """Was: a UTF-16 file got the hint `iconv -f latin1 -t utf-8`, which turns it into mojibake (and a
    UTF-16 file without a byte-order mark decoded as UTF-8 with a NUL after each letter, so every row was
    'not valid JSON')."""
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(ValueError) as e:
        load_prompts(str(path))
    msg = str(e.value)
    assert f"prompt file {str(path)!r} is {what}" in msg and "not UTF-8" in msg
    assert f"iconv -f {source} -t UTF-8 {path} > {tmp_path / name.replace('.jsonl', '.utf8.jsonl')}" in msg
    assert "latin1" not in msg.lower()
    _converted_file_loads(msg, TEXT)


@pytest.mark.parametrize("encoding,looks,source", [
    ("latin-1", "latin-1 (ISO-8859-1) or Windows-1252", "LATIN1"),
    ("cp1252", "Windows-1252 (cp1252: bytes 0x80-0x9F", "CP1252"),
])
def test_single_byte_encodings_get_the_latin1_or_cp1252_hint_at_the_first_bad_byte(tmp_path, encoding, looks, source):
    text = TEXT if encoding == "latin-1" else TEXT.replace("café", "“café” – 5 €")
    path = tmp_path / "p.jsonl"
    path.write_bytes(text.encode(encoding))
    with pytest.raises(ValueError) as e:
        load_prompts(str(path))
    msg = str(e.value)
    first = text.encode(encoding).index(next(b for b in text.encode(encoding) if b >= 0x80).to_bytes(1, "big"))
    assert "line 1 is not UTF-8" in msg and f"byte offset {first}" in msg
    assert f"look like {looks}" in msg and f"iconv -f {source} -t UTF-8 {path} > {tmp_path / 'p.utf8.jsonl'}" in msg
    _converted_file_loads(msg, text)


def test_a_gzip_file_gets_a_hint_that_decompresses_first(tmp_path):
    import gzip

    path = tmp_path / "p.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(TEXT.encode("latin-1"))
    with pytest.raises(ValueError, match=r"of the decompressed text.*gzip -dc \S+p\.jsonl\.gz \| iconv -f LATIN1 -t UTF-8 > \S+p\.utf8\.jsonl"):
        load_prompts(str(path))


def _converted_file_loads(msg: str, text: str) -> None:
    """Run the hint's iconv command (where iconv is installed): what it wrote loads, prompts intact."""
    if shutil.which("iconv") is None:
        return
    cmd = re.search(r"e\.g\. (iconv .*? > \S+)", msg).group(1)
    subprocess.run(cmd, shell=True, check=True)
    res = load_prompts(cmd.rsplit("> ", 1)[1])
    assert res.table["prompt"].tolist() == [json.loads(line)["prompt"] for line in text.splitlines()] and not res.errors
