"""Playbooks over measurements people paste: benchmark runs per node set, timings per rank, pipeline schedules.

Node sets (nccl-tests runs, or a table of results per set of nodes): the sets that run slow against the others,
and the host each slow set has that no normal set clears. Wrong values in an nccl-tests run: data corruption.
Timings per rank: ranks whose data loading takes the step while the others wait; collective times that differ
several-fold (a collective's time is mostly waiting, so the rank that spent the least arrived last). Pipeline
action lists: ranks whose pending sends and receives wait on each other.
Each playbook's words live in templates/<name>.j2.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterator

from hangdx.playbooks.engine import Match, playbook
from hangdx.playbooks.facts import Facts
from hangdx.playbooks.verdict import Culprit
from hangdx.probes.model import LogEvent, Quote

SLOW_FRACTION = 0.75  # a set below 3/4 of the best set's bandwidth is slow


# -- node sets ---------------------------------------------------------------------------------------------


def _results(facts: Facts) -> list[list[tuple[frozenset[str], float, bool, Quote]]]:
    """Comparable results per node set: one list per kind of measurement (a table, runs of one shape)."""
    out: list[list[tuple[frozenset[str], float, bool, Quote]]] = []
    table = [
        (frozenset(e.fields["hosts"]), float(e.fields["value"]), bool(e.fields["higher_is_better"]), e.quote)
        for e in facts.ev.events_of("node_set_result")
    ]
    if table:
        out.append(table)
    shapes: dict[tuple, list] = defaultdict(list)
    for e in facts.ev.events_of("nccl_tests_run"):
        bw = e.fields.get("avg_busbw") or e.fields.get("peak_busbw")
        hosts = e.fields.get("hosts") or []
        if bw and hosts:
            shapes[(len(hosts), len(e.fields.get("ranks") or {}))].append(
                (frozenset(hosts), float(bw), True, e.quote)
            )
    out.extend(shapes.values())
    return out


def _locate(bad: list[frozenset[str]], good: list[frozenset[str]]) -> tuple[dict[str, list[int]], list[int]]:
    """Which host each bad set has that no good set clears: {host: indexes of the bad sets it explains}, and the
    bad sets nothing locates (two or more uncleared hosts)."""
    cleared = set().union(*good) if good else set()
    explained: dict[str, list[int]] = defaultdict(list)
    unlocated: list[int] = []
    for i, s in enumerate(bad):
        suspects = s - cleared
        if len(suspects) == 1:
            explained[next(iter(suspects))].append(i)
        else:
            unlocated.append(i)
    # A host common to several bad sets and in no good one is their common member, even when nothing clears
    # its partners.
    common: dict[str, list[int]] = defaultdict(list)
    for i in unlocated:
        for h in bad[i] - cleared:
            common[h].append(i)
    for h, idx in common.items():
        if len(idx) >= 2 and h not in explained:
            explained[h] = idx
    located = {i for idx in explained.values() for i in idx}
    return dict(explained), [i for i in unlocated if i not in located]


def _fmt(v: float) -> str:
    return f"{v:g}"


@playbook("node_set_straggler", order=88)
def node_set_straggler(facts: Facts) -> Iterator[Match]:
    """Benchmarks per node set: is one node common to the slow sets, while its partners run fast elsewhere?"""
    for results in _results(facts):
        if len(results) < 3:
            continue
        higher = results[0][2]
        vals = [v for _, v, _, _ in results]
        best = max(vals) if higher else min(vals)
        if best <= 0:
            continue

        def slow(v: float, best: float = best, higher: bool = higher) -> bool:
            return v < best * SLOW_FRACTION if higher else v * SLOW_FRACTION > best

        bad = [r for r in results if slow(r[1])]
        good = [r for r in results if not slow(r[1])]
        if not bad or not good:
            continue
        explained, unlocated = _locate([r[0] for r in bad], [r[0] for r in good])
        if not explained:
            continue
        hosts = sorted(explained, key=lambda h: (-len(explained[h]), h))
        strongest = max(len(v) for v in explained.values())
        evidence = [bad[i][3] for h in hosts for i in explained[h]]
        partners = {h: sorted({p for i in explained[h] for p in bad[i][0] - {h}}) for h in hosts}
        cleared_by = [r[3] for r in good if any(p in r[0] for ps in partners.values() for p in ps)]
        evidence += cleared_by[:4]
        yield Match(
            "straggler",
            0.74 if strongest >= 2 else 0.6,
            Culprit(hosts=hosts),
            evidence,
            {
                "hosts": hosts,
                "sets": {
                    h: [(", ".join(sorted(bad[i][0])), _fmt(bad[i][1])) for i in explained[h]] for h in hosts
                },
                "partners": partners,
                "normal": (_fmt(min(r[1] for r in good)), _fmt(max(r[1] for r in good))),
                "unlocated": [(", ".join(sorted(bad[i][0])), _fmt(bad[i][1])) for i in unlocated],
                "higher": higher,
            },
            status="progressing",
        )


@playbook("data_corruption", order=72)
def data_corruption(facts: Facts) -> Iterator[Match]:
    """nccl-tests: did a run find wrong values (#wrong > 0)? Data corrupted on a GPU or on the way between nodes."""
    runs = facts.ev.events_of("nccl_tests_run")
    wrong = [e for e in runs if e.fields.get("wrong")]
    if not wrong:
        return
    clean = [e for e in runs if not e.fields.get("wrong") and e.fields.get("hosts")]
    bad_sets = [frozenset(e.fields.get("hosts") or []) for e in wrong]
    explained, _ = _locate([s for s in bad_sets if s], [frozenset(e.fields["hosts"]) for e in clean])
    hosts = sorted(explained) or sorted(set().union(*bad_sets))
    one_node = all(len(s) <= 1 for s in bad_sets)
    gpus: list[str] = []
    for e in wrong:  # a run on one GPU pair or fewer names them; a run on a whole node does not say which
        ranks = list((e.fields.get("ranks") or {}).values())
        if one_node and 0 < len(ranks) <= 2:
            gpus += [f"{r['host']}:{r.get('bus_id') or 'device ' + str(r['device'])}" for r in ranks]
    evidence = [q for e in wrong for q in e.fields.get("wrong_quotes") or []] + [e.quote for e in wrong]
    evidence += [q for e in wrong if (q := e.fields.get("rank_quote"))]
    yield Match(
        "gpu_fault" if one_node else "network_fault",
        0.72 if (explained and clean) or one_node else 0.6,
        Culprit(hosts=hosts, gpus=list(dict.fromkeys(gpus))),
        evidence,
        {
            "hosts": hosts,
            "one_node": one_node,
            "wrong": sum(int(e.fields["wrong"]) for e in wrong),
            "runs": len(wrong),
            "clean": len(clean),
            "located": bool(explained) and bool(clean),
        },
        status="failed",
    )


# -- timings per rank --------------------------------------------------------------------------------------


def _by_group(events: list[LogEvent]) -> dict[str, dict[int, LogEvent]]:
    groups: dict[str, dict[int, LogEvent]] = defaultdict(dict)
    for e in events:
        if e.rank is not None:
            groups[str(e.fields.get("group"))][e.rank] = e  # a rank's last line of the group
    return groups


def _pick(metrics: list[str], words: tuple[str, ...]) -> str | None:
    return next((m for m in metrics if any(w in m for w in words)), None)


@playbook("rank_timing", order=89)
def rank_timing(facts: Facts) -> Iterator[Match]:
    """Timings per rank: does a few ranks' data loading fill the step, or does a collective's time differ several-fold?"""
    for per_rank in _by_group(facts.ev.events_of("rank_timing")).values():
        if len(per_rank) < 2:
            continue
        names = [
            k
            for k in next(iter(per_rank.values())).fields["metrics"]
            if all(k in e.fields["metrics"] for e in per_rank.values())
        ]
        data = _pick(names, ("data",))
        step = _pick([n for n in names if n != data], ("step", "iter", "total")) or (
            "time" if "time" in names and data != "time" else None
        )
        if data and step:
            yield from _data_bound(per_rank, data, step)
            continue
        metric = _pick(names, ("time", "cost", "elapsed", "took", "duration", "latency"))
        if metric:
            yield from _spread(per_rank, metric)


def _data_bound(per_rank: dict[int, LogEvent], data: str, step: str) -> Iterator[Match]:
    d = {r: float(e.fields["metrics"][data]) for r, e in per_rank.items()}
    s = {r: float(e.fields["metrics"][step]) for r, e in per_rank.items()}
    inclusive = all(s[r] >= d[r] for r in d)  # the step time counts the data time in it
    total = s if inclusive else {r: d[r] + s[r] for r in d}
    step_len = statistics.median(total.values())
    if step_len <= 0:
        return
    # The slow ranks load data for a good part of the step; the others load in no time and wait for them.
    slow = sorted(r for r in d if d[r] >= 0.25 * step_len)
    quick = [r for r in d if d[r] <= 0.05 * step_len]
    if not slow or not quick or len(slow) * 2 > len(d):
        return
    waiting = sorted((r for r in d if r not in slow), key=lambda r: d[r])
    evidence = [per_rank[r].quote for r in sorted(slow, key=lambda r: -d[r])] + [
        per_rank[r].quote for r in waiting[:2]
    ]
    ctx = (per_rank[slow[0]].fields.get("context") or "").rstrip(":")
    yield Match(
        "straggler",
        0.66,
        Culprit(ranks=slow),
        evidence,
        {
            "ranks": slow,
            "data": data,
            "step": step,
            "data_times": {r: _fmt(d[r]) for r in slow},
            "step_len": _fmt(round(step_len, 3)),
            "others": [r for r in waiting],
            "others_data": _fmt(round(max(d[r] for r in waiting), 3)) if waiting else "0",
            "context": ctx,
        },
        status="progressing",
        template="rank_timing_data",
    )


def _spread(per_rank: dict[int, LogEvent], metric: str) -> Iterator[Match]:
    v = {r: float(e.fields["metrics"][metric]) for r, e in per_rank.items()}
    lo, hi = min(v.values()), max(v.values())
    if lo <= 0 or hi < 3 * lo:
        return
    collective = any(e.fields.get("collective") for e in per_rank.values())
    order = sorted(v, key=lambda r: v[r])
    if collective:
        # Every rank leaves a collective together; the time it measured is mostly waiting for the last to arrive.
        late = [r for r in order if v[r] <= 1.5 * lo]
        early = [r for r in order if v[r] >= hi / 1.5]
        culprit = late if len(late) == 1 else []
        conf = 0.58
    else:
        med = statistics.median(v.values())
        late = [r for r in reversed(order) if v[r] >= 2 * med]
        early = [r for r in order if v[r] <= med]
        if not late or len(late) * 2 > len(v):
            return
        culprit = sorted(late)
        conf = 0.6
    evidence = [per_rank[r].quote for r in order]
    yield Match(
        "straggler",
        conf,
        Culprit(ranks=culprit),
        evidence,
        {
            "collective": collective,
            "metric": metric.replace("_", " "),
            "values": {r: _fmt(round(v[r], 3)) for r in order},
            "late": late,
            "early": early,
            "named": culprit,
            "ratio": _fmt(round(hi / lo, 1)),
        },
        status="progressing",
        template="rank_timing_spread",
    )


# -- pipeline schedules -----------------------------------------------------------------------------------

_P2P = {"SEND_F": ("send", "F"), "RECV_F": ("recv", "F"), "SEND_B": ("send", "B"), "RECV_B": ("recv", "B")}


def _pending(actions: list[tuple]) -> list[tuple]:
    """The point-to-point actions a list ends with (after its last one, only computation may follow)."""
    i = len(actions)
    while i > 0 and actions[i - 1][1] not in _P2P:
        i -= 1
    j = i
    while j > 0 and actions[j - 1][1] in _P2P:
        j -= 1
    return actions[j:i]


@playbook("pipeline_schedule", order=46)
def pipeline_schedule(facts: Facts) -> Iterator[Match]:
    """Pipeline action lists: do two ranks' pending sends and receives wait on each other?"""
    lists = {e.rank: e for e in facts.ev.events_of("pp_actions") if e.rank is not None}
    if len(lists) < 2:
        return
    stage_rank: dict[int, int] = {}
    for r, e in lists.items():
        for stage, *_ in e.fields["actions"]:
            stage_rank.setdefault(stage, r)
    ops: dict[int, list[tuple[str, tuple, int, str]]] = {}  # rank -> (send|recv, message, peer rank, action)
    for r, e in lists.items():
        out = []
        for stage, kind, mb, printed in _pending(e.fields["actions"]):
            way, d = _P2P[kind]
            step = 1 if d == "F" else -1
            src, dst = (stage, stage + step) if way == "send" else (stage - step, stage)
            peer = stage_rank.get(dst if way == "send" else src)
            if peer is None or peer == r:
                continue
            out.append((way, (d, src, dst, mb), peer, printed))
        ops[r] = out
    seen: set[frozenset] = set()
    for a in sorted(ops):
        for b in sorted(ops):
            if a >= b or frozenset((a, b)) in seen:
                continue
            stuck = _stuck(ops[a], ops[b], a, b)
            if stuck is None:
                continue
            seen.add(frozenset((a, b)))
            (way_a, act_a), (way_b, act_b), then_a, then_b = stuck
            both = way_a if way_a == way_b else "crossed"
            yield Match(
                "p2p_deadlock",
                0.75 if both == "recv" else 0.66,
                Culprit(ranks=[a, b]),
                [lists[a].quote, lists[b].quote],
                {
                    "ranks": [a, b],
                    "both": both,
                    "waits": {a: (way_a, act_a, then_a), b: (way_b, act_b, then_b)},
                },
                status="hung",
            )


def _stuck(a_ops: list, b_ops: list, a: int, b: int) -> tuple | None:
    """Run two ranks' pending operations with each other as blocking calls; where they stop, if they stop."""
    mine = [o for o in a_ops if o[2] == b]
    theirs = [o for o in b_ops if o[2] == a]
    # Operations whose counterpart is not in the other list matched before the lists begin (or after they end).
    keys_b = {(o[0], o[1]) for o in theirs}
    keys_a = {(o[0], o[1]) for o in mine}
    mine = [o for o in mine if ("recv" if o[0] == "send" else "send", o[1]) in keys_b]
    theirs = [o for o in theirs if ("recv" if o[0] == "send" else "send", o[1]) in keys_a]
    i = j = 0
    while i < len(mine) and j < len(theirs):
        x, y = mine[i], theirs[j]
        if x[0] != y[0] and x[1] == y[1]:
            i, j = i + 1, j + 1
            continue
        then_a = mine[i + 1][3] if i + 1 < len(mine) else None
        then_b = theirs[j + 1][3] if j + 1 < len(theirs) else None
        return (x[0], x[3]), (y[0], y[3]), then_a, then_b
    return None


# -- a trainer's own step timing: the step spent waiting for its batch ------------------------------------------

DATA_BOUND = 0.5  # the batch wait is more than half of every step: the input pipeline sets the pace
_MIN_STEP_S = 1.0  # steps shorter than this are not what a report of a stall is about


@playbook("data_bound_steps", order=90)
def data_bound_steps(facts: Facts) -> Iterator[Match]:
    """A trainer's timing lines (`time: 40.19  data: 38.06`): do its steps spend most of their time waiting for data?"""
    last: dict[tuple[str, int | None, str | None], LogEvent] = {}
    for e in facts.ev.events_of("step_data_time"):
        last[(e.quote.source, e.rank, e.host)] = e  # each process's last print: where it is now
    bound = []
    for e in last.values():
        try:
            step, data = float(e.fields["step_s"]), float(e.fields["data_s"])
        except (TypeError, ValueError):
            continue
        if step >= _MIN_STEP_S and DATA_BOUND * step <= data <= step * 1.05:
            bound.append((e, step, data))
    if not bound or len(bound) * 2 < len(last):
        return  # most processes compute: not the input pipeline
    e, step, data = max(bound, key=lambda b: b[2] / b[1])
    ranks = sorted({b[0].rank for b in bound if b[0].rank is not None})
    yield Match(
        "dataloader_stall",
        0.6,
        Culprit(ranks=ranks, hosts=sorted({b[0].host for b in bound if b[0].host})),
        [b[0].quote for b in bound[:3]],
        {
            "step": _fmt(step),
            "data": _fmt(data),
            "share": round(100 * data / step),
            "ranks": ranks,
            "processes": len(bound),
            "seen": len(last),
        },
        status="progressing",
    )
