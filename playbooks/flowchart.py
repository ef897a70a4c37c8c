"""The systematic debugging flowchart, one playbook per question.

Are all ranks alive? Did they all get through initialisation? Are they all in the same collective?
Who is elsewhere, and where (data loading, I/O, a lock, point-to-point, another collective)?
Is the hardware or the network at fault? Is the job actually moving, only slowly?
Each playbook's words live in templates/<name>.j2.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator

from hangdx.playbooks.engine import Match, playbook
from hangdx.playbooks.facts import Facts, RankView, call_site, row_vote, user_frame, votes, watchdog_abort
from hangdx.playbooks.signals import (
    aborted,
    after_a_crash,
    event_kind,
    fabric_port,
    flushed,
    is_wait,
    loopback,
    lost_peer,
    own_crashes,
    own_error,
    peer_host,
)
from hangdx.playbooks.timeline import Clock
from hangdx.playbooks.verdict import Culprit
from hangdx.playbooks.wording import number_set
from hangdx.probes.model import LogEvent, Quote
from hangdx.probes.rx import lazy

WAITING = ("collective", "p2p", "init", "store")


def _loc_quote(v: RankView) -> list[Quote]:
    q = v.location.quote
    return [q] if q else []


def _proc_quote(facts: Facts, v: RankView) -> Quote | None:
    s = v.last_state
    if s is None:
        return None
    src = f"{s.host or 'local'}/processes"
    parts = [f"pid {s.pid}", f"RANK={s.rank}", f"WORLD_SIZE={s.world_size}", f"state {s.state}"]
    if s.wchan:
        parts.append(f"wchan {s.wchan}")
    if s.syscall:
        parts.append(f"syscall {s.syscall}" + (f"({s.syscall_target})" if s.syscall_target else ""))
    return Quote(src, 0, " ".join(parts))


def _crowd_quotes(facts: Facts, limit: int = 2) -> list[Quote]:
    out: list[Quote] = []
    for r in [r for r in facts.crowd_ranks if r in facts.ranks][:limit]:
        out.extend(_loc_quote(facts.ranks[r]))
    return out


def _hung(facts: Facts) -> bool:
    return facts.progressing is not True


def _crowd_ctx(facts: Facts) -> dict:
    crowd = facts.crowd
    return {
        "crowd": crowd.describe() if crowd else "unknown",
        "crowd_op": crowd.op_words if crowd and crowd.op else "the collective",
        "crowd_ranks": facts.crowd_ranks,
        "world_size": facts.world_size,
        "progress": facts.progress_reason,
    }


@playbook("rank_gone", order=10)
def rank_gone(facts: Facts) -> Iterator[Match]:
    """Are all ranks alive? A rank WORLD_SIZE promises that no probe finds, or whose process exited."""
    # A rank on a host nobody could probe is unseen, not gone: host_unreachable speaks for it.
    unseen = {m for m in facts.missing if facts.host_of(m) in facts.unprobed_hosts}
    if facts.unprobed_hosts and any(facts.host_of(m) is None for m in facts.missing):
        unseen |= {m for m in facts.missing if facts.host_of(m) is None}
    gone = sorted((set(facts.missing) - unseen) | set(facts.exited))
    crowd_in_init = facts.crowd is not None and facts.crowd.kind == "init"
    logs = _crash_events(facts)
    if crowd_in_init and not any(e.rank in gone for e in logs):
        return  # never joined: comm_init_failure's question
    if gone:
        survivors = sorted(r for r, v in facts.ranks.items() if v.alive and r not in gone)
        evidence: list[Quote] = []
        for r in survivors[:3]:
            q = _proc_quote(facts, facts.ranks[r])
            if q:
                evidence.append(q)
        evidence += _crowd_quotes(facts)
        cause_events = [e for e in logs if e.rank in gone]
        evidence += [e.quote for e in cause_events]
        hosts = facts.hosts_of(gone) or _hosts_of_events(cause_events)
        if not hosts and len(facts.ev.hosts) == 1:
            hosts = list(facts.ev.hosts)  # one host probed: a rank gone from it was there
        yield Match(
            "rank_crashed",
            0.93 if cause_events else 0.88,
            Culprit(ranks=gone, hosts=hosts),
            evidence,
            {
                **_crowd_ctx(facts),
                "ranks": gone,
                "missing": facts.missing,
                "exited": facts.exited,
                "survivors": survivors,
                "causes": [e.quote.text for e in cause_events][:3],
                "oom": any(e.kind in ("oom_kill", "cuda_oom") for e in cause_events),
            },
            status="hung",
        )
        return
    # Offline: torchrun or the kernel says a rank died. A rank that died of a timeout is a victim, not a cause.
    victims = _timed_out_ranks(facts)
    failed = [e for e in _real_failures(facts) if e.rank not in victims]
    root = [e for e in failed if e.fields.get("root_cause")] or failed
    if root:
        ranks = sorted({e.rank for e in root if e.rank is not None})
        excs = [e for e in facts.ev.events_of("exception", "cuda_oom") if e.rank in ranks]
        yield Match(
            "rank_crashed",
            0.85,
            Culprit(ranks=ranks, hosts=_hosts_of_events(root)),
            [e.quote for e in excs[:2]]
            + [e.quote for e in root]
            + [e.quote for e in logs if e.rank in ranks and e not in root],
            {
                **_crowd_ctx(facts),
                "ranks": ranks,
                "missing": [],
                "exited": ranks,
                "survivors": [],
                "causes": [e.quote.text for e in excs + root][:3],
                "oom": any(e.kind in ("oom_kill", "cuda_oom") for e in logs if e.rank in ranks),
            },
            status="failed",
        )


def _real_failures(facts: Facts) -> list[LogEvent]:
    """torchrun failures, less the ranks torchrun itself stopped (SIGTERM) after another rank failed, and less
    the ranks that aborted (SIGABRT) with no error of their own: ProcessGroupNCCL's watchdog ends a rank that
    timed out waiting that way, so the abort says the rank gave up, not why (playbooks/signals.py `aborted`)."""
    out = []
    for e in facts.ev.events_of("torchrun_failure"):
        if e.rank is None:
            continue
        if not e.fields.get("root_cause") and (
            e.fields.get("signal") == "SIGTERM" or e.fields.get("exitcode") == -15
        ):
            continue
        if aborted(e) and not own_error(facts, e.rank):
            continue
        out.append(e)
    return out


def _timed_out_ranks(facts: Facts) -> set[int]:
    """Ranks whose own logs say they gave up waiting on peers (their death is a symptom)."""
    kinds = (
        "watchdog_timeout",
        "gloo_timeout",
        "monitored_barrier_failed",
        "desync_report",
        "connection_closed",
    )
    out = {e.rank for e in facts.ev.events_of(*kinds) if e.rank is not None}
    out |= {e.rank for e in facts.ev.events_of("exception") if e.rank is not None and _is_comm_error(e)}
    return out


def _crash_events(facts: Facts) -> list[LogEvent]:
    return facts.ev.events_of("torchrun_failure", "process_exit", "oom_kill", "cuda_oom", "segfault")


def _hosts_of_events(events: list[LogEvent]) -> list[str]:
    return sorted({e.host or e.fields.get("host") for e in events if e.host or e.fields.get("host")})


@playbook("never_joined", order=20)
def never_joined(facts: Facts) -> Iterator[Match]:
    """Did every rank get through rendezvous and communicator set-up?"""
    in_init = facts.ranks_where("init")
    # Each line counts as its catalogue row reads it: a store's socket timeout mid-run is context, a receive that
    # failed on a broken pipe is a peer that went away (rank_crashed), not a connect that never succeeded.
    init_logs = votes(
        facts.ev.events_of("nccl_conn_refused", "store_timeout", "rendezvous_timeout"), "comm_init_failure"
    )
    # A failure NCCL placed in the data path (the proxy thread, after set-up) is nccl_socket_fault's. A connection
    # that was up and went away (broken pipe, reset or closed by the peer) is no set-up failure: its peer ended
    # (the signal catalogue's reading, playbooks/signals.py); a refused or unanswered connect is one.
    init_logs = [e for e in init_logs if e.fields.get("stage") != "data" and not lost_peer(e)]
    barrier, absent, joined = _init_barrier_waits(facts)
    init_logs += barrier
    framework: list[LogEvent] = []
    if not in_init and not init_logs:
        framework = _framework_init_waits(facts)
        init_logs = framework
    if not in_init and not init_logs:
        return
    if in_init and not _hung(facts):
        return
    blamed = [e for e in init_logs if e not in barrier and e not in framework]
    others = sorted(r for r, v in facts.ranks.items() if v.alive and r not in in_init and v.locations)
    late = sorted(set(facts.missing) | set(others) | set(absent))
    on_loopback = [e for e in facts.ev.events_of("loopback_fallback") if e.rank is not None]
    if not late and init_logs and on_loopback:
        # No rank is known to be late: a rank that says it bound to the loopback address is the one its peers
        # (or it, dialling them at 127.0.0.1) cannot reach.
        late = sorted({e.rank for e in on_loopback})
    else:
        on_loopback = []
    evidence = [e.quote for e in on_loopback[:2]]
    evidence += [q for r in in_init[:2] for q in _loc_quote(facts.ranks[r])]
    evidence += [q for r in others for q in _loc_quote(facts.ranks[r])]
    evidence += [e.quote for e in init_logs[:4]]
    where = {r: facts.ranks[r].location.describe() for r in others}
    yield Match(
        "comm_init_failure",
        0.9 if in_init and late else 0.55 if framework else 0.7,
        # The barrier's and Lightning's lines come from processes that arrived: their hosts are not the culprit's.
        Culprit(ranks=late, hosts=facts.hosts_of(late) or _hosts_of_events(blamed)),
        evidence,
        {
            **_crowd_ctx(facts),
            "in_init": in_init,
            "late": late,
            "missing": facts.missing,
            "where": where,
            "log_lines": [e.quote.text for e in init_logs[:2]],
            "targets": sorted({str(e.fields["target"]) for e in init_logs if e.fields.get("target")}),
            "unreachable": next(
                (e.fields["unreachable"] for e in init_logs if e.fields.get("unreachable")), None
            ),
            "log_hosts": _hosts_of_events(init_logs),
            "loopback_ranks": sorted({e.rank for e in on_loopback}),
            "barrier": [{"joined": joined, "world_size": e.fields.get("world_size")} for e in barrier[-1:]],
            "framework": _members_seen(framework),
        },
        status="hung",
    )


def _init_barrier_waits(facts: Facts) -> tuple[list[LogEvent], list[int], int]:
    """A process group's set-up barrier still waiting for processes that never arrived, those processes, and how many
    had arrived.

    _store_based_barrier (torch/distributed/distributed_c10d.py; init_process_group and new_group run it) logs its
    wait every 10 s while fewer than world_size processes have counted themselves in; a key whose barrier is seen
    completing is not waiting, nor is one the job is seen past (progress, collectives). The processes that never
    arrived are named only for the first group's key (`:0` or `:1`, by release: a later group's barrier counts the
    group's size while it logs global ranks), when every process that arrived says so ("Added key ... for rank: N",
    a debug line in the newest releases)."""
    done = {e.fields.get("key") for e in facts.ev.events_of("store_barrier_done")}
    waits = [
        e
        for e in facts.ev.events_of("store_barrier_wait")
        if e.fields.get("key") not in done
        and isinstance(e.fields.get("joined"), int)
        and isinstance(e.fields.get("world_size"), int)
        and e.fields["joined"] < e.fields["world_size"]
    ]
    if not waits or _past_set_up(facts):
        return [], [], 0
    key, size = waits[-1].fields.get("key"), waits[-1].fields["world_size"]
    joined = max(e.fields["joined"] for e in waits if e.fields.get("key") == key)
    added = {
        e.fields["rank"]
        for e in facts.ev.events_of("store_barrier_key_added")
        if e.fields.get("key") == key and isinstance(e.fields.get("rank"), int)
    }
    first_group = str(key).rsplit(":", 1)[-1] in ("0", "1")
    named = first_group and added and len(added) >= joined and all(r < size for r in added) and size <= 4096
    return waits, sorted(set(range(size)) - added) if named else [], joined


def _members_seen(starts: list[LogEvent]) -> list[dict]:
    """How many processes of the last set-up's world printed their set-up line, and of how many ([] for none)."""
    size = starts[-1].fields.get("world_size") if starts else None
    if not isinstance(size, int):
        return []
    seen = {str(e.fields.get("global_rank")) for e in starts if e.fields.get("world_size") == size}
    return [{"members": len(seen), "world_size": size}]


