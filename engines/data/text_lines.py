"""A text prompt file (JSONL or CSV, `.gz` too) read as a stream of lines, or of CSV records, each at
most `max_bytes` long (engines/data/datasets.py `load_prompts` parses them).

The file is read in chunks of 1 MiB and split on b"\\n" before anything is decoded or parsed. A line
longer than the limit stops being kept the moment it passes it and is skipped to its newline, counted
in `LongLines` (its size, its line): one 1 GB line costs about `max_bytes` of memory, not the file's
size three times over (bytes, text, lines). A CSV record ends at a newline outside a quoted cell
(`_csv_end`, the `csv` module's default dialect), so a quoted cell may span lines; the limit then
bounds the whole record.

Each line is decoded as UTF-8 on its own. A leading UTF-8 byte-order mark is removed and noted. A
byte that is not UTF-8 raises ValueError naming the file, the line, the byte offset, the encoding the
bytes look like and the iconv command that converts them; a file that opens with a UTF-16 or UTF-32
byte-order mark, or whose first bytes have the NUL pattern of UTF-16/32 text, is refused before any
line is read (its ASCII would decode as UTF-8 with a NUL between letters, and every row would be
"not valid JSON").
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

DEFAULT_MAX_LINE_BYTES = 8 << 20     # data.max_line_bytes' default: far above any prompt a policy can hold
CHUNK = 1 << 20
_BOM = b"\xef\xbb\xbf"


@dataclass
class LongLines:
    """The lines (CSV: records) of one file longer than `limit` bytes, skipped unread."""

    limit: int
    count: int = 0
    longest: int = 0           # bytes of the longest (without its newline)
    line: int = 0              # the line it starts on (1-based)

    def add(self, line: int, size: int) -> None:
        self.count += 1
        if size > self.longest:
            self.longest, self.line = size, line

    def summary(self) -> str:
        if not self.count:
            return ""
        return (f"{self.count} line(s) longer than data.max_line_bytes={self.limit} bytes dropped unread "
                f"(longest: {self.longest} bytes, line {self.line})")


def read_lines(f: BinaryIO, uri: str, max_bytes: int, long: LongLines, notes: list[str], *,
               csv_records: bool = False) -> Iterator[tuple[int, str]]:
    """(first line, text) of each line of the binary stream `f` (each CSV record with `csv_records`),
    without its newline; a line over `max_bytes` is left out and counted in `long`; a removed
    byte-order mark is appended to `notes`. Raises ValueError for a file that is not UTF-8."""
    head = f.read(CHUNK)
    while 0 < len(head) < 4 and (more := f.read(CHUNK)):
        head += more
    wide = _wide_encoding(head[:4096])
    if wide:
        name, source = wide
        raise ValueError(f"prompt file {uri!r} is {name}, not UTF-8; expected UTF-8 text: convert it, e.g. "
                         f"{_iconv(uri, source)}")
    skipped = 0
    if head.startswith(_BOM):
        head, skipped = head[len(_BOM):], len(_BOM)
        notes.append("a UTF-8 byte-order mark opens the file (removed)")
    chunks = itertools.chain([head], iter(lambda: f.read(CHUNK), b""))
    for line, offset, raw in _split(chunks, max_bytes, long, csv_records):
        try:
            yield line, raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(_not_utf8(uri, raw, e, line, offset + skipped)) from None


# --- splitting: bytes in, bounded lines out --------------------------------------------------

_START, _PLAIN, _QUOTED, _CLOSE = range(4)    # CSV: at a cell's start, in an unquoted cell, in a quoted one, after a quote in it
_PLAIN_STOP = re.compile(rb'\n|,"')          # in unquoted text only a newline (record end) or a quoted cell's start matter


def _line_end(data: bytes, i: int, state: int) -> tuple[int, int]:
    return data.find(b"\n", i), state


def _csv_end(data: bytes, i: int, state: int) -> tuple[int, int]:
    """(index in `data` of the newline that ends the CSV record, or -1; the quoting state there). A
    quote opens a quoted cell only at a cell's start; inside one, "" is a quote and a newline is text."""
    n = len(data)
    while i < n:
        if state == _QUOTED:
            j = data.find(b'"', i)
            if j < 0:
                return -1, _QUOTED
            i, state = j + 1, _CLOSE
        elif state == _CLOSE:                 # "" is an escaped quote; anything else ends the quoted part
            if data[i] == 0x22:
                i, state = i + 1, _QUOTED
            else:
                state = _PLAIN
        elif state == _START and data[i] == 0x22:
            i, state = i + 1, _QUOTED
        else:
            m = _PLAIN_STOP.search(data, i)
            if m is None:
                return -1, (_START if data.endswith(b",") else _PLAIN)
            if m.group() == b"\n":
                return m.start(), _START
            i, state = m.end(), _QUOTED
    return -1, state


