"""The signal catalogue: what the emitters (PyTorch, NCCL, gloo, the kernel, the NVIDIA driver, launchers) print
when something goes wrong, one YAML row per message, matched unanchored on every line as the floor under the
kind-specific region parsers.

Rows live in `probes/catalogue/*.yaml` (package data). `load()` validates every row (a bad row is a
`CatalogueError` naming its file and id) and compiles one multi-pattern matcher: Hyperscan when it can be
imported (all rows in one database, one pass over a buffer), else a pure-Python prefilter (one combined regex
of each row's longest literal fragment) before each row's own `re`. Either way a candidate is confirmed, and
its fields extracted, by the row's Python `re` on the one line it sits on, so both paths give the same hits.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from hangdx.playbooks.verdict import CATEGORIES as verdict_categories
from hangdx.probes.rx import lazy

# A row points at one of the verdict's categories, never "unknown" (a row with no cause has category null).
CATEGORIES = frozenset(verdict_categories) - {"unknown"}
STRENGTHS = ("decisive", "suggestive", "context")
KEYS = frozenset(
    {"id", "emitter", "source", "pattern", "fields", "event", "category", "strength", "meaning", "examples"}
)
OPTIONAL = frozenset({"flags", "details"})
# How many lines after a row's message its `details` patterns are looked for (Ray prints six under its error).
DETAIL_LINES = 8
# Fields whose text is a number: parsed to int so that playbooks compare ranks, not strings.
INT_FIELDS = frozenset(
    {"rank", "pid", "device", "xid", "seq", "port", "exitcode", "signal", "timeout_ms", "size", "world_size",
     "local_rank", "step", "worker", "errno", "gpu", "ran_ms", "timeout_s", "joined", "peer_rank",
     "last_enqueued", "last_completed", "timeout_rank", "peer_pid"}
)  # fmt: skip
# Fields whose text is a list of ranks (`[2, 5]`, `{7, 19}`, `0-3, 8`): parsed to a list of ints, so that the ranks a
# line names (stragglers, ranks that never arrived) can be culprits. `value_ranks` is a list of `value/rank` pairs
# (Megatron's straggler detector): its ranks go to `ranks`.
RANK_LIST_FIELDS = frozenset({"ranks"})
_RANK_LIST = lazy(
    r"[\[{(]?\s*\d{1,7}(?:\s*-\s*\d{1,7})?(?:\s*[,; ]\s*\d{1,7}(?:\s*-\s*\d{1,7})?){0,4096}\s*,?\s*[\]})]?"
)
_RANGE = lazy(r"(\d{1,7})(?:\s*-\s*(\d{1,7}))?")
MAX_LISTED = 65536  # a range wider than a job is not a list of its ranks
MIN_LITERAL = 8
SCAN_BATCH_CHARS = 8 << 20  # lines scanned at once by match_lines: a bounded copy whatever the input
MAX_LINE = 8192  # a candidate line longer than this is confirmed on its first MAX_LINE characters

# What the pattern subset forbids (the same list the shared checker uses), so Hyperscan, RE2 and re agree.
_FORBIDDEN = [
    (re.compile(r"\(\?[=!]|\(\?<[=!]"), "lookaround"),
    (re.compile(r"\\[1-9]"), "backreference"),
    (re.compile(r"\(\?>"), "atomic group"),
    (re.compile(r"\\[AZ]"), r"\A or \Z"),
    (re.compile(r"(?<!\\)\.\*|(?<!\\)\.\+"), "unbounded .* / .+"),
    (re.compile(r"\(\?[aiLmsux]+\)"), "inline flag"),
]
_GROUP_NAME = lazy(r"\(\?P<\w+>")
_EVENT = lazy(r"[a-z][a-z0-9_]*")


class CatalogueError(ValueError):
    """A row that breaks the schema: the message names its file and id."""


@dataclass(frozen=True)
class Row:
    id: str
    emitter: str
    source: str
    pattern: str
    fields: tuple[str, ...]
    event: str
    category: str | None
    strength: str
    meaning: str
    examples: tuple[str, ...]
    flags: str | None = None
    file: str = ""
    # Lines the emitter prints under its message that name more of what it is about (Ray's ActorDiedError:
    # `\tpid: N`, `\tip: A`): each a pattern with one named group, matched whole against each of the next
    # DETAIL_LINES lines of the same process.
    details: tuple[str, ...] = ()
    _rx: re.Pattern[str] | None = field(default=None, compare=False, repr=False)

    @property
    def rx(self) -> re.Pattern[str]:
        """The row's compiled pattern, compiled the first time a line is confirmed against it: most rows of a
        catalogue of hundreds never meet a candidate line in one text."""
        if self._rx is None:
            object.__setattr__(self, "_rx", re.compile(self.pattern, re.I if self.flags == "i" else 0))
        return self._rx  # type: ignore[return-value]

    def extract(self, line: str) -> dict[str, Any] | None:
        """The row's fields from one line (ints parsed), or None when the row does not match it."""
        m = self.rx.search(line[:MAX_LINE])
        return _values(m, self.fields) if m else None

    def detail(self, line: str) -> dict[str, Any]:
        """The fields one of the lines under the message gives (its `details` patterns, each matched whole)."""
        text = line.strip()[:MAX_LINE]
        for pat in self.details:
            m = _detail_rx(pat).fullmatch(text)
            if m:
                return _values(m, tuple(m.groupdict()))
        return {}


