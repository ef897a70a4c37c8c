"""What NCCL's own words settle, with or without ranks: a set-up that failed, a socket that broke on the data path,
processes whose last NCCL calls are point-to-point.

NCCL names the stage of a failure itself (probes/nccl_log.py and probes/nccl_error.py read it into an event's
`stage`): a bootstrap or socket set-up failure, or an error raised from ncclCommInitRank*, means the communicator
never got set up, whatever rank printed it; a send or receive that fails in the proxy thread after set-up is the
network failing under a running job. A log whose processes stop in Send/Recv is waiting on a peer's matching call.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from hangdx.playbooks.engine import Match, playbook
from hangdx.playbooks.facts import Facts
from hangdx.playbooks.signals import lost_peer, peer_host
from hangdx.playbooks.verdict import Culprit
from hangdx.probes.model import CollectiveRecord, LogEvent, Quote
from hangdx.probes.rx import lazy

_FAILURES = ("nccl_error", "nccl_warn", "nccl_conn_refused", "nccl_timeout")
_NETWORK_WORDS = lazy(r"[Ss]ocket|[Bb]ootstrap|interface|[Cc]onnect|AF_INET|[Aa]ddress")
_TRACE_ONLY = lazy(r"^(?:\S+:\d+ )?\S+:\d+ ?-> ?\d+")  # `transport.cu:153 ->2 [Proxy thread error]`


def _quotes(e: LogEvent) -> list[Quote]:
    """The event's line, and the lines that continue its message (`Last error:` and what follows)."""
    lines = e.fields.get("lines") or []
    out = [Quote(e.quote.source, int(no), str(text)) for no, text in lines if isinstance(no, int)]
    return out or [e.quote]


def _hosts(events: list[LogEvent]) -> list[str]:
    hosts = sorted({e.host for e in events if e.host})
    named = [h for h in hosts if not h.isdigit()]  # `[15]23:83:2526`: a cut prefix, not a host
    return named or hosts


def _message(e: LogEvent) -> str:
    return str(e.fields.get("last_error") or e.fields.get("message") or e.fields.get("error") or e.quote.text)


_INIT_NEAR = 20  # lines: an NCCL failure this close after a communicator's creation began is that creation's


def _after_init(facts: Facts, e: LogEvent) -> bool:
    """An NCCL failure that names no stage, printed just after the process began creating a communicator (the last
    event of its source before it is a `comm_init_start`: vLLM's `vLLM is using nccl==`, DeepSpeed's `Initializing
    TorchBackend`): the creation failed."""
    if e.fields.get("stage") is not None:
        return False
    before = [
        x
        for x in facts.ev.events
        if x.quote.source == e.quote.source
        and x.quote.line < e.quote.line
        and (x.rank == e.rank or x.rank is None)
    ]
    if not before:
        return False
    last = max(before, key=lambda x: x.quote.line)
    return last.kind == "comm_init_start" and e.quote.line - last.quote.line <= _INIT_NEAR


@playbook("nccl_setup_failed", order=21)
def nccl_setup_failed(facts: Facts) -> Iterator[Match]:
    """Did NCCL itself say that communicator set-up failed (bootstrap, socket interface, ncclCommInitRank)?"""
    events = [
        e
        for e in facts.ev.events_of(*_FAILURES)
        if (e.fields.get("stage") == "init" or _after_init(facts, e))
        # A failure whose own row reads it as the GPU's or the fabric's (an NVLS multicast call, an ECC error)
        # happened during set-up, but set-up is not what failed: read as what its row says (as nccl_trace_in_setup).
        and e.fields.get("signal_category") != "gpu_fault"
    ]
    if not events:
        return
    ranks = sorted({e.rank for e in events if e.rank is not None})
    settings = [e for e in facts.ev.events_of("nccl_net") if e.fields.get("setting")]
    ifnames: dict[str, str] = {}
    for e in settings:
        ifnames.setdefault(str(e.fields["setting"]), str(e.fields.get("devices")))
    texts = " ".join(_message(e) + " " + e.quote.text for e in events)
    evidence = [q for e in events[:3] for q in _quotes(e)] + [e.quote for e in settings[:1]]
    said = any(e.fields.get("stage") == "init" for e in events)  # NCCL's own words, not only the moment
    yield Match(
        "comm_init_failure",
        0.88 if said else 0.7,
        Culprit(ranks=ranks, hosts=_hosts(events)),
        evidence,
        {
            "ranks": ranks,
            "hosts": _hosts(events),
            "reason": _message(events[0])[:300],
            "function": next((e.fields["function"] for e in events if e.fields.get("function")), None),
            "ifnames": ifnames,
            "ifname_hosts": _hosts(settings),
            "network": bool(ifnames or _NETWORK_WORDS.search(texts)),
        },
        status="failed",
    )


