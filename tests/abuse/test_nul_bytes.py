"""Issue row 19: one NUL byte in the first 8 KiB made a whole log "binary" and it was skipped.

A log cut by a crash (a node that lost power, a killed writer on NFS or ext4 with delayed allocation) keeps
its text with a run of NUL bytes where the last blocks were never written; a log tailed while it was being
rewritten has a stray NUL or two. Such text is read as text; real binary files are still skipped."""

from __future__ import annotations

import gzip
import io
import subprocess
import sys
from pathlib import Path

import pytest

from hangdx.probes.text import looks_binary

ROOT = Path(__file__).resolve().parents[2]
OOM_LOG = (ROOT / "tests/fixtures/torch_log/cuda_oom_rank1.log").read_bytes()


def _cut(data: bytes, where: int, nul: bytes) -> bytes:
    return data[:where] + nul + data[where:]


CRASH_TRUNCATED = {
    "one NUL": _cut(OOM_LOG, 40, b"\x00"),
    "a few NULs": _cut(_cut(_cut(OOM_LOG, 30, b"\x00"), 300, b"\x00\x00"), 700, b"\x00"),
    "a zero-filled 4 KiB block": _cut(OOM_LOG, 200, b"\x00" * 4096),
    "a zero-filled block first": b"\x00" * 4096 + OOM_LOG,
    "NULs at the end of a line": OOM_LOG.replace(b"\n", b"\x00\x00\x00\n", 3),
}


def _analyze(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hangdx", "analyze", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("name", list(CRASH_TRUNCATED))
def test_a_log_with_a_few_nul_bytes_is_read_as_text(tmp_path, name, hostile_inputs):
    log = tmp_path / "rank1.log"
    log.write_bytes(CRASH_TRUNCATED[name])
    r = _analyze(log)
    assert r.returncode == 0, r.stderr
    assert '"category": "rank_crashed"' in r.stdout and "OutOfMemoryError" in r.stdout
    assert "\\u0000" not in r.stdout  # the NULs are not quoted as evidence


def _elf() -> bytes:
    return Path(sys.executable).resolve().read_bytes()[:16384]


BINARY = {
    "an ELF executable": _elf,
    "a gzip of the log": lambda: gzip.compress(OOM_LOG * 20),
    "UTF-16 text": lambda: OOM_LOG.decode().encode("utf-16-le"),
    "a struct table": lambda: b"".join(i.to_bytes(4, "little") + b"\x07\x00ab" for i in range(2000)),
}


@pytest.mark.parametrize("name", list(BINARY))
def test_binary_content_is_still_binary(name):
    assert looks_binary(BINARY[name]()[:8192])


def test_a_binary_file_is_still_skipped_in_one_line(tmp_path):
    blob = tmp_path / "core.bin"
    blob.write_bytes(_elf())
    r = _analyze(blob)
    assert r.returncode == 2 and "binary" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_a_pasted_log_with_a_nul_is_not_refused_as_binary():
    """The Slack path (bot/pasted.py) asks the same question of an uploaded file."""
    from hangdx.bot.pasted import _binary

    assert not _binary(io.BytesIO(CRASH_TRUNCATED["a zero-filled 4 KiB block"]).read(8192))
