"""The one reader of text evidence: any size, any mix of kinds, streamed once front to back.

A text arrives as a file, standard input, a Slack message or an upload, of a few lines or of gigabytes. It is
read in chunks, never whole (`Keeper`): its head (versions, communicator set-up), every line that can name a
fault (warnings, errors, tracebacks, watchdog and Xid lines, with the lines after them) and its tail are kept;
of the lines that repeat by the million (NCCL's per-collective `opCount` lines) only the last few of each
process, found with byte searches so that Python never touches the others. The kept lines are then cleaned
(`normalise.Normaliser`: prefixes, colours, bars, fences), split by the rank or host a prefix named, cut into
regions by the kind of line they hold, and each region goes to the parser of its kind (`ReadReport` says what
was read as what, and what was skipped).
"""

from __future__ import annotations

import collections
import io
import mmap
import os
import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import BinaryIO

from hangdx.probes import catalogue as catalogue_mod
from hangdx.probes import pycode, registry, signals
from hangdx.probes.model import Evidence, Source
from hangdx.probes.normalise import Line, Normaliser, continues, joins_next, rejoin_hard_wraps, same_origin
from hangdx.probes.rx import lazy

CHUNK_BYTES = 8 << 20
NUMPY_AFTER = 64 << 20  # a text counts its pieces with numpy once it is known to be at least this big
READ_AHEAD = 2  # pieces read ahead of the one being scanned (chunks_of)
HEAD_LINES = 4000  # the start of a log: versions, communicator set-up, the rank map
TAIL_LINES = 20000  # its end: where the hang is
CONTEXT_LINES = 40  # kept after a line that names a fault: a traceback's frames, a desync report
MIDDLE_MAX = 100_000  # fault lines kept from the middle; past that they are counted, not kept
COLL_PER_PROCESS = 6  # collective lines kept per process and communicator
# A text this big whose head is full keeps of the head's collective lines only each process's first ones (its
# set-up lines all stay): the rest are the middle of a long run of collectives, which no verdict reads (a
# process's last collectives are kept apart, wherever they are), and reading 4,000 of them cost more than a
# tenth of a second of every big log's read.
BIG_HEAD_TRIM = 64 << 20
MAX_LINE_BYTES = 64 * 1024  # a longer line is cut (a binary blob, a minified JSON)

# Lines that can name a fault anywhere in a log (matched on bytes, case-insensitive words).
_FAULT = lazy(
    rb"(?i:error|warn|exception|traceback|timeout|timed out|watchdog|xid|fail|fatal|abort|killed|signal"
    rb"|segmentation|core dumped|out of memory|oom|hung|blocked for|not responding|mismatch|desync|lagging"
    rb"|exitcode|exit code|init complete|nccl version|using network|ncclcomminit|rendezvous|refused"
    rb"|reset by peer|broken pipe|unreachable|link (?:is )?down|nvrm|ecc|retired|remapp|terminat)"
)
_FAULT_WORDS = _FAULT.pattern[len(b"(?i:") : -1]  # the same words for Hyperscan (caseless there)
_COLL = b" opCount "
# NCCL's `host:pid:tid [dev]`: found from its `:pid:tid [` (tried only at colons), then the host before it.
_NCCL_PID = lazy(rb"(?<=[\w.\-]):(\d{1,10}):\d{1,10} \[-?\d{1,6}\]")
_NCCL_HOST = lazy(rb"[A-Za-z0-9][\w.\-]{0,253}$")
# A log pasted without `host:pid:tid`, only NCCL's `[dev] `: the device is all that tells its processes apart.
_NCCL_DEV = lazy(rb"^\[-?\d{1,6}\] (?=(?:\S+:\d+ )?NCCL )")
_COMM = lazy(rb" comm (0x[0-9a-fA-F]{1,16}|\(nil\))")


@dataclass
class Region:
    """A run of lines of one kind from one source, and what read it."""

    source: str
    kind: str | None  # None: no parser claimed these lines
    first: int
    last: int
    lines: int


@dataclass
class ReadReport:
    """What the reader did with one input: the regions it read, the lines it skipped or left out."""

    name: str
    total_lines: int = 0
    total_bytes: int = 0
    regions: list[Region] = field(default_factory=list)
    collectives_seen: int = 0  # NCCL collective lines in the whole input (most of them not kept)
    dropped_lines: int = 0  # lines of the middle of a huge input left out (neither head, tail nor fault)
    signals: int = 0  # lines a row of the signal catalogue matched
    code_lines: int = 0  # lines of pasted Python code parsed (probes/pycode.py)

    @property
    def kinds(self) -> list[str]:
        return sorted({r.kind for r in self.regions if r.kind})

    @property
    def skipped(self) -> list[Region]:
        return [r for r in self.regions if r.kind is None]

    def describe(self) -> str:
        """One line: which lines were read as what, and how many no parser reads."""
        spans: dict[str, list[str]] = {}
        for r in self.regions:
            if r.kind:
                spans.setdefault(r.kind, []).append(
                    f"{r.first}-{r.last}" if r.last > r.first else str(r.first)
                )
        if not spans and not self.signals and not self.code_lines:
            return ""
        parts = [f"{_SHOWN.get(kind, kind)} (lines {_short(s)})" for kind, s in spans.items()]
        skipped = sum(r.lines for r in self.skipped)
        text = f"{self.name}: read as " + ", ".join(parts) if parts else f"{self.name}: no known layout"
        if self.signals:
            n = self.signals
            text += f"; {n} line{'s' if n != 1 else ''} matched the signal catalogue"
        if self.code_lines:
            n = self.code_lines
            text += (
                f"; {n} line{'s' if n != 1 else ''} of Python code read for collectives only some ranks call"
            )
        if skipped:
            text += f"; skipped {skipped} line{'s' if skipped != 1 else ''} no parser reads"
        if self.collectives_seen > 1000:
            text += f"; {self.collectives_seen:,} NCCL collective lines seen, the last of each process kept"
        return text