def _split(chunks: Iterable[bytes], max_bytes: int, long: LongLines, csv_records: bool) -> Iterator[tuple[int, int, bytes]]:
    """(first line, byte offset, bytes) of each line of the concatenated `chunks`, a trailing "\\r"
    removed; a line over `max_bytes` is not kept past the limit: it is read to its end and counted."""
    find = _csv_end if csv_records else _line_end
    buf = bytearray()
    skipping, size = False, 0          # the current line is over the limit; its bytes so far
    line, inner = 1, 0                 # where the current line starts; newlines inside it (CSV)
    start = base = 0                   # its byte offset; the current chunk's
    state = _START
    for chunk in chunks:
        i, view = 0, memoryview(chunk)
        while True:
            end, state = find(chunk, i, state)
            stop = len(chunk) if end < 0 else end
            size += stop - i
            if csv_records:
                inner += chunk.count(b"\n", i, stop)
            if not skipping and size > max_bytes:
                skipping, buf = True, bytearray()
            elif not skipping:
                buf += view[i:stop]
            if end < 0:
                break
            if skipping:
                long.add(line, size)
            else:
                yield line, start, bytes(memoryview(buf)[:-1] if buf.endswith(b"\r") else buf)
            line, inner, start = line + inner + 1, 0, base + end + 1
            buf, skipping, size, state, i = bytearray(), False, 0, _START, end + 1
        base += len(chunk)
    if skipping:
        long.add(line, size)
    elif buf:
        yield line, start, bytes(memoryview(buf)[:-1] if buf.endswith(b"\r") else buf)


# --- encodings: what a file that is not UTF-8 looks like -------------------------------------

_WIDE_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32 (little-endian, byte-order mark FF FE 00 00)", "UTF-32"),
              (b"\x00\x00\xfe\xff", "UTF-32 (big-endian, byte-order mark 00 00 FE FF)", "UTF-32"),
              (b"\xff\xfe", "UTF-16 (little-endian, byte-order mark FF FE)", "UTF-16"),
              (b"\xfe\xff", "UTF-16 (big-endian, byte-order mark FE FF)", "UTF-16"))


def _wide_encoding(head: bytes) -> tuple[str, str] | None:
    """(what the file is, iconv's name for it) when `head` opens with a UTF-16/32 byte-order mark,
    or has the NUL bytes of mostly-ASCII UTF-16/32 text without one (UTF-8 text has no NUL); else None."""
    for bom, name, source in _WIDE_BOMS:
        if head.startswith(bom):
            return name, source
    n = len(head) // 4 * 4
    if n < 4 or head.count(0, 0, n) < n // 4:
        return None
    zero = [sum(b == 0 for b in head[k:n:4]) / (n // 4) for k in range(4)]   # share of NULs at each position mod 4
    if zero[1] > 0.9 and zero[2] > 0.9 and zero[3] > 0.9 and zero[0] < 0.5:
        return "UTF-32 (little-endian, no byte-order mark: NUL bytes at 3 of every 4 positions)", "UTF-32LE"
    if zero[0] > 0.9 and zero[1] > 0.9 and zero[2] > 0.9 and zero[3] < 0.5:
        return "UTF-32 (big-endian, no byte-order mark: NUL bytes at 3 of every 4 positions)", "UTF-32BE"
    odd, even = (zero[1] + zero[3]) / 2, (zero[0] + zero[2]) / 2
    if odd > 0.6 and even < 0.2:
        return "UTF-16 (little-endian, no byte-order mark: a NUL byte after most letters)", "UTF-16LE"
    if even > 0.6 and odd < 0.2:
        return "UTF-16 (big-endian, no byte-order mark: a NUL byte before most letters)", "UTF-16BE"
    return None


def _not_utf8(uri: str, raw: bytes, e: UnicodeDecodeError, line: int, offset: int) -> str:
    """The error for a line (CSV: record) starting at byte `offset` that is not UTF-8 at `e.start`:
    the line and column of the byte, its offset in the file, and what the bytes that are not UTF-8 look like."""
    line += raw.count(b"\n", 0, e.start)
    column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
    gz = " of the decompressed text" if uri.lower().endswith(".gz") else ""
    bad = {ord(c) - 0xDC00 for c in raw.decode("utf-8", "surrogateescape") if "\udc80" <= c <= "\udcff"}
    if any(0x80 <= b <= 0x9F for b in bad):   # printable in cp1252, C1 control codes in latin-1
        looks, source = "Windows-1252 (cp1252: bytes 0x80-0x9F are its curly quotes, dashes and euro sign)", "CP1252"
    else:
        looks, source = "latin-1 (ISO-8859-1) or Windows-1252 (cp1252)", "LATIN1"
    return (f"prompt file {uri!r}: line {line} is not UTF-8: byte {raw[e.start:e.start + 1]!r} at byte offset "
            f"{offset + e.start}{gz} (column {column}) ({e.reason}); its bytes look like {looks}; expected UTF-8 "
            f"text: re-encode the file, e.g. {_iconv(uri, source)} (if it is another encoding, `file -bi` names it)")


def _iconv(uri: str, source: str) -> str:
    """The shell command that converts the file at `uri` from `source` to UTF-8, into a file beside it."""
    path = uri.removeprefix("file://")
    remote = "://" in path
    folder, _, name = path.rpartition("/")
    gz = name.lower().endswith(".gz")
    stem, dot, ext = name[:-3 if gz else None].rpartition(".")
    out = f"{stem}.utf8.{ext}" if dot and stem else f"{name}.utf8"
    src, out = (name, out) if remote else (path, f"{folder}/{out}" if folder else out)
    quote = lambda p: p if re.fullmatch(r"[\w./@+-]+", p) else "'" + p.replace("'", "'\\''") + "'"  # noqa: E731
    cmd = (f"gzip -dc {quote(src)} | iconv -f {source} -t UTF-8 > {quote(out)}" if gz
           else f"iconv -f {source} -t UTF-8 {quote(src)} > {quote(out)}")
    return cmd + (" (on a downloaded copy)" if remote else "")
