"""How a process of the job ended, in its launcher's or library's own words, when no stack was taken.

- PyTorch's DataLoader says a worker died under its rank (`DataLoader worker (pid 742) is killed by signal:
  Killed`, `Unexpected bus error encountered in worker`): the rank's data loading is gone.
- Open MPI names the rank that died and the node (`mpirun noticed that process rank 7 ... exited on signal 9`).
- torch elastic names the local rank and pid that died of a signal (`failed (exitcode: -9) local_rank: 0`): the
  rank itself when nothing read shows a second node.
- CUDA says the GPU itself failed (`CUDA error: uncorrectable ECC error encountered`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator

from hangdx.playbooks.engine import Match, playbook
from hangdx.playbooks.facts import Facts, votes
from hangdx.playbooks.flowchart import _timed_out_ranks
from hangdx.playbooks.signals import ABORTED_ALONE, own_error
from hangdx.playbooks.verdict import Culprit
from hangdx.probes.model import LogEvent
from hangdx.probes.rx import lazy

# What a signal's death usually means, for the words of the fix.
_CAUSE = {
    "SIGKILL": "oom", "Killed": "oom", "SIGBUS": "shm", "Bus error": "shm", "SIGSEGV": "segv",
    "Segmentation fault": "segv", "SIGABRT": "abort", "Aborted": "abort",
}  # fmt: skip
_EXIT_SIGNALS = {-9: "SIGKILL", -7: "SIGBUS", -11: "SIGSEGV", -6: "SIGABRT"}


def _hosts(events: list[LogEvent]) -> list[str]:
    return sorted({e.host for e in events if e.host})


@playbook("worker_died", order=12)
def worker_died(facts: Facts) -> Iterator[Match]:
    """Did a rank's DataLoader worker die (killed by the OOM killer, a bus error from a full /dev/shm)?"""
    events = facts.ev.events_of("dataloader_worker_died")
    if not events:
        return
    by_rank: dict[int | None, list[LogEvent]] = defaultdict(list)
    for e in events:
        by_rank[e.rank].append(e)
    ranked = [r for r in by_rank if r is not None]
    if None in by_rank and len(ranked) == 1:  # the worker's own unprefixed line belongs to the one rank named
        by_rank[ranked[0]] = by_rank.pop(None) + by_rank[ranked[0]]
    for rank, evs in by_rank.items():
        signal = next((e.fields["signal"] for e in evs if e.fields.get("signal")), None)
        code = next((e.fields["exit_code"] for e in evs if e.fields.get("exit_code") is not None), None)
        shm = any("shared memory" in e.quote.text for e in evs)
        cause = "shm" if shm else _CAUSE.get(signal or "", "oom" if code == -9 else "unknown")
        yield Match(
            "dataloader_stall",
            0.86,
            Culprit(ranks=[rank] if rank is not None else [], hosts=_hosts(evs)),
            [e.quote for e in evs],
            {
                "rank": rank,
                "signal": signal,
                "exit_code": code,
                "pids": sorted({p for e in evs for p in e.fields.get("worker_pids") or []}),
                "cause": cause,
                "host": (_hosts(evs) or [None])[0],
            },
            status="failed",
        )


@playbook("mpi_exit", order=13)
def mpi_exit(facts: Facts) -> Iterator[Match]:
    """Did mpirun report that a rank died (a signal, a non-zero exit), and on which node?"""
    # mpirun's reports span lines (`Process name:` then `Exit code:`): a line only a catalogue row read counts as the
    # row says (`node X exiting improperly` alone is context).
    exits = votes(facts.ev.events_of("mpi_rank_exit"), "rank_crashed", structure=True)
    banners = votes(facts.ev.events_of("mpi_job_aborted"), "rank_crashed", structure=True)
    if not exits and not banners:
        return
    victims = _timed_out_ranks(facts)
    dead = [e for e in exits if e.rank not in victims] or exits
    ranks = sorted({e.rank for e in dead if e.rank is not None})
    signals = sorted({e.fields["signal"] for e in dead if e.fields.get("signal")})
    codes = sorted({e.fields["exit_code"] for e in dead if e.fields.get("exit_code") is not None})
    causes = sorted({_CAUSE[s] for s in signals if s in _CAUSE})
    yield Match(
        "rank_crashed",
        0.88 if ranks else 0.6,
        Culprit(ranks=ranks, hosts=_hosts(dead)),
        [e.quote for e in dead[:4]] + [e.quote for e in banners[:1]],
        {
            "ranks": ranks,
            "hosts": _hosts(dead),
            "signals": signals,
            "names": sorted({e.fields["signal_name"] for e in dead if e.fields.get("signal_name")}),
            "codes": codes,
            "causes": causes,
            "failed": banners[0].fields.get("failed") if banners else None,
        },
        status="failed",
    )