class Mapped:
    """The rest of a regular file, mapped rather than read: its pieces are counted where they lie, with no copy
    (a read copies each byte once more than counting it costs). Fed to a Keeper in the very pieces a read would
    have given (CHUNK_BYTES each from `start`), so what is kept does not depend on how the file was read; each
    piece's pages are let go once it is read, so that the mapping never holds more than a few pieces in memory.
    (Pages of a file truncated while it is mapped are gone: touching one ends the process with SIGBUS, where a
    read sees the file end early. The file's size is looked at before each piece, and a piece past its end is not
    read: a log rotated by truncation at the very millisecond its piece is read is the one case left.)"""

    def __init__(self, view: mmap.mmap, start: int, end: int, fd: int) -> None:
        self.view, self.start, self.end, self.fd = view, start, end, fd

    def feed(self, keeper: Keeper) -> None:
        page, dontneed = mmap.PAGESIZE, getattr(mmap, "MADV_DONTNEED", None)
        done = self.start - self.start % page  # pages before this one are let go
        try:
            for at in range(self.start, self.end, CHUNK_BYTES):
                stop = min(at + CHUNK_BYTES, self.end)
                try:
                    stop = min(stop, os.fstat(self.fd).st_size)
                except OSError:
                    break
                if stop <= at:
                    break  # cut short since it was mapped: read up to its new end, as a read would
                keeper._feed(self.view, at, stop)
                upto = stop - stop % page
                if upto > done and dontneed is not None:
                    self.view.madvise(dontneed, done, upto - done)
                    done = upto
        finally:
            try:
                self.view.close()
            except BufferError:  # pragma: no cover - a count still holds a view: the collector closes it
                pass


def _mapped(stream: BinaryIO, limit: int | None) -> Mapped | None:
    """The rest of stream (from where it is now, up to `limit` bytes) mapped, when it is a big regular file."""
    import stat

    try:
        fd = stream.fileno()
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        start = stream.tell()
    except (OSError, AttributeError, ValueError, io.UnsupportedOperation):
        return None
    end = st.st_size if limit is None else min(st.st_size, start + limit)
    if end - start < NUMPY_AFTER:
        return None  # read: a mapping pays off over many pieces counted by numpy only
    try:
        view = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None
    return Mapped(view, start, min(end, len(view)), fd)