@playbook("nccl_socket_fault", order=81)
def nccl_socket_fault(facts: Facts) -> Iterator[Match]:
    """Did an NCCL socket send or receive fail on the data path (the proxy thread), after set-up?"""
    events = [e for e in facts.ev.events_of(*_FAILURES) if e.fields.get("stage") == "data"]
    # NCCL's `message truncated` is no socket fault: it is the transport's size check between matched operations
    # (net_socket.cc returns ncclInvalidUsage), which its catalogue row reads as a collective size mismatch.
    failures = [
        e
        for e in events
        if not _TRACE_ONLY.match(str(e.fields.get("message") or ""))
        and e.fields.get("signal_event") != "collective_mismatch"
    ]
    if not failures:
        return
    ranks = sorted({e.rank for e in failures if e.rank is not None})
    peers = sorted({str(e.fields["peer"]) for e in failures if e.fields.get("peer")})
    # A send or receive that failed between two hosts (timed out, no route): both ends are suspects, the peer
    # without its port. A peer that closed or reset the connection went away: that is its end, not a link's.
    hosts = sorted(set(_hosts(failures)) | {p for e in failures if not lost_peer(e) and (p := peer_host(e))})
    closed = all("closed by remote peer" in e.quote.text.lower() for e in failures)
    errors = list(dict.fromkeys(str(e.fields.get("error") or e.fields.get("message")) for e in failures))
    yield Match(
        "network_fault",
        0.7 if closed else 0.8,  # a peer that closed its socket may simply have died
        Culprit(ranks=ranks, hosts=hosts),
        [e.quote for e in failures[:4]] + [e.quote for e in events if e not in failures][:2],
        {"hosts": hosts, "ranks": ranks, "peers": peers, "errors": errors[:3], "closed": closed},
        status="hung",
    )


# -- an interface the other nodes cannot reach, in a set-up that never finished -------------------------------

# NCCL's own automatic choice (src/misc/socket.cc, ncclFindInterfaces) skips interfaces named `docker*`, `lo*` and
# `virbr*` unless nothing else is up, and takes every other up interface as it is: a container's `veth*` end, a
# Linux bridge `br-*`, an overlay (`flannel*`, `cali*`, `cni*`, `vxlan*`, `weave`, `tun*`). Those, loopback and a
# link-local address (`fe80::`, `169.254.`) do not route to another node, so a communicator whose socket transport
# or bootstrap uses one cannot connect across nodes: set-up hangs or fails (NCCL's troubleshooting guide: set
# NCCL_SOCKET_IFNAME).
_VIRTUAL_IF = lazy(r"(?:docker|veth|br-|virbr|cni|flannel|cali|vxlan|weave|tun|lo)[\w.\-]{0,24}$")
_IF_ENTRY = lazy(r"(?:\[\d{1,3}\])?([\w.\-]{1,32}):([0-9A-Fa-f:.]{2,64})(?:%[\w.\-]{1,32})?(?:<\d{1,6}>)?")


def _unroutable(devices: str) -> list[str]:
    """The `name:address` entries of an NCCL `Using` list that another node cannot reach."""
    out = []
    for m in _IF_ENTRY.finditer(devices):
        name, addr = m.group(1), m.group(2).lower()
        if _VIRTUAL_IF.match(name) or addr.startswith(("fe80:", "169.254.", "127.", "::1")):
            out.append(f"{name}:{addr}")
    return out


@playbook("nccl_unroutable_interface", order=22)
def nccl_unroutable_interface(facts: Facts) -> Iterator[Match]:
    """Did NCCL set up its sockets on an interface other nodes cannot reach, and no process finish set-up?"""
    using = [
        e for e in facts.ev.events_of("nccl_net") if e.fields.get("devices") and not e.fields.get("setting")
    ]
    bad = [(e, _unroutable(str(e.fields["devices"]))) for e in using]
    bad = [(e, b) for e, b in bad if b]
    if not bad:
        return
    # Past set-up somewhere (a communicator's `Init COMPLETE`, a collective NCCL logged): the interface worked, or
    # the job is single-node and never used it; either way not this.
    if facts.ev.collectives or any(e.fields.get("complete") for e in facts.ev.events_of("nccl_init")):
        return
    ifaces = list(dict.fromkeys(i for _, b in bad for i in b))
    events = [e for e, _ in bad]
    hosts = _hosts(events)
    yield Match(
        "comm_init_failure",
        0.55,
        Culprit(ranks=sorted({e.rank for e in events if e.rank is not None}), hosts=hosts),
        [e.quote for e in events[:3]],
        {
            "ifaces": ifaces[:4],
            "hosts": hosts,
            "all_bad": all(len(b) == len(_IF_ENTRY.findall(str(e.fields["devices"]))) for e, b in bad),
        },
        status="hung",
    )