# Lines a job prints only once it is past set-up: progress bars and step counters, collectives under way, finished
# training, checkpoints.
_PAST_SET_UP = frozenset(
    {
        "progress",
        "step_counter",
        "step_timing",
        "step_data_time",
        "data_progress",
        "collective_progress",
        "training_finished",
        "checkpoint_io",
        "lightning_device_setup",
    }
)


def _past_set_up(facts: Facts) -> bool:
    """Whether the text shows the job past set-up: a stack, a collective wait, progress, NCCL collectives or a
    communicator NCCL says it completed."""
    if any(v.locations for v in facts.ranks.values()) or facts.ev.collectives:
        return True
    if any(e.fields.get("complete") for e in facts.ev.events_of("nccl_init")):
        return True
    return any(is_wait(e) or event_kind(e) in _PAST_SET_UP for e in facts.ev.events)


def _framework_init_waits(facts: Facts) -> list[LogEvent]:
    """Lightning's set-up lines with no completion after them (no rank named: see below).

    _init_dist_connection (lightning_fabric/utilities/distributed.py) logs `Initializing distributed: GLOBAL_RANK: r,
    MEMBER: r+1/W` in every process just before init_process_group, and rank 0 alone logs `All distributed
    processes registered. Starting with W processes` once it returns: only a text with rank 0's line can lack it.
    Read only where the text shows nothing of the job past set-up (no stack, no collective wait or progress, no
    per-rank device line, no line of another category): a paste cut before the completion line while the job went
    on is not a set-up that hangs. The ranks with no line are not named: a node's log holds its own ranks only, and
    nothing counts who arrived."""
    starts = [
        e
        for e in facts.ev.events_of("comm_init_start")
        if e.fields.get("signal_row") == "lightning_init_distributed"
    ]
    if not any(str(e.fields.get("global_rank")) == "0" for e in starts) or facts.ev.events_of(
        "comm_init_done"
    ):
        return []
    if _past_set_up(facts) or any(
        e.fields.get("signal_category") not in (None, "comm_init_failure") for e in facts.ev.events
    ):
        return []
    return starts


@playbook("ddp_unused_parameters", order=30)
def ddp_unused(facts: Facts) -> Iterator[Match]:
    """Does DDP wait for gradients of parameters that a rank never used?"""
    events = facts.ev.events_of("ddp_unused_parameters")
    if not events:
        return
    by_rank: dict[int | None, LogEvent] = {}
    for e in events:
        by_rank.setdefault(e.rank, e)
    ranks = sorted(r for r in by_rank if r is not None)
    names = sorted({n for e in events for n in e.fields.get("param_names") or []})
    indices = sorted({i for e in events for i in e.fields.get("param_indices") or []})
    yield Match(
        "ddp_unused_parameters",
        0.92,
        Culprit(ranks=ranks, hosts=facts.hosts_of(ranks) or _hosts_of_events(events)),
        [e.quote for e in events]
        + [q for r in ranks if r in facts.ranks for q in _loc_quote(facts.ranks[r])],
        {**_crowd_ctx(facts), "ranks": ranks, "names": names, "indices": indices},
        status="hung",
    )


@playbook("collective_mismatch", order=40)
def collective_mismatch(facts: Facts) -> Iterator[Match]:
    """Are the ranks in the same collective call, but disagreeing on its type, size, dtype or group?"""
    events = facts.ev.events_of("collective_mismatch", "gloo_size_mismatch")
    if events:
        e = events[0]
        per_rank = e.fields.get("per_rank") or {}
        if _apart_by_stacks(facts):
            # The stacks show the ranks in collectives at different lines of their code: the sizes NCCL found
            # unequal are those of two different calls that met (a rank left the loop, or added a call), which is
            # rank_elsewhere's finding, with its culprit, not a disagreement within one call.
            return
        apart = _not_in_the_same_call(e)
        if apart:
            # Not one call the ranks disagree on: they are at different points of their collective sequences.
            yield Match(
                "conditional_collective",
                0.88,
                Culprit(),
                [x.quote for x in events[:4]],
                {**_crowd_ctx(facts), "ranks": [], "detail": e.quote.text[:300], "ops": {}, "apart": apart},
                status="failed" if not facts.ev.live else "hung",
                template="collective_mismatch",
            )
            return
        ranks = _minority(per_rank) or sorted({x.rank for x in events if x.rank is not None})
        yield Match(
            "collective_mismatch",
            0.9,
            Culprit(ranks=ranks, hosts=facts.hosts_of(ranks)),
            [x.quote for x in events[:4]],
            {**_crowd_ctx(facts), "ranks": ranks, "detail": e.quote.text[:300], "ops": {}},
            status="failed" if not facts.ev.live else "hung",
        )
        return
    same = _same_number_disagreement(facts) or _timeout_size_disagreement(facts)
    if same:
        ranks, gpus, quotes, detail = same
        hosts = sorted(set(facts.hosts_of(ranks)) | {g.rsplit(":", 1)[0] for g in gpus})
        yield Match(
            "collective_mismatch",
            0.86,
            Culprit(ranks=ranks, hosts=hosts, gpus=gpus),
            quotes[:6],
            {**_crowd_ctx(facts), "ranks": ranks, "detail": detail, "ops": {}},
            status="failed" if not facts.ev.live else "hung",
        )
        return
    crowd = facts.crowd
    if crowd is None or crowd.kind != "collective" or not _hung(facts):
        return
    odd = [
        r
        for r in facts.odd_ranks
        if facts.ranks[r].location.kind == "collective"
        and facts.ranks[r].location.call_site == crowd.call_site
        and facts.ranks[r].location.op != crowd.op
    ]
    if not odd:
        return
    ops = {r: facts.ranks[r].location.op for r in odd}
    yield Match(
        "collective_mismatch",
        0.88,
        Culprit(ranks=odd, hosts=facts.hosts_of(odd)),
        [q for r in odd for q in _loc_quote(facts.ranks[r])] + _crowd_quotes(facts),
        {**_crowd_ctx(facts), "ranks": odd, "detail": "", "ops": ops, "call_site": crowd.call_site},
        status="hung",
    )


# Collectives whose every rank passes the same number of elements (torch.distributed's contract for each: an
# all-to-all's splits, a gather's root, may differ by design and are left out).
_SAME_SIZE_OPS = frozenset({
    "allreduce", "broadcast", "allgather", "_allgather_base", "allgather_into_tensor_coalesced", "reduce_scatter",
    "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "reduce", "barrier",
})  # fmt: skip