class Keeper:
    """Reads a text in chunks and keeps, in bounded memory, the lines a verdict can need."""

    def __init__(self, cat: catalogue_mod.Catalogue | None = None, size: int | None = None) -> None:
        self.cat = cat  # its rows' lines are kept wherever they are, like fault lines
        # Bytes read before numpy counts the pieces: none when the input is known to be big (its size), else
        # NUMPY_AFTER (importing numpy costs what counting that much text without it does).
        self._numpy_after = 0 if size is not None and size >= NUMPY_AFTER else NUMPY_AFTER
        self._sig: set[int] = (
            set()
        )  # numbers of this piece's lines that a row may match (or hold a fault word)
        self._flagged_all = False  # _sig holds the fault lines too (Hyperscan scanned for both)
        self._db: object = False  # the rows-and-fault-words database (False: not made yet)
        self.sparse = True  # pieces with no collective line skip the lines that cannot be kept
        self.lineno = 0  # lines fully read so far
        self.bytes = 0
        self.head: list[tuple[int, bytes]] = []
        self.middle: list[tuple[int, bytes]] = []
        self.tail: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=TAIL_LINES)
        self.context = 0  # lines still to keep after a fault line
        self.dropped = 0
        self.collectives = 0
        self.procs: set[bytes] = set()  # NCCL `host:pid:` prefixes seen
        self.coll: dict[tuple[bytes, bytes], collections.deque[tuple[int, bytes]]] = {}
        self._rest = b""

    def feed(self, data: bytes | Mapped) -> None:
        if isinstance(data, Mapped):
            data.feed(self)
            return
        self._feed(data, 0, len(data))

    def _feed(self, buf: bytes | mmap.mmap, lo: int, hi: int) -> None:
        """The piece buf[lo:hi] (a chunk of a stream, or a window of a mapped file), in place."""
        if lo >= hi:
            return
        self.bytes += hi - lo
        if self._rest:  # the line the last piece left open ends in this one
            nl = buf.find(b"\n", lo, hi)
            if nl < 0:
                self._rest = (self._rest + buf[lo : lo + MAX_LINE_BYTES])[:MAX_LINE_BYTES]
                return
            line = self._rest[:MAX_LINE_BYTES] + buf[lo : lo + min(nl - lo, MAX_LINE_BYTES)] + b"\n"
            self._chunk(line, 0, None)
            self._rest, lo = b"", nl + 1
        cut = buf.rfind(b"\n", lo, hi)
        if cut < 0:
            self._rest = buf[lo : min(hi, lo + MAX_LINE_BYTES)]
            return
        # A line with no end in sight: keep its start.
        self._rest = buf[cut + 1 : min(hi, cut + 1 + MAX_LINE_BYTES)]
        self._chunk(buf, lo, cut + 1)

    def close(self) -> list[tuple[int, bytes]]:
        if self._rest:
            self._chunk(self._rest + b"\n", 0, None)
            self._rest = b""
        kept: dict[int, bytes] = {}
        for no, ln in self._head_kept():
            kept[no] = ln
        for no, ln in self.middle:
            kept[no] = ln
        for no, ln in self.tail:
            kept[no] = ln
        for dq in self.coll.values():
            for no, ln in dq:
                kept[no] = ln
        return sorted(kept.items())

    def _head_kept(self) -> list[tuple[int, bytes]]:
        """The head, less (in a big text) the collective lines past each process's first COLL_PER_PROCESS."""
        if self.bytes < BIG_HEAD_TRIM or len(self.head) < HEAD_LINES:
            return self.head
        out: list[tuple[int, bytes]] = []
        seen: dict[tuple[bytes, bytes], int] = {}
        for no, ln in self.head:
            if _COLL in ln and (key := _coll_key(ln)):
                if seen.get(key, 0) >= COLL_PER_PROCESS:
                    continue
                seen[key] = seen.get(key, 0) + 1
            out.append((no, ln))
        return out

    # -- per chunk ---------------------------------------------------------------------------------------

    def _chunk(self, buf: bytes | mmap.mmap, lo: int, hi: int | None) -> None:
        """The whole lines of buf[lo:hi] (it ends with a newline); searched in place, never copied whole unless
        its lines are to be read one by one (buf may be a mapped file: only a piece of collective lines is read
        from the mapping itself)."""
        hi = len(buf) if hi is None else hi
        base = self.lineno
        head_open = len(self.head) < HEAD_LINES
        big = self.bytes >= self._numpy_after
        n, marked, clean = _scan(buf, lo, hi, not head_open, big)  # newlines and markers, counted in one go
        if n < 256:
            buf, lo, hi = _own(buf, lo, hi)
            self._signal_lines(buf, lo, hi, base)
            self._lines(buf[lo:hi].split(b"\n")[:-1], base)
            self.lineno = base + n
            return
        if head_open:
            # Line by line only until the head is full; the rest of the piece takes the byte-level path below.
            cut = lo
            while len(self.head) < HEAD_LINES and cut < hi:
                end = buf.find(b"\n", cut, hi) + 1 or hi
                self._lines([buf[cut : end - 1]], self.lineno)
                self.lineno += 1
                cut = end
            if cut >= hi:
                return
            lo, n, base = cut, n - (self.lineno - base), self.lineno
            marked, clean = _scan(buf, lo, hi, True, big)[1:]  # the markers of the rest of the piece
        if marked is None:  # not counted by numpy (a small piece): the markers by a substring count
            coll = _count(buf, _COLL, lo, hi)
            clean = coll == n and buf.find(b"\r", lo, hi) < 0 and buf.find(b"\x1b", lo, hi) < 0
        else:
            coll = n if marked else -1
        if coll == n and clean:
            # Nothing but collective lines: only each process's last ones can matter.
            self.collectives += coll
            self._coll_tails(buf, lo, hi, base, n)
            self.lineno = base + n
            return
        buf, lo, hi = _own(buf, lo, hi)
        if coll < 0:
            coll = buf.count(_COLL, lo, hi)
        self._signal_lines(buf, lo, hi, base)
        parts = buf[lo:hi].split(b"\n")[:-1]
        if coll > n // 2:
            self.collectives += coll
            self._coll_tails(buf, lo, hi, base, n)
            for i, ln in [(i, ln) for i, ln in enumerate(parts) if _COLL not in ln]:
                self._keep(base + i + 1, ln)
        elif coll == 0 and self._flagged_all and self.sparse:
            self._sparse(parts, base)  # Python touches the fault lines, their context and the tail only
        else:
            self._lines(parts, base)
        self.lineno = base + n

    def _lines(self, parts: list[bytes], base: int) -> None:
        for i, ln in enumerate(parts):
            no = base + i + 1
            if _COLL in ln:
                self.collectives += 1
                self._coll_line(no, ln)
                if len(self.head) >= HEAD_LINES:
                    continue
            self._keep(no, ln)

    def _keep(self, no: int, ln: bytes) -> None:
        if len(ln) > MAX_LINE_BYTES:
            ln = ln[:MAX_LINE_BYTES]
        if len(self.head) < HEAD_LINES:
            self.head.append((no, ln))
            self._note_proc(ln)
            return
        if no in self._sig if self._flagged_all else _FAULT.search(ln) or no in self._sig:
            self.context = CONTEXT_LINES
            self._middle(no, ln)
            self._note_proc(ln)
        elif self.context > 0:
            self.context -= 1
            self._middle(no, ln)
        else:
            if len(self.tail) == self.tail.maxlen:
                self.dropped += 1
            self.tail.append((no, ln))

    def _signal_lines(self, buf: bytes, lo: int, hi: int, base: int) -> None:
        """Numbers of the lines of buf[lo:hi] that a catalogue row may match, and (with Hyperscan) that hold a
        fault word: one scan of the bytes, no line split, no regex run per line."""
        self._sig = set()
        self._flagged_all = False
        if self.cat is None or len(self.head) < HEAD_LINES:
            return  # the head is kept whole anyway
        db = self._words_db()
        no, at = base + 1, lo
        for start in self.cat.line_starts(buf, lo, hi, db=db):
            no += buf.count(b"\n", at, start)
            at = start
            self._sig.add(no)
        self._flagged_all = db is not None

    def _words_db(self) -> object | None:
        if self._db is False:
            try:
                self._db = self.cat.with_words(_FAULT_WORDS) if self.cat is not None else None
            except catalogue_mod.CatalogueError:
                self._db = None
        return self._db

    def _sparse(self, parts: list[bytes], base: int) -> None:
        """`_keep` for every line of a piece with no collective line, touching only the lines it keeps: those the
        byte scan flagged, the context after them, and the last TAIL_LINES of the rest (the earlier ones would
        be pushed out of the tail by the later ones anyway, and are counted as dropped)."""
        flagged = sorted(no - base - 1 for no in self._sig if base < no <= base + len(parts))
        runs: list[tuple[int, int]] = []  # index ranges of lines bound for the tail
        pos = 0
        for fi in [*flagged, len(parts)]:
            c = min(self.context, fi - pos)
            for j in range(pos, pos + c):
                self._middle(base + j + 1, parts[j][:MAX_LINE_BYTES])
            self.context -= c
            if pos + c < fi:
                runs.append((pos + c, fi))
            if fi < len(parts):
                ln = parts[fi][:MAX_LINE_BYTES]
                self.context = CONTEXT_LINES
                self._middle(base + fi + 1, ln)
                self._note_proc(ln)
            pos = fi + 1
        skip = max(0, sum(e - s for s, e in runs) - TAIL_LINES)
        self.dropped += skip
        for s, e in runs:
            if skip >= e - s:
                skip -= e - s
                continue
            s, skip = s + skip, 0
            for j in range(s, e):
                if len(self.tail) == self.tail.maxlen:
                    self.dropped += 1
                self.tail.append((base + j + 1, parts[j][:MAX_LINE_BYTES]))

    def _middle(self, no: int, ln: bytes) -> None:
        if len(self.middle) < MIDDLE_MAX:
            self.middle.append((no, ln))
        else:
            self.dropped += 1

    def _note_proc(self, ln: bytes) -> None:
        if b"NCCL" in ln:
            proc = _proc_key(ln)
            if proc:
                self.procs.add(proc[0])

    def _coll_line(self, no: int, ln: bytes) -> bytes | None:
        """Keep a collective line among its process's and communicator's last ones; its process key."""
        key = _coll_key(ln)
        if not key:
            return None
        proc = key[0]
        self.procs.add(proc)
        dq = self.coll.get(key)
        if dq is None:
            dq = self.coll[key] = collections.deque(maxlen=COLL_PER_PROCESS)
        if not dq or dq[-1][0] < no:
            dq.append((no, ln[:MAX_LINE_BYTES]))
        return proc

    def _coll_tails(self, buf: bytes | mmap.mmap, lo: int, hi: int, base: int, n: int) -> None:
        """The last collective lines of each process in buf[lo:hi], searching backwards from its end."""
        budget = COLL_PER_PROCESS * max(len(self.procs), 8) + 64
        end = hi - 1  # the final newline
        seen: set[bytes] = set()
        lines_back = 0
        start = end
        while budget > 0 and end > lo:  # back over the last `budget` lines: where the first of them starts
            start = max(lo, buf.rfind(b"\n", lo, end) + 1)
            lines_back += 1
            end = start - 1
            budget -= 1
        # Those lines, cut out at once and read in order.
        for i, ln in enumerate(buf[start : hi - 1].split(b"\n") if lines_back else ()):
            if _COLL in ln:
                proc = self._coll_line(base + n - lines_back + i + 1, ln)
                if proc:
                    seen.add(proc)
        # A process that stopped early in this piece is not among its last lines: find its last lines directly.
        for proc in list(self.procs - seen):
            end = hi
            for _ in range(COLL_PER_PROCESS):
                at = buf.rfind(proc, lo, end)
                if at < 0:
                    break
                start = max(lo, buf.rfind(b"\n", lo, at) + 1)
                stop = buf.find(b"\n", at, hi)
                ln = buf[start:stop]
                if _COLL in ln:
                    self._coll_line(base + n - _count(buf, b"\n", stop, hi) + 1, ln)
                end = start