# -- point-to-point calls a process stopped in ------------------------------------------------------------------

_P2P = ("send", "recv")


def _process_name(c: CollectiveRecord) -> str:
    parts = [
        c.host or "",
        f"pid {c.pid}" if c.pid is not None else "",
        f"cudaDev {c.device}" if c.device is not None else "",
    ]
    return " ".join(p for p in parts if p) or "the process"


def _own_rank(calls: list[CollectiveRecord]) -> int | None:
    """A process's rank in the one communicator its calls use: NCCL's own, or the other end of a 2-rank one."""
    comms = {c.pg for c in calls}
    if len(comms) != 1:
        return None
    known = {c.rank for c in calls if c.rank is not None}
    if len(known) == 1:
        return known.pop()
    nranks = {c.sizes.get("nranks") for c in calls}
    peers = {c.sizes.get("root") for c in calls}
    if nranks == {2} and len(peers) == 1 and peers <= {0, 1}:
        return 1 - int(peers.pop())  # type: ignore[arg-type]
    return None


@playbook("nccl_p2p_wait", order=46)
def nccl_p2p_wait(facts: Facts) -> Iterator[Match]:
    """NCCL logs: do the processes' last NCCL calls stop in point-to-point Send/Recv?"""
    if facts.have_stacks:
        return  # the stacks say where each rank waits (p2p_deadlock)
    per: dict[tuple, list[CollectiveRecord]] = defaultdict(list)
    for c in facts.ev.collectives:
        if c.origin == "nccl_log" and c.quote is not None and isinstance(c.sizes, dict):
            per[(c.quote.source, c.host, c.pid, c.device)].append(c)
    if not per:
        return
    tails: dict[tuple, list[CollectiveRecord]] = {}
    for key, calls in per.items():
        calls.sort(key=lambda c: c.quote.line if c.quote else 0)
        if calls[-1].op not in _P2P:
            return  # some process's last call is a collective: the sequence playbooks compare them
        run: list[CollectiveRecord] = []
        for c in reversed(calls):
            if c.op not in _P2P:
                break
            run.append(c)
        tails[key] = run[::-1]
    widest = max(
        [int(c.sizes.get("nranks") or 0) for calls in per.values() for c in calls]
        + [
            int(e.fields["nranks"])
            for e in facts.ev.events_of("nccl_init")
            if isinstance(e.fields.get("nranks"), int)
        ]
    )
    own = {k: _own_rank(run) for k, run in tails.items()}
    # Ranks in a communicator are job ranks only when it is the widest the evidence shows and each process's
    # place in it is known.
    global_ranks = all(r is not None for r in own.values()) and all(
        c.sizes.get("nranks") == widest for run in tails.values() for c in run
    )
    ranks: set[int] = set()
    if global_ranks:
        for k, run in tails.items():
            ranks.add(own[k])  # type: ignore[arg-type]
            ranks |= {int(c.sizes["root"]) for c in run if isinstance(c.sizes.get("root"), int)}
    # Two processes each sending to (or each receiving from) the other: both wait on a call the peer never posts.
    crossed = False
    if global_ranks and len(tails) >= 2:
        last = {own[k]: run[-1] for k, run in tails.items()}
        crossed = any(
            a.op == b.op and b.sizes.get("root") == ra and a.sizes.get("root") == rb
            for ra, a in last.items()
            for rb, b in last.items()
            if ra != rb
        )
    procs = [
        {
            "name": _process_name(run[-1]),
            "rank": own[k] if global_ranks else None,
            "ops": [c.op for c in run],
            "last": run[-1].op,
            "peer": run[-1].sizes.get("root"),
            "comms": len({c.pg for c in run}),
            "nranks": run[-1].sizes.get("nranks"),
        }
        for k, run in tails.items()
    ]
    evidence = [q for run in tails.values() for c in run[-3:] if (q := c.quote)]
    yield Match(
        "p2p_deadlock",
        0.8 if crossed else (0.7 if len(tails) >= 2 else 0.6),
        Culprit(
            ranks=sorted(ranks),
            hosts=sorted({c.host for run in tails.values() for c in run if c.host}),
            processes=[] if global_ranks else [p["name"] for p in procs],
        ),
        evidence,
        {"procs": procs, "ranks": sorted(ranks), "crossed": crossed, "named": global_ranks},
        status="hung",
    )


