"""The catalogue as the reader's floor: every clean line meets every row, and a line a row matches becomes an event.

The region parsers read the shapes they know; whatever they do not read, the catalogue still does: a line one
of its rows matches (anywhere on the line, behind any prefix) becomes a `LogEvent` of the row's event kind,
with the row's id, category and strength in its fields. A line a region parser already made an event of is
not counted twice: that event only gains the row's id, category and strength.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hangdx.probes import catalogue
from hangdx.probes.model import Evidence, LogEvent, Quote, Source
from hangdx.probes.normalise import Line, is_host_label, nccl_origin, same_origin
from hangdx.probes.rx import lazy

_STRENGTH_ORDER = {"decisive": 0, "suggestive": 1, "context": 2}
WRAP_MIN = 30  # a line shorter than this was not cut by a wrap (terminals and chat windows wrap wider)
WRAP_MAX = 4096  # nor a line longer than this (and a pair of such lines is not copied to be tried)
WRAP_BATCH = 1024  # pairs tried at once (at most 16 MB of joined text)
SAME_STORY_LINES = 40  # how far apart the lines of one message may be (the reader's context after a fault)
MAX_SIGNALS = 20000  # events from one text past this are counted, not kept (a log that repeats one error)


@dataclass
class Hit:
    line: Line
    text: str  # the line as the row matched it (rejoined when it had been wrapped)
    row: catalogue.Row
    fields: dict[str, Any]
    details: dict[str, Any] | None = None  # what the lines under the message added (the row's `details`)


def current(ev: Evidence) -> catalogue.Catalogue | None:
    """The shipped catalogue; a broken one is a gap (once per evidence), never a crash of the reading."""
    try:
        return catalogue.load()
    except catalogue.CatalogueError as e:
        msg = f"the signal catalogue did not load, only the region parsers read: {e}"[:600]
        if not any(g.message == msg for g in ev.gaps):
            ev.gap("catalogue", msg)
        return None


def _best(found: list[tuple[catalogue.Row, dict[str, Any]]]) -> tuple[catalogue.Row, dict[str, Any]]:
    """Of the rows one line matches, the one that says most: the strongest, then the most specific pattern (the
    most fixed text: a message row before a row for the prefix the same line carries), then the longest."""
    return min(
        found,
        key=lambda rf: (_STRENGTH_ORDER[rf[0].strength], -_fixed_chars(rf[0].pattern), -len(rf[0].pattern)),
    )


@functools.lru_cache(maxsize=4096)
def _fixed_chars(pattern: str) -> int:
    """How many characters every match of the pattern spells out literally (group names and classes excluded;
    of alternatives the shortest; repeats by their minimum)."""
    try:
        import re._parser as sre_parse  # Python 3.11+
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_parse  # type: ignore[no-redef]
    from re import _constants as c  # type: ignore[attr-defined]

    def fixed(seq) -> int:
        n = 0
        for op, av in seq:
            if op is c.LITERAL:
                n += 1
            elif op is c.SUBPATTERN:
                n += fixed(av[-1])
            elif op is c.BRANCH:
                n += min(fixed(b) for b in av[1])
            elif op in (c.MAX_REPEAT, c.MIN_REPEAT) and av[0]:
                n += av[0] * fixed(av[2])
        return n

    try:
        return fixed(sre_parse.parse(pattern))
    except Exception:  # pragma: no cover - rows are checked on load; a bad one ranks by its length
        return 0


def find(cat: catalogue.Catalogue, lines: list[Line]) -> list[Hit]:
    """Every line a row matches; a message wrapped over two lines is matched rejoined (and counted once)."""
    texts = [ln.text for ln in lines]
    per_line: dict[int, list[tuple[catalogue.Row, dict[str, Any]]]] = {}
    for n, row, fields in cat.match_lines(texts):
        per_line.setdefault(n, []).append((row, fields))
    rejoined: dict[int, str] = {}
    # A line the normaliser rejoined with a space (a chat wrap) may have been cut inside a word (a terminal):
    # its pieces put back together without one.
    tight = [n for n, ln in enumerate(lines) if ln.parts and n not in per_line]
    if tight:
        for k, row, fields in cat.match_lines(["".join(lines[n].parts) for n in tight]):
            n = tight[k]
            per_line.setdefault(n, []).append((row, fields))
            rejoined[n] = "".join(lines[n].parts)
    # Two neighbours from one source, neither matching alone: a wrap cut one message in two.
    pairs = [
        n
        for n in range(len(lines) - 1)
        if n not in per_line
        and n + 1 not in per_line
        and WRAP_MIN <= len(texts[n]) <= WRAP_MAX
        and len(texts[n + 1]) <= WRAP_MAX
        and texts[n + 1].strip()
        and (lines[n].host, lines[n].pid, lines[n].label)
        == (lines[n + 1].host, lines[n + 1].pid, lines[n + 1].label)
    ]
    taken: set[int] = set()
    for b in range(0, len(pairs), WRAP_BATCH):  # in batches: the joined copies stay small whatever the input
        batch = pairs[b : b + WRAP_BATCH]
        joined = [j for n in batch for j in (texts[n] + texts[n + 1], texts[n] + " " + texts[n + 1].lstrip())]
        for k, row, fields in cat.match_lines(joined):  # in order of k
            n = batch[k // 2]
            if n - 1 in taken or (n in taken and rejoined[n] != joined[k]):
                continue  # line n went with the line before it; or this pair already matched joined the other way
            taken.add(n)
            per_line.setdefault(n, []).append((row, fields))
            rejoined[n] = joined[k]
    for n in taken:
        per_line.pop(n + 1, None)
    out = []
    for n in sorted(per_line):
        row, fields = _best(per_line[n])
        details = _details(row, lines, n, per_line) if row.details else None
        if details:
            fields = {**details, **fields}
        out.append(Hit(lines[n], rejoined.get(n, texts[n]), row, fields, details))
    return out


def _details(row: catalogue.Row, lines: list[Line], n: int, per_line: dict) -> dict[str, Any]:
    """What the lines the emitter prints under line n's message add (the row's `details`): lines of the same
    process, or of none named, up to the next message a row reads."""
    out: dict[str, Any] = {}
    for k in range(n + 1, min(len(lines), n + 1 + catalogue.DETAIL_LINES)):
        if k in per_line:
            break
        if not same_origin(lines[n], lines[k]):
            continue
        for key, value in row.detail(lines[k].text).items():
            out.setdefault(key, value)
    return out


def apply(hits: list[Hit], src: Source, ev: Evidence, events_before: int, colls_before: int) -> int:
    """Hits to events, after the region parsers ran: the lines they read gain the row's marks, the others
    become events of the row's kind. Returns how many lines the catalogue read."""
    read_by_parsers: dict[int, list[LogEvent]] = {}
    by_kind: dict[str, list[LogEvent]] = {}
    for e in ev.events[events_before:]:
        if e.quote.source == src.name:
            read_by_parsers.setdefault(e.quote.line, []).append(e)
            by_kind.setdefault(e.kind, []).append(e)
    coll_lines = {
        c.quote.line for c in ev.collectives[colls_before:] if c.quote and c.quote.source == src.name
    }
    added = 0
    for h in hits:
        marks = {
            "signal_row": h.row.id,
            "signal_category": h.row.category,
            "signal_strength": h.row.strength,
        }
        same = _same_message(h, read_by_parsers.get(h.line.no, ())) or _same_story(
            h, by_kind.get(h.row.event, ())
        )
        if same:
            for e in same:
                # The row's kind too: the parser may have read the line as something wider (an `exception`).
                # One message told over several lines keeps what its strongest line says (a wrapped NCCL error:
                # "NCCL error in: ..." says nothing, "ncclUnhandledCudaError: ..." points at the GPU).
                before = e.fields.get("signal_strength")
                stronger = (
                    before in _STRENGTH_ORDER and _STRENGTH_ORDER[h.row.strength] < _STRENGTH_ORDER[before]
                )
                for k, v in {**marks, "signal_event": h.row.event}.items():
                    if stronger:
                        e.fields[k] = v
                    else:
                        e.fields.setdefault(k, v)
                for k, v in (h.details or {}).items():
                    e.fields.setdefault(k, v)  # the parser read the message's line, not the lines under it
            added += 1
            continue
        if h.line.no in coll_lines:
            continue
        if added >= MAX_SIGNALS:
            continue
        ev.events.append(_event(h, src, marks))
        ev.note_host(ev.events[-1].host)
        added += 1
    return added


