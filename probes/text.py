"""Turning raw artifact bytes into lines, safely: binary, truncated and huge input included."""

from __future__ import annotations

import re

from hangdx.probes.rx import lazy

# A rank's log may be gigabytes; only the tail matters to a hang.
MAX_TEXT_BYTES = 32 * 1024 * 1024

# `[rank3]:` (c10d) or `[default3]:` (torchrun --tee: role and local rank); {1,9}: int() of 5000 digits raises
_RANK_PREFIX = lazy(r"^\[(?:(?:default)?rank|default)(\d{1,9})\]:\s?")


# C0 controls but newline and tab, DEL, C1 (0x9b is a CSI of its own), the marks that reorder a line, and lone
# surrogates (a file name's undecodable bytes, which a terminal would get back raw).
_CONTROL = lazy(
    r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)
_CONTROL_OR_LINE = lazy(_CONTROL.pattern[:-1] + "\n\t]")


def _escape(m: re.Match) -> str:
    c = ord(m.group(0))
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable(text: object, multiline: bool = True) -> str:
    """Text the CLI did not write itself (a node's, a log's, a file name, another user's job id or note), fit
    for a terminal: escape sequences and other control characters shown escaped (`\\x1b[2J`), never sent raw
    to root's terminal. `multiline=False` escapes newlines and tabs too, for text that must stay one line."""
    return (_CONTROL if multiline else _CONTROL_OR_LINE).sub(_escape, str(text))


_NUL_RUN = lazy(rb"\x00+")
MAX_NUL_RUNS = (
    8  # a crash-cut log has a zero-filled block or a stray NUL or two; a binary file has them everywhere
)


def looks_binary(head: bytes) -> bool:
    """True when bytes are not text: NULs scattered all through them (an executable, an archive, UTF-16, a
    table of structs) or mostly non-printable. A few runs of NULs (a log cut by a crash keeps a zero-filled
    block where its last writes were lost) leave text text; the reader drops the NULs."""
    if not head:
        return False
    sample = head[:8192]
    if b"\x00" in sample:
        if len(_NUL_RUN.findall(sample)) > MAX_NUL_RUNS:
            return True
        sample = sample.replace(b"\x00", b"")
        if not sample:
            return True  # nothing but NULs (/dev/zero, a file that is one hole): no text seen
    bad = sum(1 for b in sample if b < 9 or 13 < b < 32)
    return bad > len(sample) * 0.1


def decode(data: bytes) -> str:
    """Decode as UTF-8, replacing what is not, keeping only the last MAX_TEXT_BYTES."""
    if len(data) > MAX_TEXT_BYTES:
        data = data[-MAX_TEXT_BYTES:]
        nl = data.find(b"\n")
        data = data[nl + 1 :] if nl >= 0 else data
    return data.decode("utf-8", errors="replace").replace("\x00", "")  # a crash-cut log's zero-filled block


def lines(data: bytes) -> list[str]:
    """The lines of an artifact, without line endings, numbered as an editor numbers them (`\\n` ends a line)."""
    out = decode(data).split("\n")
    if out and out[-1] == "":
        out.pop()
    return [ln[:-1] if ln.endswith("\r") else ln for ln in out]


def parse_by_lines(data: bytes, src, ev, parse_lines) -> None:
    """A line parser's `parse`: the artifact's numbered lines to its `parse_lines`; binary input reads as nothing."""
    if looks_binary(data[:8192]):
        return
    parse_lines(list(enumerate(lines(data), 1)), src, ev)


def strip_rank_prefix(line: str) -> tuple[int | None, str]:
    """Split torchrun's `[rank3]: ` / `[default3]:` prefix from a line."""
    m = _RANK_PREFIX.match(line)
    if not m:
        return None, line
    return int(m.group(1)), line[m.end() :]