def _timeout_size_disagreement(facts: Facts) -> tuple[list[int], list[str], list[Quote], str] | None:
    """Watchdog timeouts of several ranks at one SeqNum of one process group, in the same op, with different NumelIn.

    ProcessGroupNCCL numbers each group's collectives in the order a rank issues them: at the same number every
    rank is in the same call, which must carry the same number of elements. Ranks timed out there with different
    sizes disagree on that call (a tensor whose shape differs by rank): the fewer side is named, a tie names none.
    """
    at: dict[tuple, dict[int, tuple[int, Quote]]] = defaultdict(dict)
    for c in facts.ev.collectives:
        if c.origin != "torch_log" or c.rank is None or c.seq is None or not isinstance(c.numel_in, int):
            continue
        if c.op not in _SAME_SIZE_OPS or c.quote is None:
            continue
        at[(c.pg, c.seq, c.op)][c.rank] = (c.numel_in, c.quote)
    for (_pg, seq, op), per in sorted(at.items(), key=lambda kv: (kv[0][1], str(kv[0]))):
        sizes = {n for n, _ in per.values()}
        if len(per) < 2 or len(sizes) < 2:
            continue
        by_size: dict[int, list[int]] = defaultdict(list)
        for r, (n, _) in per.items():
            by_size[n].append(r)
        groups = sorted(by_size.values(), key=len)
        ranks = sorted(groups[0]) if len(groups[0]) < len(groups[1]) else []
        detail = f"{op} #{seq}: " + ", ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, sorted(rs)))} {n:,} elements"
            for n, rs in sorted(by_size.items())
        )
        return ranks, [], [q for _, q in per.values()], detail
    return None


def _same_number_disagreement(facts: Facts) -> tuple[list[int], list[str], list[Quote], str] | None:
    """Per-call records of several processes that carry the same sequence number but not the same call.

    ProcessGroupWrapper's `Running collective: CollectiveFingerPrint(SequenceNumber=N, ...)` (DETAIL) and NCCL's
    INFO line per collective (`Broadcast: opCount N ... count C datatype D ... root R ... [nranks=K]`) number each
    rank's calls in order: at the same number every rank must run the same op with the same size and type. The
    processes that differ from most at the lowest such number are the culprits (a tie names every process).
    NCCL's line names a process and its GPU, not its rank: on one host, GPU N is read as local rank N (what
    torchrun and mpirun give each process), said as such.
    """
    # call number -> process -> (signature, quote, rank, gpu)
    calls: dict[object, dict[tuple, tuple]] = defaultdict(dict)
    for e in facts.ev.events_of("collective_fingerprint"):
        seq = e.fields.get("seq")
        if e.rank is None or not str(seq).isdigit():
            continue
        sig = (
            str(e.fields.get("op")).lower(),
            f"shapes {e.fields.get('shapes')}" if e.fields.get("shapes") else None,
            f"dtypes {e.fields.get('dtypes')}" if e.fields.get("dtypes") else None,
        )
        calls[int(seq)][("rank", e.rank)] = (sig, e.quote, e.rank, None)
    records = [
        c
        for c in facts.ev.collectives
        if c.origin == "nccl_log" and c.seq is not None and c.op not in _P2P_OPS
    ]
    hosts = {c.host for c in records}
    for c in records:
        who = ("rank", c.rank) if c.rank is not None else ("proc", c.host, c.pid, c.device)
        nranks = c.sizes.get("nranks") if isinstance(c.sizes, dict) else None
        root = c.sizes.get("root") if isinstance(c.sizes, dict) else None
        sig = (c.op, f"count {c.numel_in}", c.dtype, f"root {root}" if root is not None else None)
        key = (c.seq, nranks)
        if who in calls[key]:  # two communicators of one process at this number: no telling which pairs up
            calls[key][who] = ("ambiguous", c.quote, None, None)
            continue
        rank = c.rank
        if rank is None and len(hosts) == 1 and c.device is not None:
            rank = c.device
        gpu = f"{c.host}:{c.device}" if c.host and c.device is not None else None
        calls[key][who] = (sig, c.quote, rank, gpu)
    tie: tuple[list[int], list[str], list[Quote], str] | None = None
    for key in sorted(calls, key=lambda k: (k if isinstance(k, int) else k[0], str(k))):
        procs = {w: v for w, v in calls[key].items() if v[0] != "ambiguous"}
        if len(procs) < 2 or len({v[0] for v in procs.values()}) < 2:
            continue
        odd = _minority({i: str(v[0]) for i, v in enumerate(procs.values())})
        vals = list(procs.values())
        if not odd or len(odd) == len(vals):
            if tie is None:
                # As many processes on one side as on the other (two processes, one call each): they disagree on
                # the call, which settles the category; which of them diverged, nothing here says.
                seq = key if isinstance(key, int) else key[0]
                sides = "; ".join(
                    dict.fromkeys(", ".join(str(x) for x in v[0] if x is not None) for v in vals)
                )
                tie = (
                    [],
                    [],
                    [v[1] for v in vals if v[1]][:4],
                    f"call #{seq}: {sides}, one process each side",
                )
            continue
        ranks = sorted({vals[i][2] for i in odd if vals[i][2] is not None})
        gpus = [vals[i][3] for i in odd if vals[i][3]]
        seq = key if isinstance(key, int) else key[0]
        quotes = [vals[i][1] for i in odd if vals[i][1]] + [v[1] for i, v in enumerate(vals) if i not in odd][
            :2
        ]
        what = ", ".join(f"{x}" for x in vals[odd[0]][0] if x is not None)
        common = ", ".join(
            f"{x}" for x in vals[next(i for i in range(len(vals)) if i not in odd)][0] if x is not None
        )
        detail = (
            f"call #{seq}: {what} on the odd one{'s' if len(odd) > 1 else ''} out, {common} on the others"
        )
        return ranks, gpus, quotes, detail
    return tie


_P2P_OPS = ("send", "recv")


# DDP's own per-iteration syncs (torch/nn/parallel/distributed.py: buffers and parameters broadcast from the
# authoritative rank): the model is replicated and DDP checked its shapes at construction, so every rank that runs
# them runs the same call. A rank reported inconsistent there is matched against a rank that is not in it at all.
_DDP_OWN_SYNC = lazy(r"_broadcast_coalesced|_sync_buffers|_sync_params|_sync_module_buffers")


def _apart_by_stacks(facts: Facts) -> list[int]:
    """Live stacks with some rank in a collective at another line of code than the crowd's collective."""
    crowd = facts.crowd
    if crowd is None or crowd.kind != "collective" or not crowd.call_site:
        return []
    return [
        r
        for r in facts.odd_ranks
        if facts.ranks[r].location.kind == "collective"
        and facts.ranks[r].location.call_site
        and facts.ranks[r].location.call_site != crowd.call_site
    ]


def _not_in_the_same_call(e) -> str:
    """Why a ProcessGroupWrapper mismatch report is ranks in different calls rather than one call disagreed on.

    Its fingerprints carry each rank's collective sequence number: different numbers mean a rank issued more or
    fewer collectives than another (it skipped or added one: a divergent code path), whatever else differs. The
    older report (`is running inconsistent collective`, one rank's fingerprint, no number) says so when the
    collective is one of DDP's own syncs, which cannot differ between ranks that are both in it.
    """
    per_rank = e.fields.get("per_rank") or {}
    if not isinstance(per_rank, dict):
        return ""
    seqs = {v.get("seq") for v in per_rank.values() if isinstance(v, dict) and v.get("seq") is not None}
    if len(seqs) > 1:
        return "sequence numbers " + " vs ".join(str(x) for x in sorted(seqs))
    where = " ".join(str(w) for w in e.fields.get("where") or [])
    if len(per_rank) == 1 and not seqs and _DDP_OWN_SYNC.search(where):
        return "inside DDP's own buffer/parameter broadcast, which every rank issues alike"
    prints = [v for v in per_rank.values() if isinstance(v, dict)]
    if (
        len(prints) > 1
        and _SHARDED_OP.search(e.quote.text)
        and len({(v.get("op"), v.get("dtypes")) for v in prints}) == 1
        and len({v.get("shapes") for v in prints}) > 1
        and all(_FLAT_SHAPE.fullmatch(str(v.get("shapes") or "").strip()) for v in prints)
    ):
        # FSDP / ZeRO-3 pad each unit's flat (1-D) parameter so that every rank's shard has the same size: one
        # unit's all-gather (or reduce-scatter) has the same shape on every rank, so different 1-D sizes at one
        # sequence number are different units, i.e. the ranks are at different points of the model. A tensor of
        # several dimensions is an activation or a user's tensor: its sizes differing is a mismatch in one call.
        return "a sharded all-gather/reduce-scatter of different sizes, i.e. of different parameter units"
    return ""


# The flat-tensor collectives of sharded data parallelism (FSDP, ZeRO-3): _allgather_base / _reduce_scatter_base
# (pytorch/pytorch torch/csrc/distributed/c10d/Types.hpp OpType names).
_FLAT_SHAPE = lazy(r"\[\d{1,12}\]")
_SHARDED_OP = lazy(r"OpType=(?:_ALLGATHER_BASE|_REDUCE_SCATTER_BASE)\b")