def _same_message(h: Hit, events: Iterable[LogEvent]) -> list[LogEvent]:
    """Parser events of the hit's own line that tell its message (a line may hold two: a bar, then an error)."""
    core = h.text.strip()[:200]
    return [
        e for e in events if e.kind == h.row.event or core in e.quote.text or e.quote.text.strip() in h.text
    ]


def _same_story(h: Hit, events: Iterable[LogEvent]) -> list[LogEvent]:
    """A parser event of the row's kind a few lines away, for the same process: one message told over several
    lines (the kernel's `oom-kill:` and `Killed process` lines, a watchdog report and its `what():` repeat)."""
    out = []
    pid = h.fields.get("pid")
    for e in events:
        if abs(e.quote.line - h.line.no) > SAME_STORY_LINES:
            continue
        if h.line.rank is not None and e.rank is not None and h.line.rank != e.rank:
            continue
        if isinstance(pid, int) and e.pid is not None and e.pid != pid:
            continue
        out.append(e)
    return out


# A syslog or journal line's header names the host that logged it (`Aug 26 15:28:16 node7 kernel: ...`,
# `2024-08-26T15:28:16+00:00 node7 systemd[1]: ...`), as the kernel-log parser reads it.
_SYSLOG_HOST = lazy(
    r"^(?:(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) [ \d]\d \d\d:\d\d:\d\d"
    r"|\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d{1,9})?(?:Z|[+-]\d\d:?\d\d)?)"
    r"\s{1,4}([A-Za-z0-9][\w.\-]{0,62})\s{1,4}(?:kernel|[\w./\-]{1,64}\[\d{1,10}\]):"
)