@functools.lru_cache(maxsize=256)
def _detail_rx(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def _values(m: re.Match[str], names: tuple[str, ...]) -> dict[str, Any]:
    """A match's named groups as fields: ints parsed, rank lists read."""
    out: dict[str, Any] = {}
    for name in names:
        value = m.group(name)
        if value is None:
            continue
        value = value.strip()
        if name in RANK_LIST_FIELDS or name == "value_ranks":
            ranks = rank_list(value, pairs=name == "value_ranks")
            out[name] = value if ranks is None or name == "value_ranks" else ranks
            if name == "value_ranks" and ranks:
                out["ranks"] = ranks
            continue
        if name in INT_FIELDS:
            try:
                out[name] = int(value, 0) if value.lower().startswith("0x") else int(value)
            except ValueError:
                out[name] = value
        else:
            out[name] = value
    return out


def rank_list(text: str, pairs: bool = False) -> list[int] | None:
    """The ranks a list field names: `[2, 5]`, `{7, 19}`, `0-3, 8` (None when the text is not such a list); with
    `pairs`, the rank of each `value/rank` pair (`281.10/7, 355.40/19`)."""
    if pairs:
        found = [int(r) for r in re.findall(r"/\s*(\d{1,7})\b", text)]
        return sorted(set(found)) or None
    if not _RANK_LIST.fullmatch(text.strip()):
        return None
    out: set[int] = set()
    for m in _RANGE.finditer(text):
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo or hi - lo > MAX_LISTED:
            return None
        out.update(range(lo, hi + 1))
    return sorted(out)


def literal_run(p: str) -> int:
    """The longest run of fixed characters, counted as the shared checker counts it (rows must agree)."""
    best = cur = 0
    i = 0
    depth_class = False
    while i < len(p):
        c = p[i]
        if depth_class:
            if c == "]":
                depth_class = False
            i += 1
            cur = 0
            continue
        if c == "\\" and i + 1 < len(p):
            nxt = p[i + 1]
            if nxt in "dDwWsSbB":
                cur = 0
            else:
                cur += 1
            i += 2
        elif c == "[":
            depth_class = True
            cur = 0
            i += 1
        elif c in "(){}|*+?.^$":
            if c in "*?{" and cur:
                cur -= 1  # the char before a quantifier is not fixed
            cur = 0 if c != ")" else 0
            i += 1
        else:
            cur += 1
            i += 1
        best = max(best, cur)
    return best


def needle(pattern: str) -> str:
    """The longest single string every line the pattern matches holds (the first of `needles` when it has one)."""
    found = needles(pattern)
    return found[0] if len(found) == 1 else ""


_NEEDLES: dict[str, tuple[str, ...]] = {}  # pattern -> its needles (also filled from the rows' cache)


def _needles(pattern: str) -> tuple[str, ...]:
    found = _NEEDLES.get(pattern)
    if found is None:
        found = _NEEDLES[pattern] = tuple(needles(pattern))
    return found


_PRODUCT_MAX = 64  # strings a needle set may hold: alternatives multiplied out, no more


def needles(pattern: str) -> list[str]:
    """Strings of which every line the pattern matches holds at least one: the prefilter's needles for a row.

    Read from Python's own parse of the pattern, so that groups, alternatives and repeats are what they are. A run
    of fixed parts is multiplied out (`State: (Down|Armed)` gives `State: Down`, `State: Armed`), an alternative
    gives the needles of each of its branches, and of all the sets found the one whose shortest string is the
    longest wins. Empty when no set has every string at least MIN_LITERAL long: the row is then tried on every
    kept line."""
    try:
        import re._parser as sre_parse  # Python 3.11+
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_parse  # type: ignore[no-redef]
    from re import _constants as c  # type: ignore[attr-defined]

    def exact(op, av) -> list[str] | None:
        """The finite set of strings this node matches, or None."""
        if op is c.LITERAL:
            return [chr(av)]
        if op is c.AT:
            return [""]  # \b, ^, $: zero width
        if op is c.IN:
            chars = [chr(a) for o, a in av if o is c.LITERAL]
            return chars if len(chars) == len(av) and len(chars) <= 4 else None
        if op is c.SUBPATTERN:
            return seq_exact(av[-1])
        if op is c.BRANCH:
            out: list[str] = []
            for branch in av[1]:
                e = seq_exact(branch)
                if e is None:
                    return None
                out += e
            return out if len(out) <= _PRODUCT_MAX else None
        if op in (c.MAX_REPEAT, c.MIN_REPEAT) and av[0] == av[1] == 1:
            return seq_exact(av[2])
        return None

    def seq_exact(seq) -> list[str] | None:
        acc = [""]
        for op, av in seq:
            e = exact(op, av)
            if e is None:
                return None
            acc = [a + b for a in acc for b in e]
            if len(acc) > _PRODUCT_MAX:
                return None
        return acc

    def score(s: list[str] | None) -> tuple[int, int]:
        return (min(len(x) for x in s), -len(s)) if s else (0, 0)

    def required(seq) -> list[str] | None:
        """The best set such that every match of seq holds one of its strings."""
        best: list[list[str] | None] = [None]

        def consider(s: list[str] | None) -> None:
            if s and all(s) and score(s) > score(best[0]):
                best[0] = sorted(set(s))

        acc = [""]
        for op, av in seq:
            e = exact(op, av)
            if e is not None:
                grown = [a + b for a in acc for b in e]
                if len(grown) > _PRODUCT_MAX:
                    consider(acc)
                    grown = e
                acc = grown
                continue
            consider(acc)
            acc = [""]
            if op is c.SUBPATTERN:
                consider(required(av[-1]))  # a group is on the line whenever the pattern is
            elif op in (c.MAX_REPEAT, c.MIN_REPEAT) and av[0] >= 1:
                consider(required(av[2]))  # at least once
            elif op is c.BRANCH:
                sets = [required(branch) for branch in av[1]]
                if all(sets):
                    consider([x for s in sets for x in s])  # type: ignore[union-attr]
            # a class, an optional part: nothing certain
        consider(acc)
        return best[0]

    found = required(sre_parse.parse(pattern)) or []
    return found if found and min(len(x) for x in found) >= MIN_LITERAL else []


def check_row(raw: Any, where: str) -> list[str]:
    """Every schema problem of one row, as text (empty when the row is good)."""
    if not isinstance(raw, dict):
        return [f"{where}: not a mapping"]
    probs: list[str] = []
    missing = KEYS - raw.keys()
    if missing:
        return [f"{where}: missing {sorted(missing)}"]
    extra = raw.keys() - KEYS - OPTIONAL
    if extra:
        probs.append(f"{where}: unknown keys {sorted(extra)}")
    if not isinstance(raw["id"], str) or not raw["id"]:
        probs.append(f"{where}: id must be text")
    if raw["category"] is not None and raw["category"] not in CATEGORIES:
        probs.append(f"{where}: category {raw['category']!r}")
    if raw["strength"] not in STRENGTHS:
        probs.append(f"{where}: strength {raw['strength']!r}")
    if raw["category"] is None and raw["strength"] != "context":
        probs.append(f"{where}: no category but strength {raw['strength']}")
    if raw["strength"] == "context" and raw["category"] is not None:
        probs.append(f"{where}: context rows have category null")
    if raw.get("flags") not in (None, "i"):
        probs.append(f"{where}: flags {raw.get('flags')!r}")
    if not _EVENT.fullmatch(str(raw["event"])):
        probs.append(f"{where}: event {raw['event']!r} not snake_case")
    src = str(raw["source"]).split()
    if len(src) < 2 or "/" not in src[0]:
        probs.append(f"{where}: source should be 'owner/repo path'")
    pat = raw["pattern"]
    if not isinstance(pat, str) or pat.startswith("^") or pat.startswith(".*"):
        return probs + [f"{where}: pattern must be unanchored text"]
    for bad, what in _FORBIDDEN:
        if bad.search(pat):
            probs.append(f"{where}: {what} in pattern")
    if literal_run(pat) < MIN_LITERAL:
        probs.append(f"{where}: no literal fragment of >= {MIN_LITERAL} chars")
    try:
        rx = re.compile(pat, re.I if raw.get("flags") == "i" else 0)
    except re.error as e:
        return probs + [f"{where}: re: {e}"]
    fields = raw["fields"] or []
    if not isinstance(fields, list) or list(rx.groupindex) != fields:
        probs.append(f"{where}: fields {fields} != groups {list(rx.groupindex)}")
        fields = [f for f in fields if f in rx.groupindex] if isinstance(fields, list) else []
    probs += _check_details(raw.get("details"), where)
    examples = raw["examples"]
    if not isinstance(examples, list) or not examples:
        return probs + [f"{where}: no examples"]
    for line in examples:
        m = rx.search(str(line))
        if not m:
            probs.append(f"{where}: example does not match: {str(line)[:100]!r}")
            continue
        for f in fields if isinstance(fields, list) else []:
            if m.group(f) is None:
                probs.append(f"{where}: example leaves field {f} empty: {str(line)[:80]!r}")
    return probs


def _check_details(details: Any, where: str) -> list[str]:
    """A row's `details`: a list of patterns, each with exactly one named group (the field it gives)."""
    if details is None:
        return []
    if not isinstance(details, list) or not details:
        return [f"{where}: details must be a list of patterns"]
    probs = []
    for pat in details:
        try:
            rx = re.compile(str(pat))
        except re.error as e:
            probs.append(f"{where}: details {str(pat)[:60]!r}: re: {e}")
            continue
        if len(rx.groupindex) != 1:
            probs.append(f"{where}: details {str(pat)[:60]!r} must have one named group")
    return probs


def _row(raw: dict, file: str) -> Row:
    flags = raw.get("flags")
    return Row(
        id=raw["id"],
        emitter=str(raw["emitter"]),
        source=str(raw["source"]),
        pattern=raw["pattern"],
        fields=tuple(raw["fields"] or ()),
        event=str(raw["event"]),
        category=raw["category"],
        strength=raw["strength"],
        meaning=" ".join(str(raw["meaning"]).split()),
        examples=tuple(str(x) for x in raw["examples"]),
        flags=flags,
        file=file,
        details=tuple(str(x) for x in raw.get("details") or ()),
    )


def _files() -> list[tuple[str, str]]:
    """(name, text) of every catalogue file shipped with the package, in name order."""
    root = resources.files("hangdx.probes").joinpath("catalogue")
    out = []
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            out.append((entry.name, entry.read_text(encoding="utf-8")))
    return out


def load_rows(files: list[tuple[str, str]]) -> list[Row]:
    """Rows of the given (name, YAML text) files; every problem of every row raised at once."""
    import yaml  # here: the checked rows are read from the cache as JSON, without YAML

    probs: list[str] = []
    rows: list[Row] = []
    seen: dict[str, str] = {}
    for name, text in files:
        try:
            raws = yaml.load(text, Loader=_loader())  # noqa: S506 - a safe loader (libyaml's when there is one)
        except yaml.YAMLError as e:
            probs.append(f"{name}: not YAML: {' '.join(str(e).split())[:200]}")
            continue
        if raws is None:
            continue
        if not isinstance(raws, list):
            probs.append(f"{name}: not a YAML list")
            continue
        for n, raw in enumerate(raws):
            rid = raw.get("id", f"#{n}") if isinstance(raw, dict) else f"#{n}"
            where = f"{name}:{rid}"
            row_probs = check_row(raw, where)
            if isinstance(rid, str) and rid in seen:
                row_probs.append(f"{where}: id also in {seen[rid]}")
            seen.setdefault(str(rid), name)
            if row_probs:
                probs.extend(row_probs)
                continue
            rows.append(_row(raw, name))
    if probs:
        raise CatalogueError(
            "; ".join(probs[:20]) + (f" (and {len(probs) - 20} more)" if len(probs) > 20 else "")
        )
    return rows


def _loader() -> type:
    import yaml

    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml parses hundreds of rows ten times faster


class Catalogue:
    """The rows and one matcher over all of them: Hyperscan when importable, else a Python prefilter."""

    def __init__(self, rows: list[Row], engine: str | None = None) -> None:
        self.rows = rows
        self.by_id = {r.id: r for r in rows}
        self.engine = "python"
        self._hs = None
        if engine in (None, "hyperscan"):
            self._hs = _hyperscan_db(rows)
            if self._hs is not None:
                self.engine = "hyperscan"
            elif engine == "hyperscan":
                raise CatalogueError("hyperscan is not importable")
        self._prefilter: _Prefilter | None = None  # the pure-Python matcher, made when first needed
        self._raw: dict[tuple[bytes, ...], Any] = {}

    # -- lines of text ---------------------------------------------------------------------------------------

    def match_line(self, text: str) -> list[tuple[Row, dict[str, Any]]]:
        """Every row that matches one clean line, with its fields, in catalogue order."""
        return [(self.rows[i], f) for i, f in self._confirm(text, self._candidates_line(text))]

    def match_lines(self, texts: list[str]) -> list[tuple[int, Row, dict[str, Any]]]:
        """(index, row, fields) of every row matching each line: one Hyperscan pass over all of them."""
        out: list[tuple[int, Row, dict[str, Any]]] = []
        if not texts or not self.rows:
            return out
        if self._hs is None:
            for n, text in enumerate(texts):
                for i, f in self._confirm(text, self._candidates_line(text)):
                    out.append((n, self.rows[i], f))
            return out
        batch: list[int] = []
        size = 0
        for n, text in enumerate(texts):
            batch.append(n)
            size += min(len(text), MAX_LINE) + 1
            if size >= SCAN_BATCH_CHARS:
                out.extend(self._scan_batch(texts, batch))
                batch, size = [], 0
        if batch:
            out.extend(self._scan_batch(texts, batch))
        return out

    def _scan_batch(self, texts: list[str], batch: list[int]) -> list[tuple[int, Row, dict[str, Any]]]:
        """One Hyperscan pass over some lines joined by newlines (a bounded copy), hits confirmed by `re`."""
        parts = [texts[n][:MAX_LINE].replace("\n", " ").encode("utf-8", "surrogatepass") for n in batch]
        starts, pos = [], 0
        for b in parts:
            starts.append(pos)
            pos += len(b) + 1
        hits: dict[int, set[int]] = {}

        def on_match(pid: int, _frm: int, to: int, _flags: int, _ctx: object) -> None:
            k = bisect.bisect_right(starts, max(to - 1, 0)) - 1
            hits.setdefault(k, set()).add(pid)

        self._hs.scan(b"\n".join(parts), match_event_handler=on_match)
        out = []
        for k, n in enumerate(batch):
            for i, f in self._confirm(texts[n], hits.get(k, set())):
                out.append((n, self.rows[i], f))
        return out

    def _candidates_line(self, text: str) -> set[int] | range:
        if self._hs is not None:
            found: set[int] = set()
            self._hs.scan(text[:MAX_LINE].encode("utf-8", "surrogatepass"),
                          match_event_handler=lambda pid, *_: found.add(pid))  # fmt: skip
            return found
        return self._pre.candidates(text[:MAX_LINE])

    @property
    def _pre(self) -> _Prefilter:
        if self._prefilter is None:
            self._prefilter = _prefilter(self.rows)
        return self._prefilter

    def _confirm(self, text: str, ids: set[int] | range) -> list[tuple[int, dict[str, Any]]]:
        out = []
        for i in sorted(ids):
            f = self.rows[i].extract(text)
            if f is not None:
                out.append((i, f))
        return out

    # -- raw bytes (the reader's chunks) ----------------------------------------------------------------------

    def with_words(self, words: bytes) -> Any:
        """A Hyperscan database of every row and of `words` (a caseless byte pattern: the reader's fault words),
        for `line_starts(..., db=)`: one pass finds both. None without Hyperscan."""
        if self._hs is None:
            return None
        key = (words,)
        if key not in self._raw:
            self._raw[key] = _hyperscan_db(self.rows, (words,))
        return self._raw[key]

    def line_starts(self, buf: bytes, lo: int, hi: int, db: Any = None) -> list[int]:
        """Offsets (in buf) of the starts of the lines of buf[lo:hi] that a row may match: one pass over the bytes.

        A candidate, not a hit: the line is kept and later normalised and confirmed by the row's own `re`."""
        ends: set[int] = set()
        db = db if db is not None else self._hs
        if db is not None:
            view = buf[lo:hi]

            def on_match(_pid: int, _frm: int, to: int, _flags: int, _ctx: object) -> None:
                ends.add(to)

            db.scan(view, match_event_handler=on_match)
            ends = {lo + e for e in ends}
        else:
            for m in self._pre.bytes_rx.finditer(buf, lo, hi):
                ends.add(m.end())
        starts = {buf.rfind(b"\n", lo, max(lo, e - 1)) + 1 or lo for e in ends}
        return sorted(max(s, lo) for s in starts)


@dataclass
class _Prefilter:
    """The pure-Python path: one regex of every row's longest literal; rows without a safe one always tried."""

    rx: re.Pattern[str] | None
    bytes_rx: re.Pattern[bytes]
    owners: dict[str, list[int]]
    always: list[int]

    def candidates(self, text: str) -> set[int]:
        found = set(self.always)
        if self.rx is not None:
            # Every start position, not finditer's non-overlapping hits: a needle may begin inside another's.
            pos = 0
            while (m := self.rx.search(text, pos)) is not None:
                found.update(self.owners.get(m.group(0).lower(), ()))
                pos = m.start() + 1
        return found


def _prefilter(rows: list[Row]) -> _Prefilter:
    owners: dict[str, list[int]] = {}
    always: list[int] = []
    for i, r in enumerate(rows):
        found = _needles(r.pattern)
        if not found:
            always.append(i)  # no string is on every line it matches
            continue
        for lit in found:
            owners.setdefault(lit.lower(), []).append(i)
    needles = sorted(owners, key=len, reverse=True)
    # A needle that holds a shorter one (`CUDA error: unc...` holds `CUDA error: `) stands for both rows.
    for long in needles:
        for short in needles:
            if short != long and short in long:
                owners[long] = owners[long] + [i for i in owners[short] if i not in owners[long]]
    alt = "|".join(re.escape(n) for n in needles)
    rx = re.compile(alt, re.I) if needles else None
    # On raw bytes: the same needles, or (rows without one) a fault word, so that nothing is lost.
    # Rows without a needle are looked for by their own pattern (names taken off), so that none is lost.
    alts = [re.escape(n.encode("utf-8")) for n in needles] + [
        _GROUP_NAME.sub("(?:", rows[i].pattern).encode("utf-8") for i in always
    ]
    bytes_rx = re.compile(b"(?i:" + b"|".join(alts) + b")") if alts else re.compile(b"(?!)")
    return _Prefilter(rx, bytes_rx, owners, always)


def _hyperscan_db(rows: list[Row], extra: tuple[bytes, ...] = ()) -> Any:
    """One Hyperscan block-mode database of every row (group names stripped), and of `extra` caseless byte
    patterns after them (ids from len(rows) on); None without hyperscan.

    Compiling takes a noticeable part of a second for a few dozen rows (more for hundreds), which every
    `hangdx analyze` would pay: the compiled database is kept in the user's cache, named by a hash of what
    was compiled, and only loaded when it is there."""
    try:
        import hyperscan
    except ImportError:
        return None
    if not rows and not extra:
        return None
    exprs, flags, ids = [], [], []
    for i, r in enumerate(rows):
        # A row is looked for by its needle, a plain string Hyperscan's literal matchers find (every hit is then
        # confirmed by the row's own `re`): a database of the full patterns was seen to miss lines it should
        # match (two rows sharing `\[(\d+)\] ` missed `[PG 0 Rank 0] - [0] Timeout at collective`). A row without
        # a needle keeps its pattern here (cut by _short_tail: a superset of its lines), and its hits are confirmed
        # by its `re` like a needle's. (Tried also by `re` on every kept line, as before, it found no line more in
        # the 23,000 lines of every fixture and every row's examples: that pass cost 5-10% of a big log's read.)
        found = _needles(r.pattern)
        for lit in found:  # a row with several needles (alternatives) reports its own id for each
            exprs.append(b"\\x" + lit.encode("utf-8").hex("\0").replace("\0", "\\x").encode())  # `\x41\x42`
            flags.append(hyperscan.HS_FLAG_CASELESS)
            ids.append(i)
        if not found:
            exprs.append(_short_tail(_GROUP_NAME.sub("(", r.pattern)).encode("utf-8"))
            # No SINGLEMATCH: one scan covers many lines, and each line must report its own match.
            flags.append(hyperscan.HS_FLAG_CASELESS if r.flags == "i" else 0)
            ids.append(i)
    for j, x in enumerate(extra):
        exprs.append(x)
        flags.append(hyperscan.HS_FLAG_CASELESS)
        ids.append(len(rows) + j)
    try:
        return hyperscan_db(exprs, ids, flags)
    except Exception as e:  # noqa: BLE001 - hyperscan.error names the expression; say which row
        at = re.search(r"(\d+)", str(e))
        n = ids[int(at.group(1))] if at and int(at.group(1)) < len(ids) else -1
        rid = rows[n].id if 0 <= n < len(rows) else "?"
        raise CatalogueError(f"hyperscan cannot compile the catalogue (row {rid}): {e}") from None


def hyperscan_db(exprs: list[bytes], ids: list[int], flags: list[int], suffix: str = ".hsdb") -> object:
    """A Hyperscan block-mode database of these expressions, from the user's cache when an earlier run compiled the
    same ones (a stale or damaged file is compiled again), else compiled and cached. Raises what compile raises."""
    import hyperscan

    version = getattr(hyperscan, "__version__", "")
    key = hashlib.sha256(repr((suffix, version, exprs, flags, ids)).encode()).hexdigest()[:32]
    cached = _cache_read(key, suffix)
    if cached is not None:
        try:
            db = hyperscan.loadb(cached, hyperscan.HS_MODE_BLOCK)
            db.scratch = hyperscan.Scratch(db)  # a loaded database comes without one
            db.scan(b"probe", match_event_handler=lambda *_: None)
            return db
        except Exception:  # noqa: BLE001 - a stale or damaged cache is compiled again
            pass
    db = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
    db.compile(expressions=exprs, ids=ids, flags=flags)
    try:
        _cache_write(key, hyperscan.dumpb(db), suffix)
    except Exception:  # noqa: BLE001 - no cache (a read-only home): compiled each time, still right
        pass
    return db


_TAIL_REPEAT = lazy(r"\{(\d+),(\d+)\}(\)*)$")


def _short_tail(pattern: str) -> str:
    """The pattern with its trailing bounded repeat cut to its least (`[^\n]{1,300}` to `[^\n]{1}`).

    Hyperscan reports every end of a match: a field of up to 300 characters at the end of a row would call back
    300 times per line. Cut, it still matches every line the row matches (and maybe more), which is all a
    candidate needs: the row's own `re` confirms it and reads the whole field."""
    m = _TAIL_REPEAT.search(pattern)
    if not m:
        return pattern
    least = int(m.group(1))
    return pattern[: m.start()] + (f"{{{least}}}" if least else "?") + m.group(3)


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hangdx"


def _cache_read(key: str, suffix: str = ".hsdb") -> bytes | None:
    """A cached file (the database, or the checked rows), only from a file this user owns that nobody else may
    write."""
    path = _cache_dir() / f"catalogue-{key}{suffix}"
    try:
        st = path.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            return None
        return path.read_bytes()
    except (OSError, AttributeError):
        return None


def _cache_write(key: str, data: bytes, suffix: str = ".hsdb") -> None:
    d = _cache_dir()
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".catalogue-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, d / f"catalogue-{key}{suffix}")
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def hyperscan_compiles(row: Row) -> str | None:
    """Why Hyperscan refuses one row's pattern; None when it compiles (or hyperscan is absent)."""
    try:
        import hyperscan
    except ImportError:
        return None
    db = hyperscan.Database()
    flag = hyperscan.HS_FLAG_SINGLEMATCH | (hyperscan.HS_FLAG_CASELESS if row.flags == "i" else 0)
    try:
        db.compile(expressions=[_GROUP_NAME.sub("(", row.pattern).encode()], flags=[flag])
    except Exception as e:  # noqa: BLE001
        return str(e)
    return None


@functools.cache
def load(engine: str | None = None) -> Catalogue:
    """The shipped catalogue, loaded and compiled once per process (engine: None picks the fastest there is)."""
    return Catalogue(_checked_rows(_files()), engine)


_ROW_KEYS = [f.name for f in dataclasses.fields(Row) if not f.name.startswith("_")]


def _checked_rows(files: list[tuple[str, str]]) -> list[Row]:
    """`load_rows(files)`, or the rows it gave for exactly these files and this module before.

    Checking hundreds of rows (YAML, schema, every example against its pattern) costs most of a second, which
    every `hangdx analyze` would pay: the checked rows are kept as JSON in the user's cache, named by a hash of
    the files' text and of this module's own source (a change to either checks them again)."""
    try:
        code = Path(__file__).read_bytes()
    except OSError:
        code = b""
    h = hashlib.sha256(code)
    for name, text in files:  # each part's length first: no two lists of files hash alike
        for part in (name.encode("utf-8", "surrogatepass"), text.encode("utf-8", "surrogatepass")):
            h.update(len(part).to_bytes(8, "little") + part)
    key = h.hexdigest()[:32]
    cached = _cache_read(key, ".rows.json")
    if cached is not None:
        try:
            rows = []
            for d in json.loads(cached):
                _NEEDLES.setdefault(d["pattern"], tuple(d.pop("needles")))
                rows.append(Row(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}))
            return rows
        except (ValueError, TypeError, KeyError, AttributeError):
            pass  # a damaged cache: checked again below
    rows = load_rows(files)
    try:
        data = [{**{k: getattr(r, k) for k in _ROW_KEYS}, "needles": _needles(r.pattern)} for r in rows]
        _cache_write(key, json.dumps(data).encode(), ".rows.json")
    except Exception:  # noqa: BLE001 - no cache (a read-only home): checked each time, still right
        pass
    return rows


