"""NCCL RAS (`ncclras`, probes/ncclras.py): the dead, unreachable or lagging rank, with its host, pid and GPU.

RAS sees every rank of the job in one query, with nothing installed in the job:
- a process RAS declared dead (unreachable for 60 s) is a crashed rank: its peers wait for it (rank_crashed);
- a process RAS could not reach at all (stopped, frozen, its node gone) is the same fault caught earlier;
- a rank whose communicator reports an asynchronous or initialization error: a CUDA error is its GPU's fault,
  a system or remote error the network's (unless a peer is dead or unreachable: then that peer is the cause);
- in one communicator, ranks whose count of a collective type differs from the crowd: the ranks RAS singles out
  have not launched the collective the others wait in (or launched one the others never will). NVIDIA's guide
  says a difference that persists across queries is a stuck communicator, one that moves is normal: two reports
  with the same counts make the finding sure, counts that moved drop it. This is the flowchart's "a rank never
  issued the collective the others reached" (conditional_collective), as playbooks/flowchart.py's
  sequence_divergence concludes from Flight Recorder; a live stack of that rank, when there is
  one, says more about what it does instead, so this finding then stands back.
Ranks of the job's largest communicator are taken as global ranks; a smaller communicator's are named as its own.
The words live in templates/ncclras.j2.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from hangdx.playbooks.engine import Match, playbook
from hangdx.playbooks.facts import Facts, Location
from hangdx.playbooks.verdict import Culprit
from hangdx.probes.model import LogEvent, Quote


def _global(rep: LogEvent, comm: dict, facts: Facts) -> bool:
    """Are this communicator's ranks the job's global ranks? (its size is the world's, or the largest seen)"""
    size = comm.get("size")
    if size is None:
        return len(rep.fields["comms"]) == 1
    if facts.world_size:
        return size == facts.world_size
    return size == max((c.get("size") or 0) for c in rep.fields["comms"])


def _host(facts: Facts, ranks: list[int], addr: str | None, glob: bool = True) -> str | None:
    """The name hangdx knows the rank's host by (its probes, its logs), else the address RAS gives."""
    names = {h for r in ranks if (h := facts.host_of(r))} if glob else set()
    return next(iter(names)) if len(names) == 1 else addr


def _culprit(facts: Facts, members: dict, ranks: list[int], glob: bool) -> Culprit:
    """The ranks RAS names, with the host, GPU and (when the ranks are not global) process of each."""
    return Culprit(
        ranks=ranks if glob else [],
        hosts=sorted({h for r, i in members.items() if (h := _host(facts, [r], i.get("host"), glob))}),
        gpus=[
            _gpu(_host(facts, [r], i.get("host"), glob), i["gpu"]) for r, i in members.items() if i.get("gpu")
        ],
        processes=[] if glob else [f"{i['host']} pid {i['pid']}" for i in members.values() if i.get("pid")],
    )


def _gpu(host: str | None, gpu: str | None) -> str:
    return f"{host}:GPU {gpu}" if host else f"GPU {gpu}"


def _procs(rep: LogEvent, facts: Facts, kind: str) -> list[dict]:
    """Dead (or unreachable) processes, each with the ranks the report names for it."""
    listed = rep.fields["dead" if kind == "dead" else "unreachable"]
    out: list[dict] = []
    for p in listed:
        out.append({**p, "ranks": [], "comm_ranks": [], "rank_quotes": [], "inferred": False, "comm": None})
    for comm in rep.fields["comms"]:
        for r, info in sorted(comm["missing"].items()):
            if not info.get(kind):
                continue
            key = (info.get("host"), info.get("pid"))
            proc = next((p for p in out if (p["host"], p["pid"]) == key), None)
            if proc is None:
                proc = {"pid": info.get("pid"), "host": info.get("host"), "gpus": info.get("gpu"), "quote": None,
                        "ranks": [], "comm_ranks": [], "rank_quotes": [], "inferred": False, "comm": None}  # fmt: skip
                out.append(proc)
            if _global(rep, comm, facts):
                proc["ranks"].append(r)
            else:
                proc["comm_ranks"].append((r, comm["hash"], comm.get("size")))
            proc["rank_quotes"] += [info["quote"], *info.get("quotes", [])]
            proc["comm"] = comm
            proc["inferred"] = proc.get("inferred") or bool(info.get("inferred"))
    return out


def _lost(facts: Facts, rep: LogEvent, kind: str) -> Iterator[Match]:
    procs = _procs(rep, facts, kind)
    if not procs:
        return
    ranks = sorted({r for p in procs for r in p["ranks"]})
    evidence: list[Quote] = []
    head = rep.fields.get("dead_quote" if kind == "dead" else "unreachable_quote")
    if head:
        evidence.append(head)
    for p in procs:
        evidence += [q for q in [p.get("quote"), *p["rank_quotes"]] if q]
        comm = p.get("comm")
        if comm:
            evidence += [
                *comm.get("quotes", [])[:1],
                *([comm["missing_quote"]] if comm.get("missing_quote") else []),
            ]
    if rep.fields.get("timeout_quote") and rep.fields.get("timeouts"):
        evidence.append(rep.fields["timeout_quote"])
    hosts = sorted({h for p in procs if (h := _host(facts, p["ranks"], p.get("host")))})
    yield Match(
        "rank_crashed",
        (0.86 if kind == "dead" else 0.62) - (0.06 if any(p.get("inferred") for p in procs) else 0.0),
        Culprit(
            ranks=ranks,
            hosts=hosts,
            gpus=[
                _gpu(_host(facts, p["ranks"], p.get("host")), g)
                for p in procs
                if p.get("gpus")
                for g in str(p["gpus"]).split(",")
            ],  # fmt: skip
            processes=[] if ranks else [f"{p['host']} pid {p['pid']}" for p in procs if p.get("pid")],
        ),
        evidence,
        {
            "kind": kind,
            "procs": procs,
            "ranks": ranks,
            "version": rep.fields.get("version"),
            "count": rep.fields.get("dead_count" if kind == "dead" else "unreachable_count") or len(procs),
        },
        status="hung",
    )


def _shows(rep: LogEvent, kind: str) -> bool:
    listed = rep.fields["dead" if kind == "dead" else "unreachable"]
    return bool(listed) or any(i.get(kind) for c in rep.fields["comms"] for i in c["missing"].values())


def _merged(matches: list[Match]) -> Match:
    """The newest report's finding, quoting the text reports first (easier to read than JSON), then the rest."""
    base = matches[-1]
    text = [q for m in matches for q in m.evidence if not q.text.lstrip().startswith('"')]
    other = [q for m in matches for q in m.evidence if q.text.lstrip().startswith('"')]
    base.evidence = text + other
    return base


def _outliers(comm: dict, op: str) -> dict | None:
    """The crowd and the ranks RAS singles out, for one collective type of one communicator."""
    groups = comm["counts"][op]["groups"]
    if len(groups) < 2:
        return None
    crowd = max(groups, key=lambda g: (g["count"], g["value"]))
    odd = [g for g in groups if g is not crowd]
    ranks = sorted({r for g in odd for r in g["ranks"]})
    if not ranks and crowd["ranks"] and comm.get("size"):
        # RAS itemised the crowd, not the outliers: the outliers are the communicator's other ranks.
        ranks = sorted(set(range(comm["size"])) - set(crowd["ranks"]))
    if not ranks:
        return None
    behind = all(g["value"] < crowd["value"] for g in odd)
    return {"crowd": crowd, "odd": odd, "ranks": ranks, "behind": behind}


def _key(rep: LogEvent, comm: dict, op: str, o: dict) -> tuple:
    """What must not change between two queries of a stuck communicator: every count group."""
    return (comm.get("hash"), op, o["crowd"]["value"], tuple((g["value"], g["count"]) for g in o["odd"]))


def _lagging(facts: Facts, reports: list[LogEvent]) -> Iterator[Match]:
    """Per communicator and collective type: the newest report's outliers, checked against the earlier reports."""
    newest: dict[tuple, tuple[LogEvent, dict]] = {}
    for rep in reports:
        for comm in rep.fields["comms"]:
            for op in comm["counts"]:
                newest[(comm.get("hash"), op)] = (rep, comm)
    for (chash, op), (last, comm) in newest.items():
        o = _outliers(comm, op)
        if o is None:
            continue
        earlier = [
            (rep, c)
            for rep in reports[: reports.index(last)]
            for c in rep.fields["comms"]
            if c.get("hash") == chash and c["counts"].get(op)
        ]
        moved, same = False, 0
        for rep, c in earlier:
            prev = _outliers(c, op)
            if prev is None or _key(rep, c, op, prev) != _key(last, comm, op, o):
                moved = True
            else:
                same += 1
        if moved:
            continue  # the counts advance between queries: RAS caught collectives in flight, not a stall
        glob = _global(last, comm, facts)
        members = {r: i for g in o["odd"] for r, i in g["ranks"].items()}
        conf = (0.8 if same else 0.5) if o["behind"] else (0.6 if same else 0.4)
        if any(facts.ranks[r].stacks for r in o["ranks"] if glob and r in facts.ranks):
            conf = min(conf, 0.5)  # that rank's live stack tells what it does instead: its playbooks say more
        evidence = [*comm.get("quotes", [])[:1]]
        if comm["counts"][op].get("quote"):
            evidence.append(comm["counts"][op]["quote"])
        evidence += [o["crowd"]["quote"]] + [g["quote"] for g in o["odd"]]
        evidence += [q for i in members.values() for q in [i["quote"], *i.get("quotes", [])]]
        for _rep, c in earlier[-1:]:
            prev = _outliers(c, op)
            if prev:
                evidence += [prev["crowd"]["quote"]] + [g["quote"] for g in prev["odd"]]
        if o["behind"] and glob and same:
            yield from _where_behind(facts, o, op, comm)
        yield Match(
            "conditional_collective",
            conf,
            _culprit(facts, members, o["ranks"], glob),
            evidence,
            {
                "kind": "lagging",
                "op": op,
                "ranks": o["ranks"],
                "members": members,
                "behind": o["behind"],
                "crowd": o["crowd"],
                "odd": o["odd"],
                "comm": comm,
                "global": glob,
                "queries": 1 + same,
            },
            status="hung" if same else None,
        )


def _where_behind(facts: Facts, o: dict, op: str, comm: dict) -> Iterator[Match]:
    """The ranks RAS counts as ahead have launched collectives the ranks behind have not: NCCL collectives are
    asynchronous, so the ranks ahead wait for them on the GPU wherever their CPU is (in `.item()`, at the next
    step), and their Python stacks need not show a collective at all. When the stacks alone showed no crowd in a
    collective, take the ranks ahead as the crowd and ask the flowchart's question of the ranks behind: where are
    they? (a lock, a queue, storage, data: that is the cause, as rank_elsewhere says when the stacks show it)."""
    from hangdx.playbooks import flowchart

    if facts.crowd is not None and facts.crowd.kind in ("collective", "p2p"):
        return  # the stacks show the waiting ranks themselves: rank_elsewhere asked already
    behind = [r for r in o["ranks"] if r in facts.ranks and facts.ranks[r].locations and facts.ranks[r].alive]
    if not behind:
        return
    ahead = o["crowd"]["ranks"] or sorted(set(range(comm.get("size") or 0)) - set(o["ranks"]))
    crowd = Location("collective", op=op, detail="launched on the GPU, as NCCL RAS counts")
    records = dataclasses.replace(facts, crowd=crowd, crowd_ranks=sorted(ahead), odd_ranks=behind)
    for m in flowchart.rank_elsewhere(records):
        if m.category != "conditional_collective":  # what RAS itself says, below
            m.evidence += [o["crowd"]["quote"]] + [g["quote"] for g in o["odd"]]
            yield m


# What an error a rank reports to RAS says (ncclResult_t as ncclErrorToString words it). Timeouts and the other
# results (internal error, invalid argument or usage) name no fault of the GPU or the fabric: no finding.
_ERROR_CATEGORY = {
    "Unhandled CUDA error": ("gpu_fault", 0.6),
    "System error": ("network_fault", 0.45),
    "Remote process error": ("network_fault", 0.45),
}


def _errors(facts: Facts, reports: list[LogEvent], lost: bool) -> Iterator[Match]:
    """Ranks whose communicator reports an initialization or asynchronous NCCL error, newest report first."""
    seen: set[tuple] = set()
    for rep in reversed(reports):
        for comm in rep.fields["comms"]:
            for err in comm["errors"]:
                cat = _ERROR_CATEGORY.get(err["error"])
                if cat is None or (lost and cat[0] == "network_fault"):
                    continue  # a remote error while a peer is dead or unreachable: the peer is the cause
                key = (comm.get("hash"), err["error"], err["kind"])
                if key in seen:
                    continue
                seen.add(key)
                glob = _global(rep, comm, facts)
                members = err["ranks"]
                ranks = sorted(members)
                yield Match(
                    cat[0],
                    cat[1],
                    _culprit(facts, members, ranks, glob),
                    [
                        q
                        for q in [
                            *comm.get("quotes", [])[:1],
                            err.get("head"),
                            err["quote"],
                            *(x for i in members.values() for x in [i["quote"], *i.get("quotes", [])]),
                        ]
                        if q
                    ],  # fmt: skip
                    {
                        "kind": "error",
                        "error": err["error"],
                        "when": err["kind"],
                        "ranks": ranks,
                        "members": members,
                        "count": err["count"],
                        "comm": comm,
                        "global": glob,
                    },  # fmt: skip
                )


@playbook("ncclras", order=11)
def ncclras(facts: Facts) -> Iterator[Match]:
    """NCCL RAS: which rank is dead, unreachable, or behind the others in a collective?"""
    reports = facts.ev.events_of("ncclras_report")
    if not reports:
        return
    # Each kind of fault from the reports that show it, worded from the newest (a later query knows more).
    lost = False
    for kind in ("dead", "unresponsive"):
        shown = [r for r in reports if _shows(r, kind)]
        if shown:
            lost = True
            yield _merged([m for r in shown for m in _lost(facts, r, kind)])
            break  # a dead process was unreachable first: the surer word is enough
    yield from _errors(facts, reports, lost)
    yield from _lagging(facts, reports)