def _syslog_host(text: str) -> str | None:
    m = _SYSLOG_HOST.match(text[:200]) if text[:1].isalnum() else None
    return m.group(1) if m and is_host_label(m.group(1)) else None


def _event(h: Hit, src: Source, marks: dict[str, Any]) -> LogEvent:
    ln, fields = h.line, dict(h.fields)
    origin = nccl_origin(h.text)
    # Who printed the line: the launcher's prefix first, then NCCL's own `host:pid:tid [dev]`, then the file.
    rank = ln.rank if ln.rank is not None else src.rank
    if rank is None and isinstance(fields.get("rank"), int) and h.row.event not in _RANK_NAMES_OTHERS:
        rank = fields["rank"]
    host = ln.host or (origin.host if origin else None) or src.host or _syslog_host(h.text)
    own = fields.get("own_host")  # the printer's host in the line itself (Open MPI's `[host:pid]`)
    if host is None and isinstance(own, str) and not own.isupper():  # `HOST`: a placeholder the poster typed
        host = own
    pid = ln.pid or (origin.pid if origin else None) or src.pid
    if pid is None and isinstance(fields.get("pid"), int):
        pid = fields["pid"]
    if origin is not None:
        fields.setdefault("device", origin.device)
    fields.update(marks)
    fields["signal_only"] = True  # no region parser read this line: the catalogue alone did
    if ln.text != h.text:
        fields["rejoined"] = True
    quote = Quote(src.name, ln.no, (ln.torchrun + h.text)[:2000])
    kind = h.row.event
    for key, value in DERIVED.get(kind, lambda _text: {})(h.text).items():
        fields.setdefault(key, value)
    if not NEEDS.get(kind, frozenset()) <= fields.keys():
        kind, fields["signal_event"] = SIGNAL_KIND, kind
    return LogEvent(kind=kind, quote=quote, host=host, rank=rank, pid=pid, fields=fields)


# Kinds whose playbooks read fields by name, without a fallback: a catalogue line of such a kind that lacks them
# is kept as a plain `signal` event (its kind in fields["signal_event"]), read by the signals playbook only.
NEEDS: dict[str, frozenset[str]] = {
    "step_counter": frozenset({"n", "first"}),
    "progress": frozenset({"n", "first"}),
    "nccl_tests_run": frozenset({"metrics"}),
    "node_set_result": frozenset({"hosts", "value", "higher_is_better"}),
    "rank_timing": frozenset({"metrics"}),
    "pp_actions": frozenset({"actions"}),
    "p2p_matrix": frozenset({"header_quote"}),
    "step_data_time": frozenset({"step_s", "data_s"}),
}
SIGNAL_KIND = "signal"


def _checkpoint(text: str) -> dict[str, Any]:
    from hangdx.probes.app_log import checkpoint_reading

    return checkpoint_reading(text)


# Fields a kind's playbooks read that its region parser derives from the line rather than a row's pattern: a row of
# that kind gets them the same way (a checkpoint row's save, whether it is over, its time: stopped_at_save's).
DERIVED = {"checkpoint_io": _checkpoint}

# Kinds whose `rank` field names another rank than the one printing (the barrier's absentees): not the speaker.
_RANK_NAMES_OTHERS = frozenset({"monitored_barrier_timeout", "monitored_barrier_failed", "desync_report"})