_numpy: object = None  # numpy, imported at the first big piece (None: not tried yet; False: not installed)


def _load_numpy() -> bool:
    """Whether numpy is there (imported the first time a piece is big enough to pay for its import).

    numpy compares a byte about four times faster than bytes.count counts one; it is optional (the demo and test
    extras bring it)."""
    global _numpy
    if _numpy is None:
        try:
            import numpy as np
        except ImportError:  # pragma: no cover - numpy is there wherever torch is
            np = False
        _numpy = np
    return _numpy is not False


_OPC = int.from_bytes(_COLL[:4], "little")  # ` opC`, the marker's first four bytes, as a little-endian word
_SUB = 1 << 20  # a piece is counted in parts of this size: each read from memory once, then from the cache
_pool: object = None  # a thread for the byte counts of big pieces (None: not made yet; False: one CPU)


def _scan(
    buf: bytes | mmap.mmap, lo: int, hi: int, marks: bool = True, big: bool = True
) -> tuple[int, bool | None, bool | None]:
    """(newlines, marked, clean) of buf[lo:hi], which ends with a newline.

    marked: whether each part of the piece (cut at newlines) holds as many markers (` opC`) as lines, the test for
    a piece of nothing but collective lines (a count, so a line with two markers could hide one with none in the
    same part); clean: whether it holds no carriage return or escape either (then its lines need no cleaning).
    Both None when not counted (a piece under 1 MB, not `big`, no numpy, or `marks` False): the caller counts
    markers itself.

    The two halves of a big piece (cut at a newline, so no marker is cut) are counted by two threads: numpy's
    comparisons run without the GIL, so on two CPUs the byte scans every piece needs take half the time."""
    if hi - lo < 1 << 20 or not big or not _load_numpy():
        return _count(buf, b"\n", lo, hi), None, None
    global _pool
    if _pool is None:
        _pool = False
        if (os.cpu_count() or 1) >= 2:
            from concurrent.futures import ThreadPoolExecutor

            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hangdx-count")
    mid = buf.find(b"\n", (lo + hi) // 2, hi) + 1 or hi
    if _pool is False or mid >= hi:
        return _scan_part(buf, lo, hi, marks)
    left = _pool.submit(_scan_part, buf, lo, mid, marks)  # type: ignore[attr-defined]
    n2, m2, c2 = _scan_part(buf, mid, hi, marks)
    n1, m1, c1 = left.result()
    if not marks:
        return n1 + n2, None, None
    return n1 + n2, bool(m1 and m2), bool(c1 and c2)


def _scan_part(buf: bytes | mmap.mmap, lo: int, hi: int, marks: bool) -> tuple[int, bool | None, bool | None]:
    """_scan of buf[lo:hi] in one thread: part by part, each part's newlines, then (while every part so far was
    all collective lines) its markers at the four alignments of a 32-bit word and its carriage returns and
    escapes, while the part is still in the cache. bytes.count's substring search was half of the time of
    reading a big NCCL log; numpy's word comparisons are about three times faster. (Hyperscan was measured too:
    one scan of a piece costs what bytes.count does before any match is reported.)"""
    np = _numpy
    u8, u32 = np.uint8, np.dtype("<u4")  # type: ignore[attr-defined]
    n, marked, clean = 0, marks, True
    s = lo
    while s < hi:
        e = buf.find(b"\n", min(hi - 1, s + _SUB), hi) + 1 or hi
        k = int(np.count_nonzero(np.frombuffer(buf, u8, e - s, s) == 10))  # type: ignore[attr-defined]
        n += k
        if marked:
            m = 0
            for a in range(4 if e - s >= 4 else 0):
                words = np.frombuffer(buf, u32, (e - s - a) // 4, s + a)  # type: ignore[attr-defined]
                m += int(np.count_nonzero(words == _OPC))  # type: ignore[attr-defined]
            if m != k:
                marked = False
            elif clean and (buf.find(b"\r", s, e) >= 0 or buf.find(b"\x1b", s, e) >= 0):
                clean = False
        s = e
    return (n, marked, clean) if marks else (n, None, None)


def _count(buf: bytes | mmap.mmap, sub: bytes, lo: int, hi: int) -> int:
    """buf.count(sub, lo, hi), for a mapped file too (an mmap has no count)."""
    if isinstance(buf, bytes):
        return buf.count(sub, lo, hi)
    if sub == b"\n" and hi - lo >= 1 << 20 and _numpy:
        np = _numpy
        return int(np.count_nonzero(np.frombuffer(buf, np.uint8, hi - lo, lo) == 10))  # type: ignore[attr-defined]
    return buf[lo:hi].count(sub)


def _own(buf: bytes | mmap.mmap, lo: int, hi: int) -> tuple[bytes, int, int]:
    """buf[lo:hi] as bytes of its own (a copy of a mapped file's piece), with its bounds."""
    if isinstance(buf, bytes):
        return buf, lo, hi
    return buf[lo:hi], 0, hi - lo


_PROC_CACHE: dict[bytes, tuple[bytes, int] | None] = {}  # a line's start before ` NCCL ` -> its _proc_key
_PROC_CACHE_MAX = 4096


def _coll_key(ln: bytes) -> tuple[bytes, bytes] | None:
    """A collective line's process (NCCL's `host:pid:`) and communicator (`comm 0x...`; b"" when not printed)."""
    found = _proc_key(ln)
    if not found:
        return None
    c = _COMM.search(ln, found[1])
    return found[0], c.group(1) if c else b""


def _proc_key(ln: bytes) -> tuple[bytes, int] | None:
    """NCCL's `host:pid:` of a line, and where its prefix ends.

    Asked of every collective line kept, and a process's lines share their start: found once per start. A
    `:pid:tid [dev]` before ` NCCL ` is the line's first (no match can span ` NCCL `, whose letters the pattern
    has no room for), so what the start gives is what the whole line gives."""
    k = ln.find(b" NCCL ")
    if k > 0:
        start = ln[:k]
        if start in _PROC_CACHE:
            return _PROC_CACHE[start]
        m = _NCCL_PID.search(start)
        if m is not None:
            h = _NCCL_HOST.search(start, max(0, m.start() - 254), m.start())
            got = (h.group(0) + b":" + m.group(1) + b":", m.end()) if h else None
            if len(_PROC_CACHE) >= _PROC_CACHE_MAX:
                _PROC_CACHE.clear()
            _PROC_CACHE[start] = got
            return got
    m = _NCCL_PID.search(ln)
    if not m:
        d = _NCCL_DEV.match(ln)
        return (d.group(0), d.end()) if d else None
    h = _NCCL_HOST.search(ln, max(0, m.start() - 254), m.start())
    if not h:
        return None
    return h.group(0) + b":" + m.group(1) + b":", m.end()


_SHOWN = {
    "nccl_log": "PyTorch/NCCL log",
    "pyspy": "py-spy dump",
    "kernel_log": "kernel log",
    "nvidia_smi": "nvidia-smi",
    "ip_link": "ip link",
    "torch_log": "Python/torch log or traceback",
    "flight_recorder": "Flight Recorder dump",
    "procstate": "ps table or /proc state",
    "nccl_tests": "nccl-tests output or results per node set",
    "rank_timing": "per-rank timings",
    "pp_schedule": "pipeline schedule action lists",
    "gdb": "gdb backtrace",
    "faulthandler": "Python faulthandler dump",
    "pyspy_top": "py-spy top",
    "ps_table": "ps/top table or /proc/PID/stack",
    "horovod_log": "Horovod stall warning",
    "pystack": "pystack dump",
    "p2p_bandwidth": "p2pBandwidthLatencyTest output",
    "nvidia_smi_q": "nvidia-smi -q report",
    "dcgmi_diag": "dcgmi diag results",
    "gpu_topo": "nvidia-smi topo -m matrix",
}


def readable(ev: Evidence) -> bool:
    """Whether anything was read: a record, a catalogue line, or a layout a parser knew (even with nothing of
    note in it). What is not readable is a text in which no row matched and no structure was read: the CLI's
    exit 2 and the bot's "no evidence" reply, decided here for both."""
    found = ev.stacks or ev.processes or ev.collectives or ev.events or ev.gpus or ev.ib_ports or ev.links
    return bool(found or ev.reads)


def looked_for() -> str:
    """The kinds hangdx reads, as a person names them: for a reply that found none of them."""
    return ", ".join(_SHOWN.get(k, k) for k in sorted({m.KIND for m in registry.parsers()}))


def _short(spans: list[str]) -> str:
    return ", ".join(spans[:4]) + (f" and {len(spans) - 4} more" if len(spans) > 4 else "")


def chunks_of(stream: BinaryIO, limit: int | None = None) -> Iterator[bytes]:
    """A binary stream in CHUNK_BYTES pieces, up to `limit` bytes when one is given.

    The next piece is read by a thread while the caller works on this one (a read waits without the GIL), at most
    READ_AHEAD pieces ahead: reading a big log then costs about what scanning it does, not the two added."""
    # The first piece is read here: a small input (one piece, or a pipe that gives less) never starts a thread.
    total = 0
    while limit is None or total < limit:
        want = CHUNK_BYTES if limit is None else min(CHUNK_BYTES, limit - total)
        data = stream.read(want)
        if not data:
            return
        total += len(data)
        yield data
        if len(data) == CHUNK_BYTES:
            break  # a full piece: a big input, read ahead from here on
    else:
        return
    if limit is not None:
        limit -= total
    q: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=READ_AHEAD)
    stop = threading.Event()

    def put(item: bytes | BaseException | None) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def reader() -> None:
        total = 0
        try:
            while limit is None or total < limit:
                want = CHUNK_BYTES if limit is None else min(CHUNK_BYTES, limit - total)
                data = stream.read(want)
                if not data:
                    break
                total += len(data)
                if not put(data):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the caller, raised there
            put(e)
            return
        put(None)

    t = threading.Thread(target=reader, name="hangdx-read-ahead", daemon=True)
    t.start()
    try:
        while (item := q.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()  # the caller stopped early (or is done): the reader ends after the read it is in


# -- from kept lines to evidence ---------------------------------------------------------------------------

_LOG_FAMILY = {"torch_log": "nccl_log"}  # one parser reads NCCL and PyTorch lines together
REGION_CLAIM = 5  # a line claimed at least this surely starts (or continues) a region of its kind


def clean(kept: Iterable[tuple[int, bytes]]) -> list[Line]:
    """Kept raw lines to clean ones; wrapped messages joined again."""
    norm = Normaliser()
    out: list[Line] = []
    pending: Line | None = None
    texts = [(no, raw.decode("utf-8", errors="replace").replace("\x00", "").rstrip("\r")) for no, raw in kept]
    for no, text in rejoin_hard_wraps(texts):
        for ln in norm.line(no, text):
            if pending is not None and (not continues(pending.text, ln.text) or not same_origin(pending, ln)):
                out.append(pending)
                pending = None
            if pending is not None:
                parts = (pending.parts or (pending.text,)) + (ln.text,)
                ln = Line(pending.no, pending.text + " " + ln.text.lstrip(), pending.rank, pending.host,
                          pending.pid, pending.label, pending.torchrun, parts)  # fmt: skip
                pending = None
            if joins_next(ln.text):
                pending = ln
                continue
            out.append(ln)
    if pending is not None:
        out.append(pending)
    return out


def by_source(lines: list[Line]) -> dict[tuple, list[Line]]:
    """Lines grouped by the host, process or file their prefixes named, in order of first appearance.

    Ranks are not split apart here: the log parser reads interleaved `[rankN]:` lines itself (a traceback per
    rank, one watchdog report repeated by its `what():`), so a rank travels with its line (see `_region`).
    """
    groups: dict[tuple, list[Line]] = {}
    for ln in lines:
        groups.setdefault((ln.host, ln.pid, ln.label), []).append(ln)
    return groups


def _runs_by_rank(lines: list[Line]) -> list[tuple[int | None, list[Line]]]:
    out: list[tuple[int | None, list[Line]]] = []
    for ln in lines:
        if out and out[-1][0] == ln.rank:
            out[-1][1].append(ln)
        else:
            out.append((ln.rank, [ln]))
    return out


def _claimers() -> list[ModuleType]:
    return [m for m in registry.parsers() if hasattr(m, "claims") and hasattr(m, "parse_lines")]


class _ClaimNeedles:
    """Which claimers cannot claim a line: one Hyperscan pass over it finds every claimer's needles (its module's
    CLAIM_WORDS and CLAIM_PATTERNS, which every line it claims holds); a claimer with none of its needles in the
    line is not asked. A kept line used to be asked by every claimer (most of them running a regex or two);
    Hyperscan asks them all at once. Without Hyperscan, or for a claimer without needles, every line is asked."""

    _made: dict[tuple[str, ...], _ClaimNeedles] = {}

    def __init__(self, mods: list[ModuleType]) -> None:
        self.db: object = None
        self.with_needles = frozenset(
            i for i, m in enumerate(mods) if getattr(m, "CLAIM_WORDS", None) is not None
        )
        if self.with_needles:
            self.db = _claims_db(mods, self.with_needles)

    @classmethod
    def of(cls, mods: list[ModuleType]) -> _ClaimNeedles:
        key = tuple(m.__name__ for m in mods)
        if key not in cls._made:
            cls._made[key] = cls(mods)
        return cls._made[key]

    def skip(self, text: str) -> frozenset[int]:
        """Indexes of the claimers whose needles are not in the line."""
        if self.db is None:
            return frozenset()
        found: set[int] = set()
        try:
            self.db.scan(  # type: ignore[attr-defined]
                text.encode("utf-8", "surrogatepass"), match_event_handler=lambda i, *_: found.add(i)
            )
        except Exception:  # noqa: BLE001 - the database busy in another thread, say: every claimer is asked
            return frozenset()
        return self.with_needles.difference(found)


def _claims_db(mods: list[ModuleType], ids: frozenset[int]) -> object:
    """The Hyperscan database of the claimers' needles (each reports its claimer's index, once a line); kept in the
    user's cache as the catalogue's is. None without Hyperscan, or when it cannot be made."""
    try:
        import hyperscan
    except ImportError:
        return None
    exprs, flags, owners = [], [], []
    for i in sorted(ids):
        m = mods[i]
        for w in m.CLAIM_WORDS:
            exprs.append("".join(f"\\x{b:02x}" for b in w.encode("utf-8")).encode())
            flags.append(hyperscan.HS_FLAG_SINGLEMATCH)
            owners.append(i)
        for p in getattr(m, "CLAIM_PATTERNS", ()):
            exprs.append(p.encode("utf-8"))
            flags.append(hyperscan.HS_FLAG_SINGLEMATCH | hyperscan.HS_FLAG_MULTILINE)
            owners.append(i)
    try:
        return catalogue_mod.hyperscan_db(exprs, owners, flags, ".claims.hsdb")
    except Exception:  # noqa: BLE001 - no database: every claimer asked, as before
        return None


def family(kind: str) -> str:
    """NCCL and PyTorch lines are read by one parser: one family."""
    return _LOG_FAMILY.get(kind, kind)


def kind_of(text: str, mods: list[ModuleType], skip: frozenset[int] = frozenset()) -> str | None:
    """The kind whose claim of the line is surest (the first of equals), None under REGION_CLAIM; `skip`: indexes
    of mods known to claim the line less than REGION_CLAIM (its needles are not in it)."""
    best, score = None, 0
    for i, m in enumerate(mods):
        if i in skip:
            continue
        try:
            s = int(m.claims(text))
        except Exception:  # noqa: BLE001 - a claim must never sink the reading
            s = 0
        if s > score:
            best, score = m.KIND, s
    if score < REGION_CLAIM or best is None:
        return None
    return _LOG_FAMILY.get(best, best)


def regions(lines: list[Line], mods: list[ModuleType]) -> list[tuple[str | None, list[Line]]]:
    """Consecutive lines cut where the kind of the claimed lines changes; unclaimed lines join their region."""
    out: list[tuple[str | None, list[Line]]] = []
    kind: str | None = None
    cur: list[Line] = []
    needles = _ClaimNeedles.of(mods)
    for ln in lines:
        k = kind_of(ln.text, mods, needles.skip(ln.text)) if ln.text.strip() else None
        if k is not None and k != kind:
            if cur:
                out.append((kind, cur))
            kind, cur = k, []
        cur.append(ln)
    if cur:
        out.append((kind, cur))
    # Lines before the first claimed line belong to the region after them (a paste's first lines).
    if len(out) >= 2 and out[0][0] is None:
        out[1] = (out[1][0], out[0][1] + out[1][1])
        out.pop(0)
    return out


def read_text(
    chunks: Iterable[bytes | Mapped], src: Source, ev: Evidence, size: int | None = None
) -> ReadReport:
    """Read a text of any size (`size` when it is known) into ev, streaming; what was read as what is in the
    report."""
    cat = signals.current(ev)
    keeper = Keeper(cat, size)
    for data in chunks:
        keeper.feed(data)
    kept = keeper.close()
    for proc in keeper.procs:
        host, _, pid = proc.rstrip(b":").rpartition(b":")
        if host and pid.isdigit():
            ev.nccl_procs.setdefault(host.decode("utf-8", "replace"), set()).add(int(pid))
    report = ReadReport(
        src.name,
        total_lines=keeper.lineno,
        total_bytes=keeper.bytes,
        collectives_seen=keeper.collectives,
        dropped_lines=keeper.dropped,
    )
    mods = _claimers()
    by_kind = {m.KIND: m for m in mods}
    lines = clean(kept)
    last = next((ln.no for ln in reversed(lines) if ln.text.strip()), 0)
    if last:
        ev.last_lines[src.name] = max(last, ev.last_lines.get(src.name, 0))
    # Every clean line meets every catalogue row; the hits become events after the region parsers ran, so that
    # a line a parser read is not counted twice.
    hits = signals.find(cat, lines) if cat is not None else []
    events_before, colls_before = len(ev.events), len(ev.collectives)
    for (host, pid, _label), glines in by_source(lines).items():
        gsrc = Source(src.name, host=host or src.host, rank=src.rank, pid=pid if pid is not None else src.pid)
        cut = regions(glines, mods)
        if all(
            k is None for k, _ in cut
        ):  # no line says its kind alone (a headerless CSV): the whole decides
            whole = registry.detect("\n".join(ln.text for ln in glines[:2000]).encode())
            if whole is not None and whole.KIND in by_kind:
                cut = [(family(whole.KIND), glines)]
        for kind, rlines in cut:
            report.regions.append(Region(src.name, kind, rlines[0].no, rlines[-1].no, len(rlines)))
            if kind is not None:
                _region(by_kind[kind], rlines, gsrc, ev)
        ev.note_host(gsrc.host)
    if hits:
        report.signals = signals.apply(hits, src, ev, events_before, colls_before)
    report.code_lines = pycode.scan(lines, src, ev)
    note = report.describe()
    if note:
        ev.reads.append(note)
    if keeper.dropped:
        ev.gap(
            src.name,
            f"{keeper.dropped:,} of {keeper.lineno:,} lines from the middle of this log were not kept "
            "(it was read whole; its head, its tail and every line naming a fault were)",
        )
    return report


def _region(mod: ModuleType, lines: list[Line], src: Source, ev: Evidence) -> None:
    """One region to its parser: log lines carry their own rank (a third item); other kinds get it as Source."""
    if family(mod.KIND) == "nccl_log":
        # torchrun's `[rankN]:` goes back on: the log parsers read it, and the quote then shows who said it.
        parts = [(src.rank, [(ln.no, ln.torchrun + ln.text, ln.rank) for ln in lines])]
    elif getattr(mod, "READS_RANKED_LINES", False):  # one call, each line with the rank its prefix named
        parts = [(src.rank, [(ln.no, ln.text, ln.rank) for ln in lines])]
    else:
        parts = [(r, [(ln.no, ln.text) for ln in run]) for r, run in _runs_by_rank(lines)]
    for rank, numbered in parts:
        rsrc = Source(src.name, host=src.host, rank=rank if rank is not None else src.rank, pid=src.pid)
        try:
            mod.parse_lines(numbered, rsrc, ev)
        except Exception as e:  # noqa: BLE001 - a bad region becomes a gap, never a traceback
            ev.gap(src.name, f"lines {numbered[0][0]}-{numbered[-1][0]} could not be read as {mod.KIND}: "
                   f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")  # fmt: skip


# -- any input: a dump read whole, a text streamed ---------------------------------------------------------

STDIN_MAX = 64 << 30  # standard input that never ends (`yes |`) stops here, with a gap saying so
_DUMP_MAX = 512 * 1024 * 1024  # a pickle or JSON document is read whole, up to this


def is_dump(head: bytes) -> bool:
    """A pickle or a JSON document: parsed whole by its own parser, not read as lines."""
    return head[:1] == b"\x80" or head.lstrip()[:1] in (b"{", b"[") and _json_like(head)


def _json_like(head: bytes) -> bool:
    s = head.lstrip()
    if s[:1] == b"{":
        # A JSON object's first key is a string (or it is empty); `{1}[Hardware Error]: ...` (the kernel's GHES
        # report, one record per `{n}`) is a log line.
        return s[1:].lstrip()[:1] in (b'"', b"}", b"")
    # `[` starts py-spy --json output, and also `[rank0]: ...` and `[2024-...] ...` log lines, and Open MPI's
    # process name `[[31705,1],77][btl_openib_component.c:2951:handle_wc] ...` (ORTE_NAME_PRINT: [[job,step],rank]).
    if _ORTE_NAME.match(s):
        return False
    return s[:1] == b"[" and s[1:].lstrip()[:1] in (b"{", b"[", b"]")


_ORTE_NAME = lazy(rb"\[\[\d{1,10},\d{1,10}\],\d{1,10}\]")


def read_any(stream: BinaryIO, src: Source, ev: Evidence, limit: int | None = None) -> ReadReport | None:
    """Read one input of any kind into ev: a dump whole, a text streamed. None when it was not text."""
    from hangdx.probes.text import looks_binary

    first = stream.read(CHUNK_BYTES)
    if not first or not first.strip():
        ev.gap(src.name, "empty file: nothing to read")
        return None
    if is_dump(first[:64]):
        rest = stream.read(_DUMP_MAX - len(first) + 1)
        registry.parse_artifact(first + rest, src, ev)
        return None
    if looks_binary(first[:8192]):
        size = _file_size(stream)
        if size is not None:
            ev.gap(src.name, f"binary file of {size} bytes, not an artifact hangdx reads: skipped")
        else:
            ev.gap(src.name, f"not a known artifact (binary content of {len(first)}+ bytes): skipped")
        return None

    left = None if limit is None else max(0, limit - len(first))
    mapped = _mapped(stream, left) if len(first) == CHUNK_BYTES else None

    def rest() -> Iterator[bytes | Mapped]:
        yield first
        if mapped is not None:
            yield mapped
        else:
            yield from chunks_of(stream, left)

    before = registry._size(ev)
    size = len(first) + (mapped.end - mapped.start) if mapped is not None else None
    report = read_text(rest(), src, ev, size)
    kinds = {r.kind for r in report.regions if r.kind}
    if len(kinds) == 1 and registry._size(ev) == before and not report.signals:
        mod = next((m for m in registry.parsers() if m.KIND in kinds), None)
        if mod is not None and not getattr(mod, "QUIET_WHEN_EMPTY", False):
            ev.gap(
                src.name,
                f"read as {mod.KIND}, but nothing in its {report.total_bytes} bytes is evidence hangdx uses",
            )
    if limit is not None and report.total_bytes >= limit:
        ev.gap(
            src.name, f"read the first {limit:,} bytes of an input that did not end: the rest was not read"
        )
    if not any(r.kind for r in report.regions) and not report.signals and not report.code_lines:
        ev.gap(
            src.name,
            f"not a known artifact (text of {report.total_bytes} bytes): skipped (looked for {looked_for()})",
        )
    return report


def _file_size(stream: BinaryIO) -> int | None:
    """The size of a regular file; None for a pipe, a socket or memory."""
    import os
    import stat

    try:
        st = os.fstat(stream.fileno())
    except (OSError, AttributeError, ValueError, io.UnsupportedOperation):
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None