def _minority(per_rank: dict) -> list[int]:
    """In a mismatch report, the ranks whose collective differs from most."""
    if not isinstance(per_rank, dict) or len(per_rank) < 2:
        return []
    sig = {
        int(r): str(sorted(v.items()) if isinstance(v, dict) else v)
        for r, v in per_rank.items()
        if str(r).isdigit()
    }
    counts: dict[str, int] = defaultdict(int)
    for s in sig.values():
        counts[s] += 1
    if len(counts) < 2:
        return []
    common = max(counts, key=lambda s: counts[s])
    if list(counts.values()).count(counts[common]) > 1:
        return sorted(sig)  # a tie: every rank named is a suspect
    return sorted(r for r, s in sig.items() if s != common)


# Code that only waits on point-to-point work: torch.distributed.pipelining's schedules wait on the works of their
# stage-to-stage sends and receives (_batch_p2p / _sorted_batch_p2p), and nothing else, in the frames named here.
_P2P_WAIT_FILES = (
    "torch/distributed/pipelining/schedules.py",
    "megatron/core/pipeline_parallel/p2p_communication.py",
)
_PEER_LOST = lazy(r"connection reset by peer|connection closed by peer|broken pipe|end of file", re.I)


@playbook("p2p_wait_lost", order=46)
def p2p_wait_lost(facts: Facts) -> Iterator[Match]:
    """Logs: a pipeline stage's wait on its neighbours' sends/receives ended by losing the peer, and no rank shows
    a failure of its own: the stages waited on each other until one side gave up and closed its connections."""
    lost = [
        e
        for e in facts.ev.events_of("exception")
        if e.rank is not None
        and _PEER_LOST.search(str(e.fields.get("message") or ""))
        and any(f.split(":", 1)[0].endswith(_P2P_WAIT_FILES) for f in (e.fields.get("frames") or [])[-1:])
    ]
    if not lost:
        return
    own = [
        e
        for e in facts.ev.events_of("exception")
        if e.rank is not None
        and not _is_comm_error(e)
        and not _PEER_LOST.search(str(e.fields.get("message")))
    ]
    if own or _crash_events(facts) or facts.ev.events_of("cuda_error", "oom_kill", "cuda_oom", "segfault"):
        return  # a rank that failed on its own explains the lost peer better
    ranks = sorted({e.rank for e in lost if e.rank is not None})
    yield Match(
        "p2p_deadlock",
        0.6,
        Culprit(),
        [e.quote for e in lost[:4]],
        {
            "ranks": ranks,
            "sites": {e.rank: (e.fields.get("frames") or [""])[-1] for e in lost[:4]},
            "message": str(lost[0].fields.get("message"))[:200],
        },
        status="failed",
        template="p2p_wait_lost",
    )


@playbook("p2p_deadlock", order=45)
def p2p_deadlock(facts: Facts) -> Iterator[Match]:
    """Are point-to-point sends and receives ordered so that peers wait on each other?

    When the dumps name each call's peer (py-spy --locals: `src`, `dst`), the ranks that wait on one another in a
    cycle are the culprits; a rank waiting on a rank of the cycle is only backed up behind it.
    """
    if not _hung(facts):
        return
    p2p = facts.ranks_where("p2p")
    if not p2p:
        return
    ops = {r: facts.ranks[r].location.op for r in p2p}
    peers = {r: facts.ranks[r].location.peer for r in p2p if facts.ranks[r].location.peer is not None}
    cycle = _cycle_members(peers)
    culprits = cycle or p2p
    behind = sorted(r for r in p2p if r not in culprits) if cycle else []
    both_recv = sum(1 for op in ops.values() if op == "recv") >= 2
    conf = 0.9 if len(p2p) >= 2 and both_recv else 0.75
    # A rank stuck on its own (data, a lock, computing) holds its neighbours in p2p: they may only be backed up.
    on_its_own = [
        r for r, v in facts.ranks.items() if v.alive and v.locations and v.location.kind in _ON_ITS_OWN
    ]
    if on_its_own:
        conf = 0.5
    if cycle:
        conf = 0.92
    yield Match(
        "p2p_deadlock",
        conf,
        Culprit(ranks=culprits, hosts=facts.hosts_of(culprits)),
        [q for r in culprits + behind for q in _loc_quote(facts.ranks[r])],
        {
            **_crowd_ctx(facts),
            "ranks": culprits,
            "ops": {r: ops[r] for r in culprits},
            "sites": {r: facts.ranks[r].location.call_site for r in p2p},
            "peers": peers,
            "cycle": cycle,
            "behind": behind,
        },
        status="hung",
    )


def _cycle_members(peers: dict[int, int]) -> list[int]:
    """The ranks on a cycle of "waits for" (rank -> the peer its blocking send/recv needs)."""
    on_cycle: set[int] = set()
    for start in peers:
        path: list[int] = []
        r: int | None = start
        while r is not None and r in peers and r not in path:
            path.append(r)
            r = peers[r]
        if r is not None and r in path:
            on_cycle.update(path[path.index(r) :])
    return sorted(on_cycle)


# What the odd rank's own wait says, when the crowd waits in a collective for it (kinds: playbooks/facts.py,
# from the taxonomy in probes/waits.yaml): its wait names the cause.
_ELSEWHERE = {
    "dataloader": ("dataloader_stall", "dataloader_stall", 0.9),
    "io": ("io_stall", "io_stall", 0.9),
    "lock": ("user_deadlock", "user_deadlock", 0.86),
    "child": ("user_deadlock", "user_deadlock", 0.86),  # a child process or thread the program waits for
    "network": ("io_stall", "io_stall", 0.72),  # a download or a remote store: its own I/O, not its peers
    "sleep": ("user_deadlock", "user_deadlock", 0.7),  # a polling loop waiting for a condition of its own
}


# Where a rank waits on nothing its peers do: its own data, storage, locks, children, network, or computing.
_ON_ITS_OWN = ("dataloader", "io", "lock", "child", "network", "sleep", "compute")


@playbook("rank_elsewhere", order=50)
def rank_elsewhere(facts: Facts) -> Iterator[Match]:
    """Who is not in the collective (or the point-to-point calls) the others wait in, and where is it?

    Pipeline stages wait on their neighbours in send/recv: when one stage is stuck on its own data, storage or
    locks, the stages around it are backed up in p2p, and the stuck one is the odd rank.
    """
    crowd = facts.crowd
    if crowd is None or crowd.kind not in ("collective", "p2p") or not _hung(facts):
        return
    by_kind: dict[str, list[int]] = defaultdict(list)
    for r in facts.odd_ranks:
        loc = facts.ranks[r].location
        if loc.kind == "p2p" or loc.kind == "init":
            continue  # their own playbooks
        if crowd.kind == "p2p" and loc.kind not in _ON_ITS_OWN:
            continue  # another stage's collective or p2p: the pipeline's own traffic, not a cause by itself
        if loc.kind == "collective" and loc.call_site == crowd.call_site and loc.op != crowd.op:
            continue  # collective_mismatch
        by_kind[loc.kind].append(r)
    compute = by_kind.pop("compute", [])
    computing = [r for r in compute if facts.ranks[r].fraction_in({"compute"}) == 1.0]
    if len(compute) > len(computing):
        by_kind["compute"] = [r for r in compute if r not in computing]
    if computing:
        # Running its own code in every sample while the others wait for it: it holds them back (a slow or
        # endless step), it did not skip their collective.
        yield _elsewhere_match(facts, "rank_computing", "straggler", 0.72, computing)
    for kind, ranks in by_kind.items():
        category, template, conf = _ELSEWHERE.get(
            kind, ("conditional_collective", "conditional_collective", 0.0)
        )
        if category == "conditional_collective":
            conf = 0.87 if kind == "collective" else 0.78
            if len(ranks) > len(facts.crowd_ranks):
                conf -= 0.2  # more ranks elsewhere than in the crowd: less sure who diverged
        yield _elsewhere_match(facts, template, category, conf, ranks)


def _elsewhere_match(facts: Facts, template: str, category: str, conf: float, ranks: list[int]) -> Match:
    evidence: list[Quote] = []
    workers: dict[int, str] = {}
    threads: dict[int, list[str]] = {}
    for r in ranks:
        v = facts.ranks[r]
        evidence += _loc_quote(v)
        q = _proc_quote(facts, v)
        if q and (v.location.kind in ("io", "lock", "child") or (v.last_state and v.last_state.syscall)):
            evidence.append(q)
        worker = _worker_site(v)
        if worker:
            workers[r], q = worker
            if q:
                evidence.append(q)
        threads[r] = _other_threads(v)
    evidence += _crowd_quotes(facts)
    evidence += _seq_quotes(facts, ranks)
    return Match(
        category,
        conf,
        Culprit(ranks=ranks, hosts=facts.hosts_of(ranks)),
        evidence,
        {
            **_crowd_ctx(facts),
            "ranks": ranks,
            "where": {r: facts.ranks[r].location.describe() for r in ranks},
            "locs": {r: facts.ranks[r].location for r in ranks},
            "workers": workers,
            "threads": threads,
            "seq": _seq_note(facts, ranks),
        },
        status="hung",
        template=template,
    )


def _worker_site(v: RankView) -> tuple[str, Quote | None] | None:
    """Where a rank's child process (a DataLoader worker) is stuck: its own code line and syscall."""
    if not v.worker_stacks:
        return None
    dump = v.worker_stacks[-1]
    thread = dump.main_thread()
    if thread is None:
        return None
    user = user_frame([f for f in thread.frames if not f.native])
    if user is None:
        return None
    text = f"at {call_site(user)}"
    states = [s for s in v.worker_states if s.pid == dump.pid and s.state != "exited"]
    if states and states[-1].syscall:
        s = states[-1]
        text += f", blocked in {s.syscall}" + (f" on {s.syscall_target}" if s.syscall_target else "")
    return f"(pid {dump.pid}) is stuck {text}", user.quote