def load_paths(paths: list[str | Path], engine: str | None = None) -> Catalogue:
    """A catalogue of the given files (for checks of rows not yet shipped)."""
    files = [(Path(p).name, Path(p).read_text(encoding="utf-8")) for p in paths]
    return Catalogue(load_rows(files), engine)


def main(argv: list[str] | None = None) -> int:
    """`python -m hangdx.probes.catalogue [FILE.yaml...]`: check rows (the shipped ones with no file named).

    Every schema rule, then the whole matcher on both paths: each example reaches its own row. Exit 1 with one
    line per problem."""
    import sys

    paths = sys.argv[1:] if argv is None else argv
    try:
        files = [(Path(p).name, Path(p).read_text(encoding="utf-8")) for p in paths] if paths else _files()
        rows = load_rows(files)
        cats = [Catalogue(rows)] + ([Catalogue(rows, "python")] if _hyperscan_db(rows) is not None else [])
    except (CatalogueError, OSError) as e:
        print(str(e).replace("; ", "\n"))
        return 1
    probs = []
    for r in rows:
        if (why := hyperscan_compiles(r)) is not None:
            probs.append(f"{r.file}:{r.id}: hyperscan: {why}")
        for line in r.examples:
            for cat in cats:
                if r.id not in [x.id for x, _ in cat.match_line(line)]:
                    probs.append(
                        f"{r.file}:{r.id}: the {cat.engine} matcher misses its example {line[:80]!r}"
                    )
    for p in probs:
        print(p)
    print(f"{len(rows)} rows in {len(files)} files, {len(probs)} problems ({cats[0].engine})")
    return 1 if probs else 0


if __name__ == "__main__":
    raise SystemExit(main())