# -- NCCL's own error trace through its set-up code -------------------------------------------------------------

# checks.h prints each level of an error's way up as `file:line -> code`; a trace that passes through src/init.cc
# (ncclCommInitRank and the transports it connects) or src/bootstrap.cc began during communicator set-up (a socket,
# a buffer that could not be allocated). net_ib's own init.cc (transport/net_ib/init.cc) is not that; nor is a CUDA
# call that failed for another reason than memory (a GPU or driver fault, which its own row reads).
_SETUP_TRACE = lazy(r"(?:^|(?<=[^\w/])|(?<=/src/)|(?<=^src/))(?:init|bootstrap)\.cc$")
_TRACE_NEAR = 8  # lines: the trace follows the WARN that began it


@playbook("nccl_trace_in_setup", order=23)
def nccl_trace_in_setup(facts: Facts) -> Iterator[Match]:
    """Did an NCCL error's own back trace run up through communicator set-up (init.cc, bootstrap.cc)?"""
    traces = facts.ev.events_of("nccl_check_trace")
    setup = [t for t in traces if _SETUP_TRACE.search(str(t.fields.get("file") or ""))]
    if not setup:
        return
    t = setup[0]
    # The first line of t's own trace: the trace lines run on, at most a line apart, up to t.
    same = sorted((x for x in traces if x.quote.source == t.quote.source), key=lambda x: x.quote.line)
    first = t
    for x in reversed([x for x in same if x.quote.line < t.quote.line]):
        if first.quote.line - x.quote.line > 2:
            break
        first = x
    began = [
        e
        for e in facts.ev.events
        if e.quote.source == t.quote.source
        and e.kind != "nccl_check_trace"
        and 0 <= first.quote.line - e.quote.line <= _TRACE_NEAR
        and ("WARN" in e.quote.text or e.kind in _FAILURES or e.fields.get("signal_category"))
    ]
    if not began:
        return
    cause = began[-1]
    if cause.fields.get("signal_category") == "gpu_fault":
        return  # a CUDA call that failed in set-up (not for want of memory) is the GPU's or driver's: read as such
    yield Match(
        "comm_init_failure",
        0.8,
        Culprit(
            ranks=[cause.rank] if cause.rank is not None else [], hosts=[cause.host] if cause.host else []
        ),
        [cause.quote, first.quote, t.quote],
        {
            "reason": _message(cause)[:300],
            "file": str(t.fields.get("file")),
            "oom": "out of memory" in cause.quote.text,
        },
        status="failed",
    )


# Lines that may follow the results' header (a closing fence, a blank) and it still be the end.
_STALL_TRAILING = 2


@playbook("nccl_tests_stalled", order=66)
def nccl_tests_stalled(facts: Facts) -> Iterator[Match]:
    """nccl-tests printed its results' header (its communicators made) and not one size's row, and the text ends
    there: the first collective's warm-up never finished. With every GPU in one process's host, no network is in the
    path: the GPUs' peer-to-peer path is what NCCL's troubleshooting guide names first (PCIe ACS, the IOMMU)."""
    for e in facts.ev.events_of("nccl_tests_stalled"):
        end = facts.ev.last_lines.get(e.quote.source)
        hosts = [str(h) for h in e.fields.get("hosts") or []]
        if end is None or end - e.quote.line > _STALL_TRAILING:
            continue  # lines follow the header: the text goes on
        one_host = e.fields.get("one_host", len(hosts) == 1)
        if facts.ev.events_of(*_FAILURES) or not one_host or int(e.fields.get("gpus") or 0) < 2:
            continue  # an error says more; several hosts put a network in the path; one GPU has no peer
        quotes = [q for q in (e.fields.get("rank_quote"), e.quote) if q is not None]
        yield Match(
            "gpu_fault",
            0.4,
            Culprit(hosts=hosts[:1]),
            quotes,
            {"host": hosts[0] if hosts else None, "gpus": int(e.fields["gpus"])},
            status="hung",
        )
        return