def _other_threads(v: RankView) -> list[str]:
    """Non-main threads of a rank that sit in user code (the other side of a deadlock)."""
    if not v.stacks:
        return []
    out = []
    for t in v.stacks[-1].threads:
        if t.name == "MainThread":
            continue
        site = call_site(user_frame(t.frames))
        if site:
            out.append(f'thread "{t.name}" at {site}')
    return out[:4]


def _seq_note(facts: Facts, ranks: list[int]) -> str:
    """What the Flight Recorder (or NCCL/watchdog records) says about the culprits' collective sequence."""
    last = _last_records(facts)
    mine = [last[r] for r in ranks if r in last]
    others = [c for r, c in last.items() if r not in ranks]
    if not mine or not others:
        return ""
    top = max(c.seq for c in others)
    at_top = sorted({c.op for c in others if c.seq == top})
    names = number_set(ranks)
    if all(c.seq == top for c in mine) and {c.op for c in mine} - set(at_top):
        ops = ", ".join(sorted({c.op for c in mine}))
        return f"Collective records agree: at #{top} rank {names} issued {ops} where the others issued {', '.join(at_top)}"
    behind = [c for c in mine if c.seq < top]
    if behind:
        return f"Collective records agree: rank {names} stopped at #{max(c.seq for c in behind)} while the others reached #{top}"
    return ""


def _last_records(facts: Facts) -> dict[int, object]:
    """Each rank's latest collective record (the one it is in, or last did)."""
    out = {}
    for r, v in facts.ranks.items():
        recs = [c for c in v.collectives if c.seq is not None and c.op not in ("send", "recv")]
        if recs:
            out[r] = max(recs, key=lambda c: c.seq)
    return out


def _seq_quotes(facts: Facts, ranks: list[int]) -> list[Quote]:
    last = _last_records(facts)
    picks = [r for r in ranks if r in last] + [r for r in sorted(last) if r not in ranks][:1]
    return [q for r in picks if (q := getattr(last[r], "quote", None))]


@playbook("timeout_report", order=58)
def timeout_report(facts: Facts) -> Iterator[Match]:
    """Offline: did PyTorch itself name the lagging ranks (desync report, monitoredBarrier)?"""
    if facts.have_stacks:
        return
    for kind, conf in (("desync_report", 0.8), ("monitored_barrier_failed", 0.72)):
        events = facts.ev.events_of(kind)
        ranks = sorted({int(r) for e in events for r in e.fields.get("ranks") or [] if str(r).isdigit()})
        if not ranks:
            continue
        crashed = {e.rank for e in _real_failures(facts) if e.rank in ranks}
        crashed |= {e.rank for e in facts.ev.events_of("oom_kill", "segfault", "cuda_oom") if e.rank in ranks}
        # A process killed by a signal (a segfault, the OOM killer) that the text names no rank for, printed before
        # the report: the rank the report says never joined is the one that died, as the report's own words
        # ("lagging, dead or mismatched") allow; a crash after the report may be a waiting rank's teardown.
        first = min(e.quote.line for e in events)
        if not crashed and any(
            e.rank is None and e.quote.source == events[0].quote.source and e.quote.line < first
            for e in facts.ev.events_of("oom_kill", "segfault")
        ):
            crashed = set(ranks)
        yield Match(
            "rank_crashed" if crashed else "conditional_collective",
            conf,
            Culprit(ranks=ranks, hosts=facts.hosts_of(ranks)),
            [e.quote for e in events[:4]],
            {**_crowd_ctx(facts), "ranks": ranks, "kind": kind, "crashed": sorted(crashed)},
            status="hung",
        )
        return


def _comparable_last(facts: Facts, progress: dict[int, LogEvent]) -> dict[int, int]:
    """Each rank's last collective sequence number, from one kind of record only, so that like is compared with like.

    A full record (Flight Recorder, NCCL's per-collective lines) says how far a rank got; "last enqueued work" says
    the same in a watchdog report; the SeqNum of a watchdog timeout only says where a rank waited, and the rank may
    have enqueued more after it. Mixing them would take a rank that reported only its timeout for one behind.
    """
    full: dict[int, int] = {}
    timed_out: dict[int, int] = {}
    waits: dict[int, set[tuple]] = defaultdict(set)  # rank -> (process group, SeqNum) of its timeouts
    for r, v in facts.ranks.items():
        for c in v.collectives:
            if c.seq is None or c.op in ("send", "recv"):
                continue
            if c.origin in ("flight_recorder", "nccl_log"):
                full[r] = max(full.get(r, c.seq), c.seq)
            else:
                timed_out[r] = max(timed_out.get(r, c.seq), c.seq)
                waits[r].add((c.pg, c.seq))
    timed_out = _one_group(waits) if waits else timed_out
    # ProcessGroupWrapper's DETAIL line before each collective (`Running collective: ...(SequenceNumber=N`): how far
    # a rank got, as a full record says it.
    printed: dict[int, int] = {}
    for e in facts.ev.events_of("collective_fingerprint"):
        if e.rank is not None and str(e.fields.get("seq")).isdigit():
            printed[e.rank] = max(printed.get(e.rank, 0), int(e.fields["seq"]))
    enqueued = {
        r: e.fields["last_enqueued"]
        for r, e in progress.items()
        if isinstance(e.fields.get("last_enqueued"), int)
    }
    ws = facts.world_size or 0
    usable = [m for m in (full, printed, enqueued, timed_out) if len(m) >= 2 or (ws and m)]
    for m in usable:  # the first kind of record that shows a rank behind speaks; else the most complete one
        if len(set(m.values())) > 1:
            return m
    return usable[0] if usable else {}


def _one_group(waits: dict[int, set[tuple]]) -> dict[int, int]:
    """Timeout SeqNums are comparable only within one process group: each group numbers its own collectives.

    A rank that timed out at several SeqNums with no group named is in several groups, and then no line says
    which number belongs to which group: nothing can be compared. Named groups are compared in the group most
    ranks report.
    """
    if any(pg is None for w in waits.values() for pg, _ in w):
        if any(len({seq for _, seq in w}) > 1 for w in waits.values()):
            return {}
        return {r: max(seq for _, seq in w) for r, w in waits.items()}
    ranks_in: dict[object, set[int]] = defaultdict(set)
    for r, w in waits.items():
        for pg, _ in w:
            ranks_in[pg].add(r)
    pg = max(ranks_in, key=lambda g: (len(ranks_in[g]), str(g)))
    return {r: max(seq for g, seq in w if g == pg) for r, w in waits.items() if r in ranks_in[pg]}


@playbook("sequence_divergence", order=60)
def sequence_divergence(facts: Facts) -> Iterator[Match]:
    """From Flight Recorder, NCCL and watchdog records: which rank's collective sequence diverged?"""
    if facts.have_stacks:
        return  # live stacks say more; their sequence numbers join those findings as notes
    per_rank: dict[int, dict[int, object]] = defaultdict(dict)
    for r, v in facts.ranks.items():
        for c in v.collectives:
            if c.seq is not None and c.op not in ("send", "recv"):
                per_rank[r][c.seq] = c
    progress = {e.rank: e for e in facts.ev.events_of("work_progress") if e.rank is not None}
    last = _comparable_last(facts, progress)
    ws = facts.world_size or 0
    if len(last) < 2 and not (ws and last):
        return
    top = max(last.values())
    behind = sorted(r for r, s in last.items() if s < top)
    silent = sorted(set(range(ws)) - set(last)) if ws and len(last) >= ws // 2 else []
    # Same sequence number, different operation or size: a mismatch, not a skip.
    at_top = {r: per_rank[r].get(top) for r in last if last[r] == top and top in per_rank.get(r, {})}

    # What every rank's call at one number must share (an all-to-all's sizes may differ by design).
    def call(c) -> tuple:
        return (c.op, c.numel_in if c.op in _SAME_SIZE_OPS else None, c.dtype)

    kinds = {call(c) for c in at_top.values() if c is not None}
    if len(kinds) > 1 and not behind:
        sig: dict[tuple, list[int]] = defaultdict(list)
        for r, c in at_top.items():
            sig[call(c)].append(r)
        minority = min(sig.values(), key=len)
        yield Match(
            "collective_mismatch",
            0.82,
            Culprit(ranks=sorted(minority), hosts=facts.hosts_of(sorted(minority))),
            [c.quote for c in at_top.values() if c is not None and c.quote][:6],
            {**_crowd_ctx(facts), "ranks": sorted(minority), "detail": f"sequence number {top}", "ops": {}},
            status="hung",
            template="collective_mismatch",
        )
        return
    culprits = behind or silent
    if not culprits:
        return
    evidence = []
    for r in culprits + [r for r in last if r not in culprits][:2]:
        recs = per_rank.get(r, {})
        if recs:
            c = recs[max(recs)]
            if getattr(c, "quote", None):
                evidence.append(c.quote)
        if r in progress:
            evidence.append(progress[r].quote)
        printed = [e for e in facts.ev.events_of("collective_fingerprint") if e.rank == r]
        if printed and not recs:
            evidence.append(printed[-1].quote)
    evidence += [e.quote for e in facts.ev.events_of("watchdog_timeout")[:3]]  # the victims' side
    yield Match(
        "conditional_collective",
        0.75 if behind else 0.6,
        Culprit(ranks=culprits, hosts=facts.hosts_of(culprits)),
        evidence,
        {**_crowd_ctx(facts), "ranks": culprits, "last": last, "top": top, "silent": silent},
        status="hung",
    )


