"""What the job was doing when it stopped, from the order and times of its own log lines.

- An object-storage transfer stalled (libcurl's `Operation too slow`, `Timeout was reached`), around a checkpoint
  save: the job is stuck in checkpoint I/O.
- The last thing logged is `Saving ... checkpoint`, and the collective that timed out started at that very moment
  (its timeout time less the time it ran): the job stopped at the save.
- Training had finished, and a rank then timed out alone in a collective: it issued one the others never will.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import datetime, timedelta

from hangdx.playbooks.engine import Match, playbook
from hangdx.playbooks.facts import Facts
from hangdx.playbooks.verdict import Culprit
from hangdx.probes.app_log import line_time
from hangdx.probes.model import LogEvent

_TIMEOUTS = ("watchdog_timeout", "gloo_timeout")


@playbook("storage_stall", order=58)
def storage_stall(facts: Facts) -> Iterator[Match]:
    """Did an object-storage transfer stall (curl below its low-speed limit, timed out), around a checkpoint?"""
    stalls = facts.ev.events_of("storage_stall")
    if not stalls:
        return
    saves = [e for e in facts.ev.events_of("checkpoint_io") if e.fields.get("saving")]
    ranks = sorted({e.rank for e in stalls if e.rank is not None})
    hosts = sorted({e.host for e in stalls if e.host})
    yield Match(
        "io_stall",
        0.78 if saves else 0.6,
        Culprit(ranks=ranks, hosts=hosts),
        [e.quote for e in stalls[:3]] + [e.quote for e in saves[-2:]],
        {
            "errors": list(dict.fromkeys(str(e.fields.get("error")) for e in stalls)),
            "target": next((e.fields["target"] for e in reversed(saves) if e.fields.get("target")), None),
            "saving": bool(saves),
            "tensorstore": any(
                str(e.fields.get("where") or "").endswith("curl_transport.cc") for e in stalls
            ),
            "threads": sorted({e.fields["thread"] for e in stalls if e.fields.get("thread")}),
            "ranks": ranks,
        },
        status="hung",
    )


# c10's header `[E218 10:48:25.033625188 ProcessGroupNCCL.cpp:632]`: month (not zero-padded), day and time.
_C10_TIME = re.compile(r"\[?[EWIF](\d{1,2})(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))? ")
# How close the collective's start must be to the save line to say the job stopped there.
_SAME_MOMENT = timedelta(seconds=10)


def _event_time(e: LogEvent, year: int) -> datetime | None:
    t = line_time(e.quote.text)
    if t is not None:
        return t
    m = _C10_TIME.search(e.quote.text[:200])
    if not m:
        return None
    try:
        frac = (m.group(6) or "0")[:6].ljust(6, "0")
        return datetime(year, *(int(m.group(i)) for i in range(1, 6)), int(frac))
    except ValueError:
        return None


@playbook("stopped_at_save", order=63)
def stopped_at_save(facts: Facts) -> Iterator[Match]:
    """Logs: is `Saving ... checkpoint` the last word, with the timed-out collective started at that moment?"""
    if facts.have_stacks:
        return
    timeouts = [e for e in facts.ev.events_of(*_TIMEOUTS) if e.fields.get("ran_ms")]
    saves = [
        e for e in facts.ev.events_of("checkpoint_io") if e.fields.get("saving") and e.fields.get("time")
    ]
    if not timeouts or not saves:
        return
    for t in timeouts:
        before = [
            e
            for e in facts.ev.events
            if e.quote.source == t.quote.source and e.quote.line < t.quote.line and e.kind not in _TIMEOUTS
        ]
        if not before or before[-1] not in saves or before[-1].fields.get("done"):
            continue  # the save finished, or something was logged after it: the job went on past it
        save = before[-1]
        save_time = datetime.fromisoformat(save.fields["time"])
        end = _event_time(t, save_time.year)
        if end is None:
            continue
        started = end - timedelta(milliseconds=t.fields["ran_ms"])
        if abs(started - save_time) > _SAME_MOMENT:
            continue
        yield Match(
            "io_stall",
            0.5,
            Culprit(ranks=[save.rank] if save.rank is not None else []),
            [save.quote, t.quote],
            {
                "save": save.quote.text[:200],
                "saver": save.rank,
                "waiter": t.rank,
                "op": t.fields.get("op"),
                "timeout_s": round(t.fields["ran_ms"] / 1000),
                "gap_s": round(abs((started - save_time).total_seconds()), 1),
            },
            status="hung",
        )
        return


@playbook("after_finish", order=64)
def after_finish(facts: Facts) -> Iterator[Match]:
    """Logs: training had finished; does one rank then time out alone in a collective nobody else issues?"""
    if facts.have_stacks:
        return
    for done in facts.ev.events_of("training_finished"):
        later = [
            e
            for e in facts.ev.events_of(*_TIMEOUTS)
            if e.quote.source == done.quote.source and e.quote.line > done.quote.line and e.rank is not None
        ]
        earlier = [
            e
            for e in facts.ev.events_of(*_TIMEOUTS)
            if e.quote.source == done.quote.source and e.quote.line < done.quote.line
        ]
        ranks = sorted({e.rank for e in later if e.rank is not None})
        ws = facts.world_size
        if not ranks or earlier or (len(ranks) > 1 and (ws is None or 2 * len(ranks) >= ws)):
            continue
        first = later[0]
        yield Match(
            "conditional_collective",
            0.62,
            Culprit(ranks=ranks, hosts=sorted({e.host for e in later if e.host})),
            [done.quote] + [e.quote for e in later[:3]],
            {
                "ranks": ranks,
                "op": first.fields.get("op") or "a collective",
                "numel": first.fields.get("numel_in"),
                "finished": done.quote.text[:160],
            },
            status="hung",
        )
        return