@playbook("local_rank_killed", order=14)
def local_rank_killed(facts: Facts) -> Iterator[Match]:
    """Did torch elastic report a worker killed by a signal, naming only its local rank and pid?"""
    if facts.ev.events_of("torchrun_failure") or facts.ev.events_of("mpi_rank_exit"):
        return  # the failure table (rank_gone) or mpirun names the global rank
    exits = facts.ev.events_of("process_exit")
    timeouts = facts.ev.events_of(
        "watchdog_timeout", "gloo_timeout", "desync_report", "monitored_barrier_failed"
    )
    failed = [
        e
        for e in exits
        if e.fields.get("action") == "failed"
        and e.fields.get("exitcode") in _EXIT_SIGNALS
        and not (e.fields.get("exitcode") == -6 and timeouts)  # the watchdog aborts the ranks that waited
    ]
    if not failed:
        return
    stopped = [e for e in exits if e.fields.get("action") == "closing_signal"]
    signals = sorted({_EXIT_SIGNALS[e.fields["exitcode"]] for e in failed})
    # SIGABRT alone is how ProcessGroupNCCL's watchdog ends a rank that timed out waiting (the exception it throws
    # on its own thread reaches std::terminate): with no error of the worker's own, it is more likely a victim's
    # end than a crash (the signal catalogue's reading says so, and names the cause unknown).
    abort_only = signals == ["SIGABRT"] and not own_error(facts)
    # Global rank = group_rank * local_world_size + local_rank: on one node the local rank is the rank.
    single = _one_node(facts)
    ranks = sorted({int(e.fields["local_rank"]) for e in failed if e.fields.get("local_rank") is not None})
    if abort_only:
        # The reading comes first: an abort with nothing of its own says the rank gave up, not why.
        yield Match(
            "unknown",
            ABORTED_ALONE,
            Culprit(),
            [e.quote for e in failed[:3]] + [e.quote for e in stopped[:2]],
            {
                "workers": [
                    {
                        "local_rank": e.fields.get("local_rank"),
                        "pid": e.pid,
                        "exitcode": -6,
                        "signal": "SIGABRT",
                    }
                    for e in failed
                ],
                "stopped": [e.pid for e in stopped if e.pid is not None],
                "signals": signals,
                "causes": ["abort"],
                "hosts": _hosts(failed),
                "single_node": single,
                "abort_only": True,
                "reading": True,
            },
            status="failed",
        )
    yield Match(
        "rank_crashed",
        ABORTED_ALONE - 0.02 if abort_only else 0.8,
        Culprit(ranks=ranks if single else [], hosts=_hosts(failed)),
        [e.quote for e in failed[:3]] + [e.quote for e in stopped[:2]],
        {
            "workers": [
                {
                    "local_rank": e.fields.get("local_rank"),
                    "pid": e.pid,
                    "exitcode": e.fields.get("exitcode"),
                    "signal": _EXIT_SIGNALS[e.fields["exitcode"]],
                }
                for e in failed
            ],  # fmt: skip
            "stopped": [e.pid for e in stopped if e.pid is not None],
            "signals": signals,
            "causes": sorted({_CAUSE[s] for s in signals if s in _CAUSE}),
            "hosts": _hosts(failed),
            "single_node": single,
            "abort_only": abort_only,
            "reading": False,
        },
        status="failed",
    )


def _one_node(facts: Facts) -> bool:
    """Whether nothing read shows a second node: one host at most, no node (group) rank above 0, no global rank
    named. torch elastic's own lines give local ranks only, and a job on one node is the common paste."""
    if len({e.host for e in facts.ev.events if e.host} | set(facts.ev.hosts)) > 1:
        return False
    for e in facts.ev.events:
        if e.rank is not None:
            return False
        for key in ("group_rank", "node_rank"):
            value = e.fields.get(key)
            if value is not None and str(value).isdigit() and int(value) > 0:
                return False
    return True


# CUDA's own texts for a GPU that failed (cudaErrorECCUncorrectable, cudaErrorNvlinkUncorrectable, ...).
_GPU_HW = lazy(
    r"uncorrectable ECC error|uncorrectable NVLink error|GPU has fallen off the bus|GPU is lost"
    r"|unrecoverable hardware error|hardware stop on the GPU",
    re.I,
)


@playbook("cuda_hw_error", order=71)
def cuda_hw_error(facts: Facts) -> Iterator[Match]:
    """Does CUDA say the GPU itself failed (uncorrectable ECC or NVLink error), whoever printed it?"""
    events = [
        e
        for e in facts.ev.events_of("cuda_error", "exception")
        if _GPU_HW.search(str(e.fields.get("error", "")) + " " + e.quote.text)
    ]
    if not events:
        return
    by_host: dict[str | None, list[LogEvent]] = defaultdict(list)
    for e in events:
        by_host[e.host].append(e)
    for host, evs in by_host.items():
        ranks = sorted({e.rank for e in evs if e.rank is not None})
        meanings = list(dict.fromkeys(str(e.fields.get("error") or _GPU_HW.search(e.quote.text).group(0))
                                      for e in evs))  # fmt: skip
        yield Match(
            "gpu_fault",
            0.88,
            Culprit(ranks=ranks, hosts=[host] if host else []),
            [e.quote for e in evs[:4]],
            {"host": host, "xids": [], "gpus": [], "meanings": meanings, "actions": [], "ranks": ranks},
            status="failed",
            template="gpu_fault",
        )