@playbook("gpu_fault", order=70)
def gpu_fault(facts: Facts) -> Iterator[Match]:
    """Did a GPU report a hardware or driver fault (Xid, ECC, fallen off the bus)?"""
    events = facts.ev.events_of("xid", "gpu_lost", "gpu_error", "nvidia_smi_failed")
    # nvidia-smi -q's memory errors (probes/nvidia_smi_q.py) and dcgmi diag's failed tests (probes/dcgmi_diag.py)
    events += facts.ev.events_of("gpu_memory_error", "dcgm_diag_fail")
    # Each line counts as its catalogue row reads it (an Xid NVIDIA files under the application, a driver notice,
    # DCGM's low-bandwidth test: no GPU fault of their own).
    events = votes(events, "gpu_fault")
    if not events:
        return
    # A line that names a GPU by its bus id but no host (nvidia-smi's "GPU is lost") is of the host whose own lines
    # (a kernel log's NVRM lines) name the same bus id, when exactly one does.
    bus_hosts: dict[str, set[str]] = defaultdict(set)
    for e in facts.ev.events:
        if e.host and (b := _bus_key(e.fields.get("bus_id"))):
            bus_hosts[b].add(e.host)
    by_host: dict[str | None, list[LogEvent]] = defaultdict(list)
    for e in events:
        host = e.host
        if host is None and len(known := bus_hosts.get(_bus_key(e.fields.get("bus_id")) or "", set())) == 1:
            host = next(iter(known))
        by_host[host].append(e)
    for host, evs in by_host.items():
        xids = sorted({int(e.fields["xid"]) for e in evs if isinstance(e.fields.get("xid"), int)})
        gpus = sorted({str(g) for e in evs if (g := e.fields.get("bus_id") or e.fields.get("gpu"))})
        severe = any(_gpu_severe(e) for e in evs)
        ranks = _ranks_on_gpus(facts, host, gpus)
        meanings = []
        for e in evs:
            m = e.fields.get("meaning") or _dcgm_meaning(e)
            if m and m not in meanings:
                meanings.append(m)
        actions = []
        for e in evs:
            a = e.fields.get("action")
            if a and a not in actions:
                actions.append(a)
        yield Match(
            "gpu_fault",
            0.95 if severe else 0.7,
            Culprit(
                ranks=ranks, hosts=[host] if host else [], gpus=[f"{host}:{g}" if host else g for g in gpus]
            ),
            [e.quote for e in evs] + _dcgm_warnings(facts, host, evs),
            {
                "host": host,
                "xids": xids,
                "gpus": gpus,
                "meanings": meanings,
                "actions": actions,
                "ranks": ranks,
                "severe": severe,
            },
            status="hung",
        )


_BUS_ID = lazy(r"(?:[0-9a-fA-F]{4,8}:)?([0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.[0-7])?")


def _bus_key(bus: object) -> str | None:
    """A PCI bus id as `bus:device`, whatever its domain and function (`0000:17:00.0`, `00000000:17:00.0`, `17:00`)."""
    m = _BUS_ID.fullmatch(str(bus).strip()) if bus else None
    return m.group(1).lower() if m else None


def _gpu_severe(e: LogEvent) -> bool:
    """A GPU line that settles the fault: its catalogue row is decisive (NVIDIA's resolution for that Xid is a reset
    or service, the GPU fell off the bus, ...); a line no row read, by its parser's reading (the Xid table's
    critical ones, a lost GPU, a driver nvidia-smi cannot reach)."""
    vote = row_vote(e, "gpu_fault")
    if vote != "parser":
        return vote == "decisive"
    return e.kind in ("gpu_lost", "nvidia_smi_failed") or e.fields.get("severity") == "critical"


def _dcgm_meaning(e: LogEvent) -> str | None:
    """A failed dcgmi diag test in words: the test, and the warning DCGM gave for that GPU."""
    if e.kind != "dcgm_diag_fail":
        return None
    warning = (e.fields.get("warnings") or [""])[0]
    return f"dcgmi diag {e.fields.get('test') or 'check'} failed" + (
        f": {warning.rstrip('.')}" if warning else ""
    )


def _dcgm_warnings(facts: Facts, host: str | None, evs: list[LogEvent]) -> list[Quote]:
    """The first line of each warning dcgmi diag gave for the GPUs whose tests failed."""
    failed = {(e.fields.get("test"), e.fields.get("gpu_index")) for e in evs if e.kind == "dcgm_diag_fail"}
    return [
        w.quote
        for w in facts.ev.events_of("dcgm_diag_warning")
        if w.host == host
        and ((w.fields.get("test"), w.fields.get("gpu_index")) in failed or w.fields.get("level") == "error")
    ]


def _ranks_on_gpus(facts: Facts, host: str | None, bus_ids: list[str]) -> list[int]:
    """Ranks whose process runs on these GPUs; else the ranks of that host that are gone (a GPU fault kills them)."""
    pids = {p for g in facts.ev.gpus if g.host == host and g.bus_id in bus_ids for p in g.pids}
    on = sorted(r for r, v in facts.ranks.items() if v.pid in pids and (host is None or v.host == host))
    if on or host is None:
        return on
    return sorted(r for r in set(facts.missing) | set(facts.exited) if facts.host_of(r) == host)


_ERROR_COUNTERS = (
    "SymbolErrorCounter",
    "LinkErrorRecoveryCounter",
    "LinkDownedCounter",
    "PortRcvErrors",
    "PortRcvRemotePhysicalErrors",
    "LocalLinkIntegrityErrors",
    "ExcessiveBufferOverrunErrors",
    "PortXmitDiscards",
)


@playbook("network_fault", order=80)
def network_fault(facts: Facts) -> Iterator[Match]:
    """Is the fabric at fault: IB errors in NCCL, a port down, error counters rising, a link down?"""
    ev = facts.ev
    # A completion flushed (IB status 5) only echoes the queue pair's first failure, often a peer that went away.
    # Each line counts as its catalogue row reads it (a non-fatal async event, a link coming up: no fault).
    nccl = votes(ev.events_of("nccl_ib_completion_error", "nccl_port_error"), "network_fault")
    nccl = [e for e in nccl if not flushed(e)]
    # A peer that stopped answering after a process crashed stopped because it crashed: rank_gone's, not the fabric's.
    crashes, clock = own_crashes(facts), Clock(ev.events)
    nccl = [e for e in nccl if not after_a_crash(e, crashes, clock)]
    links = votes(ev.events_of("nic_link"), "network_fault")
    links = [e for e in links if str(e.fields.get("state", "")).lower() in ("down", "unplugged")]
    down = [
        p
        for p in ev.ib_ports
        if (p.state or "").lower() not in ("", "active")
        or (p.phys_state or "").lower() in ("polling", "disabled", "down")
    ]
    rising = _rising_counters(facts)
    if not (nccl or links or down or rising):
        return
    # A completion error names the peer at the other end of the failing path: both ends are suspects.
    peers = [p for e in nccl if (p := peer_host(e))]
    hosts = sorted(
        {
            h
            for h in [e.host for e in nccl + links] + peers + [p.host for p in down] + [r[0] for r in rising]
            if h
        }
    )
    ports = sorted({f"{p.host}:{p.ca}/{p.port}" if p.host else f"{p.ca}/{p.port}" for p in down})
    ports += sorted({f"{h}:{ca}/{port}" if h else f"{ca}/{port}" for h, ca, port, _, _, _ in rising})
    ports += [x for e in nccl + links if (x := fabric_port(e))]
    evidence = [e.quote for e in nccl[:4]] + [e.quote for e in links[:2]]
    evidence += [p.quote for p in down if p.quote][:3]
    for _, _, _, _, _, q in rising[:3]:
        if q:
            evidence.append(q)
    conf = 0.9 if (nccl and (down or rising or links)) else 0.8
    yield Match(
        "network_fault",
        conf,
        Culprit(ranks=facts.ranks_on(hosts), hosts=hosts, links=list(dict.fromkeys(ports))),
        evidence,
        {
            "hosts": hosts,
            "ports": list(dict.fromkeys(ports)),
            "nccl_errors": len(nccl),
            "down": [f"{p.ca}/{p.port} {p.state}/{p.phys_state}" for p in down],
            "rising": [f"{ca}/{port} {name} {a} -> {b}" for _, ca, port, name, (a, b), _ in rising],
        },
        status="hung",
    )


def _rising_counters(facts: Facts) -> list[tuple]:
    samples: dict[tuple, list] = defaultdict(list)
    for p in facts.ev.ib_ports:
        if p.counters:
            samples[(p.host, p.ca, p.port)].append(p)
    out = []
    for (host, ca, port), ps in samples.items():
        if len(ps) < 2:
            continue
        ps.sort(key=lambda p: p.sampled_at or 0)
        first, last = ps[0], ps[-1]
        for name in _ERROR_COUNTERS:
            a, b = first.counters.get(name), last.counters.get(name)
            if a is not None and b is not None and b > a:
                out.append((host, ca, port, name, (a, b), last.quote))
    return out


