"""Fingerprints of input data and model folders: what a file, folder or object-store prefix holds, so
that a key built from it changes when the content does (new rows, a re-saved model), not only when
its path or the settings that name it do.

The rule (docs/data.md, "Dataset identity"):
- local files totalling at most FULL_HASH_BYTES (64 MiB): sha256 of every file's bytes ("content");
- bigger local inputs: per file its size, its mtime (ns) and the sha256 of SAMPLE_BYTES at its start,
  middle and end ("sampled"; reading a 30 GB model folder whole on every run would cost minutes);
- object stores (s3://, gs://, ...): per object what the store already knows of its content, its
  ETag / checksum from fsspec's info() (else fsspec's `checksum`), and its size ("etag"): no bytes
  are downloaded.
A folder is walked recursively; paths are relative to it and sorted, so the order of a listing does
not matter. The result is a small dict: `digest` (hex) goes into keys, the rest is recorded for people.
"""

from __future__ import annotations

import hashlib
import os

FULL_HASH_BYTES = 64 * 1024 * 1024
SAMPLE_BYTES = 1024 * 1024
_LOCAL = ("file", "local")


def _local_files(path: str) -> list[tuple[str, str]]:
    """(relative name, absolute path) of the file `path` or of every file under the folder `path`."""
    if os.path.isfile(path):
        return [(os.path.basename(path), path)]
    out = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            out.append((os.path.relpath(full, path), full))
    return out


def _sampled_sha(path: str, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for start in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
            f.seek(start)
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def _file_sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _local(path: str) -> dict:
    if not os.path.exists(path):
        raise FileNotFoundError(f"cannot fingerprint {path!r}: no such file or folder")
    files = _local_files(path)
    sizes = {rel: os.path.getsize(full) for rel, full in files}
    total = sum(sizes.values())
    method = "content" if total <= FULL_HASH_BYTES else "sampled"
    parts = []
    for rel, full in files:
        if method == "content":
            parts.append(f"{rel}\0{_file_sha(full)}")
        else:
            parts.append(f"{rel}\0{sizes[rel]}\0{os.stat(full).st_mtime_ns}\0{_sampled_sha(full, sizes[rel])}")
    return {"method": method, "files": len(files), "bytes": total, "digest": _digest(method, parts)}


def _remote(fs, path: str) -> dict:
    if not fs.exists(path):
        raise FileNotFoundError(f"cannot fingerprint {path!r}: no such object or prefix")
    infos = fs.find(path, detail=True) if fs.isdir(path) else {path: fs.info(path)}
    parts, total = [], 0
    for name in sorted(infos):
        info = infos[name]
        tag = info.get("ETag") or info.get("etag") or info.get("md5Hash") or info.get("checksum") or fs.checksum(name)
        size = int(info.get("size") or 0)
        total += size
        parts.append(f"{name[len(path):].lstrip('/') or os.path.basename(name)}\0{size}\0{str(tag).strip(chr(34))}")
    return {"method": "etag", "files": len(infos), "bytes": total, "digest": _digest("etag", parts)}


def _digest(method: str, parts: list[str]) -> str:
    return hashlib.sha256("\n".join([method, *parts]).encode()).hexdigest()[:16]


def fingerprint(uri: str, *, storage_options: dict | None = None) -> dict:
    """{method, files, bytes, digest} of the file or folder `uri` (local path or fsspec URL); see the
    module docstring for the rule. Raises FileNotFoundError naming `uri` when nothing is there."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if set(protocols) & set(_LOCAL):
        return {"uri": uri, **_local(path)}
    return {"uri": uri, **_remote(fs, path)}