@playbook("straggler", order=90)
def straggler(facts: Facts) -> Iterator[Match]:
    """Is the job still moving, only held back by one slow rank?"""
    if not facts.progressing:
        return
    sampled = {r: v for r, v in facts.ranks.items() if len(v.locations) >= 2 and v.alive}
    if len(sampled) < 2:
        return
    waiting = {r: v.fraction_in(set(WAITING)) for r, v in sampled.items()}
    slowest = min(waiting.values())
    others = sorted(f for r, f in waiting.items() if f != slowest)
    culprits = sorted(r for r, f in waiting.items() if f == slowest)
    if not others or len(culprits) > max(1, len(sampled) // 4) or (others[len(others) // 2] - slowest) < 0.3:
        return
    cpu = {r: v.delta("cpu_seconds") for r, v in sampled.items()}
    evidence = [q for r in culprits for v in [sampled[r]] for loc in v.locations[-2:] if (q := loc.quote)]
    evidence += _crowd_quotes(facts)
    yield Match(
        "straggler",
        0.8,
        Culprit(ranks=culprits, hosts=facts.hosts_of(culprits)),
        evidence,
        {
            **_crowd_ctx(facts),
            "ranks": culprits,
            "waiting": {r: round(f * 100) for r, f in waiting.items()},
            "cpu": cpu,
            "where": {r: sampled[r].location.describe() for r in culprits},
        },
        status="progressing",
    )


@playbook("rank_exception", order=95)
def rank_exception(facts: Facts) -> Iterator[Match]:
    """Offline: did a rank raise while the others waited (a timeout names the victims, the traceback the culprit)?"""
    if facts.have_stacks:
        return
    excs = [
        e
        for e in facts.ev.events_of("exception")
        if e.rank is not None and not _is_comm_error(e) and not _means_another_cause(e)
    ]
    # Deaths a process announces itself: a CUDA OOM, a CUDA error (illegal access), a segfault, the OOM killer.
    excs += [
        e for e in facts.ev.events_of(*_FATAL_KINDS) if e.rank is not None and not watchdog_abort(facts.ev, e)
    ]
    timeouts = facts.ev.events_of("watchdog_timeout", "gloo_timeout", "connection_closed")
    victims = {e.rank for e in timeouts if e.rank is not None}
    fatal_ranks = {e.rank for e in excs if e.kind in _FATAL_KINDS}
    first = [e for e in excs if e.rank not in victims or e.rank in fatal_ranks]
    if not first:
        yield from _process_raised(facts, timeouts)
        return
    ranks = sorted({e.rank for e in first if e.rank is not None})
    if all(e.kind == "exception" and in_setup(e) for e in first):
        yield _setup_failed(first)
        return
    hardware = [e for e in first if _HW_WORDS.search(str(e.fields.get("error", "")) + e.quote.text)]
    yield Match(
        "gpu_fault" if hardware and len(hardware) == len(first) else "rank_crashed",
        0.7,
        Culprit(ranks=ranks, hosts=_hosts_of_events(first)),
        [e.quote for e in first[:4]] + [e.quote for e in timeouts[:2]],
        {
            **_crowd_ctx(facts),
            "ranks": ranks,
            "missing": [],
            "exited": ranks,
            "survivors": sorted(victims),
            "causes": [e.quote.text for e in first][:3],
            "oom": any("OutOfMemory" in str(e.fields.get("exc_type", "")) for e in first),
        },
        status="failed",
        template="rank_gone",
    )


def _process_raised(facts: Facts, timeouts: list[LogEvent]) -> Iterator[Match]:
    """A traceback that names no rank and ends in an exception of the process's own (not a timeout, a lost peer, a
    store or NCCL error: the waiting side's words; not Ctrl-C, whose traceback is where the process was stuck):
    Python printed it because nothing caught the exception, so that process is gone. In a job that then hangs the
    others wait for it: a dead rank, which one the text does not say."""
    raised = [
        e
        for e in facts.ev.events_of("exception")
        if e.rank is None
        and str(e.fields.get("exc_type", "")) not in _NOT_A_DEATH
        and not _means_another_cause(e)
    ]
    if not raised or set(facts.ranks) - {e.rank for e in timeouts}:
        return  # ranks the text names beside the waiters: the playbooks that read them decide
    if in_setup(raised[-1]):
        # Raised under process-group set-up, whatever its words (a store's timeout, "host not found").
        yield _setup_failed([raised[-1]])
        return
    own = [e for e in raised if not _is_comm_error(e) and not _WAITING_SIDE.search(e.quote.text)]
    if not own:
        return
    e = own[-1]  # the last uncaught exception: the one the process ended on
    # An exception about another process (Ray's ActorDiedError names the dead actor's pid and node under its
    # message): that process is the culprit, not the one that printed it, which survived to say so.
    peer = _peer_of(e)
    peer_pid = e.fields.get("peer_pid") if isinstance(e.fields.get("peer_pid"), int) else None
    about_another = peer is not None or peer_pid is not None
    yield Match(
        "rank_crashed",
        0.5,
        Culprit(
            hosts=[peer]
            if peer
            else []
            if about_another
            else sorted(set(_hosts_of_events([e])) | set(_hosts_told_around(facts, e))),
            processes=[f"{peer + ' ' if peer else ''}pid {peer_pid}"] if peer_pid is not None else [],
        ),
        [e.quote] + [t.quote for t in timeouts[:2]],
        {
            "exc": e.quote.text,
            "exc_type": str(e.fields.get("exc_type", "")),
            "survivors": sorted({t.rank for t in timeouts if t.rank is not None}),
            "oom": "OutOfMemory" in str(e.fields.get("exc_type", "")),
            "about_another": about_another,
            "peer": peer,
            "peer_pid": peer_pid,
        },
        status="failed",
        template="process_raised",
    )


_MESSAGE_LINES = 3  # lines an exception's message may go on for after its first


_REMOTE_TRACE_LINES = 400  # how far above an exception a remote task's header (RayTaskError) may stand


def _peer_of(e: LogEvent) -> str | None:
    """The node of the process an exception is about when that is another process (Ray's ActorDiedError names the
    dead actor's `ip:` under its message), never a loopback address."""
    p = peer_host(e)
    return p if p and not loopback(p) else None


def _hosts_told_around(facts: Facts, e: LogEvent) -> list[str]:
    """Hosts the lines around an exception name as where it happened: a crash line right after it (its message
    going on: Ray's OutOfMemoryError with `Memory on the node (IP: ...)`, the node whose memory monitor killed the
    worker), or the last RayTaskError header above it (`ray::Worker.method() (pid=N, ip=X, ...)`: the remote
    traceback under it, which ends in this exception, ran in that worker on that node)."""
    out = []
    remote: LogEvent | None = None
    for o in facts.ev.events:
        if o is e or o.quote.source != e.quote.source:
            continue
        gap = o.quote.line - e.quote.line
        if 0 < gap <= _MESSAGE_LINES and o.fields.get("signal_category") == "rank_crashed":
            host = o.fields.get("node") or o.fields.get("own_host") or o.host
            if isinstance(host, str) and host:
                out.append(host)
        elif o.kind == "ray_task_error" and -_REMOTE_TRACE_LINES <= gap < 0:
            if remote is None or o.quote.line > remote.quote.line:
                remote = o
    if not out and remote is not None and isinstance(remote.fields.get("node"), str):
        out.append(str(remote.fields["node"]))
    return out


# Functions of process-group set-up (torch.distributed, its rendezvous and store, and the frameworks' wrappers around
# them): an exception raised under one of them is a job that never got its ranks connected.
_SETUP_FUNCS = frozenset({
    "init_process_group", "_env_rendezvous_handler", "_tcp_rendezvous_handler", "_file_rendezvous_handler",
    "rendezvous", "_create_c10d_store", "_store_based_barrier", "init_device_mesh", "_init_process_group",
    "init_distributed", "initialize_model_parallel", "_rendezvous", "next_rendezvous", "_initialize_workers",
    "init_dist", "_init_dist_pytorch", "_init_dist_slurm", "setup_distributed", "_setup_distributed",
})  # fmt: skip


def _means_another_cause(e: LogEvent) -> bool:
    """An exception whose message a catalogue row reads, decisively, as another cause than the process's own death
    (Horovod's "Mismatched ALLREDUCE ...": the ranks disagree on a collective, and every rank raises it)."""
    return e.fields.get("signal_strength") == "decisive" and e.fields.get("signal_category") not in (
        None,
        "rank_crashed",
    )


def _setup_frame(e: LogEvent) -> str | None:
    """The innermost set-up function (one of _SETUP_FUNCS) the exception's traceback passed through, if any."""
    for f in reversed(e.fields.get("frames") or []):  # frames are outermost first
        func = str(f).rsplit(" in ", 1)[-1].strip()
        if func in _SETUP_FUNCS:
            return func
    return None


def in_setup(e: LogEvent) -> bool:
    """Was the exception raised inside process-group set-up?"""
    return _setup_frame(e) is not None


def _setup_failed(excs: list[LogEvent]) -> Match:
    """A process's exception raised while it set up the process group: the job never got through set-up."""
    e = excs[-1]
    where = _setup_frame(e) or "init_process_group"
    return Match(
        "comm_init_failure",
        0.6,
        Culprit(ranks=sorted({x.rank for x in excs if x.rank is not None}), hosts=_hosts_of_events(excs)),
        [x.quote for x in excs[:3]],
        {"exc": e.quote.text, "where": where},
        status="failed",
        template="setup_raised",
    )


# Exceptions whose traceback is not a death of the program's own making: Ctrl-C on a hung job (its traceback is
# where it waited), a requested exit.
_NOT_A_DEATH = frozenset({"KeyboardInterrupt", "SystemExit", "GeneratorExit"})
# The waiting side's exceptions beyond _is_comm_error's words: c10d's store, rendezvous and socket errors.
_WAITING_SIDE = lazy(
    r"Dist(?:Backend|Store|Network)Error|rendezvous|TCPStore|socket|broken pipe|reset by peer|barrier", re.I
)


_FATAL_KINDS = ("cuda_oom", "cuda_error", "segfault", "oom_kill")
# A CUDA error that means the GPU itself failed, not the program.
_HW_WORDS = lazy(r"uncorrectable ECC|ECC error|fallen off the bus|GPU is lost|Xid", re.I)


def _is_comm_error(e: LogEvent) -> bool:
    text = e.quote.text.lower()
    return any(w in text for w in ("timed out", "timeout", "connection", "watchdog", "nccl", "gloo", "peer"))


_ERROR_KINDS = (
    "watchdog_timeout",
    "gloo_timeout",
    "exception",
    "connection_closed",
    "nccl_warn",
    "nccl_timeout",
)


def _waiting_unranked(facts: Facts) -> list[str]:
    """Stacks that name no rank, every one waiting in a collective or point-to-point call: the waiting side."""
    from hangdx.playbooks.partial import seen_processes

    if facts.ranks:
        return []
    procs = [p for p in seen_processes(facts) if p.location is not None]
    if not procs or any(p.location.kind not in ("collective", "p2p") for p in procs):
        return []
    return [f"{p.name()} is {p.location.describe()}" for p in procs[:4]]


@playbook("what_next", order=100)
def what_next(facts: Facts) -> Iterator[Match]:
    """When nothing fits: say what was seen and what to collect next."""
    if facts.progressing and facts.have_stacks:
        status = "progressing"
    elif facts.progressing is False:
        status = "hung"
    else:
        status = None
    yield Match(
        "unknown",
        0.1,
        Culprit(),
        [q for r in facts.odd_ranks[:2] for q in _loc_quote(facts.ranks[r])] + _crowd_quotes(facts, 1),
        {
            **_crowd_ctx(facts),
            "have_stacks": facts.have_stacks,
            "ranks_seen": sorted(set(facts.ranks) | {e.rank for e in facts.ev.events if e.rank is not None}),
            "errors": [e.quote.text for e in facts.ev.events_of(*_ERROR_KINDS)][:2],
            "gaps": [f"{g.source}: {g.message}" for g in facts.ev.gaps][:5],
            "odd": {r: facts.ranks[r].location.describe() for r in facts.odd_ranks},
            "live": facts.ev.live,
            "waiting_unranked": _waiting_unranked(facts),
            # Only some ranks' stacks, all waiting with their peers: the side that waits, not the one it waits for.
            "partial_wait": bool(
                facts.have_stacks
                and not facts.odd_ranks
                and facts.crowd is not None
                and facts.crowd.kind in ("collective", "p2p")
                and (facts.world_size is None or len(facts.crowd_ranks) < facts.world_size)
            ),
        },
        status=status,
    )


_DEAD_KINDS = {"timeout", "unreachable", "hung"}


@playbook("host_unreachable", order=5)
def host_unreachable(facts: Facts) -> Iterator[Match]:
    """Could every host be probed? A node that does not answer may be the dead one."""
    problems = facts.ev.host_problems
    if not problems:
        return
    dead = [p for p in problems if p.kind in _DEAD_KINDS]
    blocked = [p for p in problems if p.kind not in _DEAD_KINDS]

    def unseen(ps: list) -> list[int]:
        hosts = {p.host for p in ps}
        on = [m for m in facts.missing if facts.host_of(m) in hosts]
        return on or [m for m in facts.missing if facts.host_of(m) is None]

    if dead and unseen(dead):
        # Ranks nobody saw, on hosts that do not answer at all: the node (or its ranks) went down.
        yield Match(
            "rank_crashed",
            0.8,
            Culprit(ranks=unseen(dead), hosts=sorted({p.host for p in dead})),
            [Quote(f"{p.host}/ssh", 0, p.message) for p in dead] + _crowd_quotes(facts),
            {**_crowd_ctx(facts), "problems": dead, "missing": unseen(dead), "dead": True},
            status="hung",
            template="host_unreachable",
        )
    else:
        blocked = problems
    if blocked:
        yield Match(
            "unknown",
            0.35,
            Culprit(ranks=unseen(blocked), hosts=sorted({p.host for p in blocked})),
            [Quote(f"{p.host}/ssh", 0, p.message) for p in blocked],
            {**_crowd_ctx(facts), "problems": blocked, "missing": unseen(blocked), "dead": False},
            template="host_unreachable",
        )


def _idle_gpus(facts: Facts) -> list:
    """GPUs at ~0% while most of the job's GPUs are busy: the waiting ranks' NCCL kernels spin at 100%."""
    gpus = [g for g in facts.ev.gpus if g.util_pct is not None]
    if len(gpus) < 3:
        return []
    busy = [g for g in gpus if g.util_pct >= 80]
    idle = [g for g in gpus if g.util_pct <= 5]
    if len(busy) < 2 * len(idle) or not idle or len(idle) > max(1, len(gpus) // 4):
        return []
    return idle


def _rank_of_gpu(facts: Facts, gpu) -> int | None:
    for r, v in facts.ranks.items():
        if v.pid in gpu.pids and (gpu.host is None or v.host == gpu.host):
            return r
    return None


@playbook("gpu_idle_outlier", order=52)
def gpu_idle_outlier(facts: Facts) -> Iterator[Match]:
    """Which GPU sits at 0% while the others spin at 100% in a collective, and which rank owns it?"""
    idle = _idle_gpus(facts)
    if not idle or not _hung(facts):
        return
    busy = sum(1 for g in facts.ev.gpus if (g.util_pct or 0) >= 80)
    # The busy GPUs' power says whether they compute or spin: at a fraction of their limit they spin in NCCL,
    # which makes the idle one surely the rank the collective waits for (playbooks/partial.py).
    from hangdx.playbooks.partial import spinning_gpus

    spinning = len(spinning_gpus(facts))
    for g in idle:
        rank = _rank_of_gpu(facts, g)
        gpu_id = g.bus_id or f"GPU{g.index}"
        gpu_name = f"{g.host}:{gpu_id}" if g.host else gpu_id  # as gpu_fault names GPUs: host:bus id
        ranks = [rank] if rank is not None else []
        where = (
            facts.ranks[rank].location.describe() if rank is not None and facts.ranks[rank].locations else ""
        )
        evidence = [g.quote] if g.quote else []
        if rank is not None:
            evidence += _loc_quote(facts.ranks[rank])
        loc = facts.ranks[rank].location if rank is not None and facts.ranks[rank].locations else None
        category = "conditional_collective"
        if loc is not None and loc.kind in _ELSEWHERE:
            category = _ELSEWHERE[loc.kind][0]
        # nvidia-smi lists each GPU's processes: the idle GPU has none while the busy ones have theirs, yet its
        # memory is still allocated: its process left (died, or is stuck exiting) and the others wait for it.
        orphaned = (
            loc is None
            and not g.pids
            and (g.mem_used_mib or 0) > 1024
            and any(o.pids for o in facts.ev.gpus if o is not g and o.host == g.host)
        )
        if orphaned:
            category = "rank_crashed"
        yield Match(
            category,
            (0.8 if loc is not None and loc.kind not in WAITING else 0.62)
            + (0.06 if spinning >= busy / 2 else 0.0),
            Culprit(ranks=ranks, hosts=[g.host] if g.host else [], gpus=[gpu_name]),
            evidence + _crowd_quotes(facts, 1),
            {
                **_crowd_ctx(facts),
                "gpu": f"GPU {g.index} ({g.bus_id}) on {g.host}" if g.host else f"GPU {g.index} ({g.bus_id})",
                "util": g.util_pct,
                "busy": busy,
                "rank": rank,
                "where": where,
                "spinning": spinning,
                "orphaned": orphaned,
                "mem_gib": round((g.mem_used_mib or 0) / 1024, 1),
            },
            status="hung",
            template="gpu_idle_outlier",
        )


_FABRIC_IF = ("ib", "eth", "en", "bond", "mlx", "hsn", "roce")


@playbook("mtu_mismatch", order=85)
def mtu_mismatch(facts: Facts) -> Iterator[Match]:
    """Do the nodes agree on the MTU of each fabric interface?"""
    by_if: dict[str, dict[str, object]] = defaultdict(dict)
    for link in facts.ev.links:
        if link.host and link.mtu and link.ifname.startswith(_FABRIC_IF) and (link.state or "UP") != "DOWN":
            by_if[link.ifname][link.host] = link
    for ifname, hosts in sorted(by_if.items()):
        if len(hosts) < 2:
            continue
        mtus: dict[int, list[str]] = defaultdict(list)
        for host, link in hosts.items():
            mtus[link.mtu].append(host)
        if len(mtus) < 2:
            continue
        common = max(mtus, key=lambda m: (len(mtus[m]), m))
        odd_hosts = sorted(h for m, hs in mtus.items() if m != common for h in hs)
        yield Match(
            "network_fault",
            0.8,
            Culprit(
                ranks=facts.ranks_on(odd_hosts), hosts=odd_hosts, links=[f"{h}:{ifname}" for h in odd_hosts]
            ),
            [hosts[h].quote for h in odd_hosts if hosts[h].quote]
            + [hosts[h].quote for h in mtus[common][:1] if hosts[h].quote],
            {
                "ifname": ifname,
                "odd": {h: hosts[h].mtu for h in odd_hosts},
                "common": common,
                "common_hosts": mtus[common],
            },
            status="hung",
            template="mtu_mismatch",
        )
