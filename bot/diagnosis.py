"""One diagnosis, whoever asks (the command line, a Slack command, an alert, a queued job):
find the job's hosts, collect the evidence, run the playbooks."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

from hangdx.playbooks import engine
from hangdx.playbooks.verdict import Verdict
from hangdx.probes.hosts import HostSpec, SshSettings
from hangdx.probes.model import Evidence
from hangdx.probes.rx import lazy

# A job id reaches /proc scans, file names, Slack messages and remote scripts: keep it to a safe alphabet.
JOB_ID = lazy(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}")
RESOLVERS = "local, slurm, inventory:PATH or hosts:H1,H2"
Progress = Callable[[int, int], None]  # (hosts reported, hosts in all)


class DiagnosisError(Exception):
    """The request cannot be carried out as asked (unknown job, bad resolver, no known_hosts): one line."""


@dataclass
class DiagnoseOptions:
    how: str = "local"  # local | slurm | inventory:PATH | hosts:H1,H2 (HANGDX_RESOLVER's syntax)
    samples: int = 3
    interval: float = 0.7
    ssh_user: str | None = None
    ssh_key: str | None = None
    known_hosts: str | None = None
    jump: str | None = None
    # None: the inventory's `ssh:` setting, else SshSettings' default (10 s, 120 s); a flag given wins over both.
    connect_timeout: float | None = None
    deadline: float | None = None
    # Nodes an alert named: probed first; probed alone only when the resolver does not know the job.
    hint_hosts: list[str] = field(default_factory=list)


def check_job_id(job_id: str) -> str:
    # fullmatch: `$` would let a trailing newline through ("123\n" reaching a remote script or a log line).
    if not isinstance(job_id, str) or not JOB_ID.fullmatch(job_id):
        shown = repr(job_id[:60] + "…" if isinstance(job_id, str) and len(job_id) > 60 else job_id)
        raise DiagnosisError(f"{shown} is not a job id (letters, digits and . _ : @ + - only)")
    return job_id


def check_resolver(how: str) -> str:
    if how in ("local", "slurm") or how.startswith(("inventory:", "hosts:")):
        return how
    raise DiagnosisError(f"resolver {how!r}: expected {RESOLVERS}")


def _hosts_how(hosts: list[str]) -> str:
    # An IPv6 address goes in brackets, as the hosts resolver reads one ([fe80::1] or [fe80::1]:22).
    return "hosts:" + ",".join(f"[{h}]" if ":" in h else h for h in hosts)


def collect(
    job_id: str,
    opts: DiagnoseOptions,
    progress: Progress | None = None,
    notes: list[str] | None = None,
    vouched: set[str] | None = None,
) -> list[dict]:
    """Collector documents, one per host, for the job; progress(done, total) as hosts report; `notes` gets how
    the hosts were chosen when that is worth saying in the verdict; `vouched` gets the hosts the resolver (the
    scheduler, the inventory, the user's --hosts) says the job runs on, never those only an alert named."""
    check_job_id(job_id)
    if not 1 <= opts.samples <= 20:
        raise DiagnosisError("samples: 1 to 20")
    how = check_resolver(opts.how)
    interval = max(0.0, opts.interval)
    if how == "local":
        # HANGDX_RESOLVER=local: the job runs on this machine, whatever node the alert names (CONTRACTS: the
        # job's hosts still come from the resolver). Only when no process of the job is here are the other
        # nodes the alert named probed, alone, and nobody vouches for them (a probe that finds the job does).
        from hangdx.probes.local import collect_local  # here: `analyze` never probes this machine

        docs = collect_local(job_id, samples=opts.samples, interval=interval)
        elsewhere = [h for h in opts.hint_hosts if not is_this_machine(h)]
        if not elsewhere or _has_job(docs):
            if progress is not None:
                progress(1, 1)
            return docs
        if notes is not None:
            notes.append(
                f"no process of job {job_id} on this machine (HANGDX_RESOLVER=local): probed only the nodes the "
                "alert named, with the default SSH settings"
            )
        return _collect_remote(
            job_id, _hosts_how(elsewhere), replace(opts, hint_hosts=elsewhere), interval, progress, None, None
        )
    return _collect_remote(job_id, how, opts, interval, progress, notes, vouched)


def _has_job(docs: list[dict]) -> bool:
    return any(a.get("kind") in ("procstate", "pyspy") for d in docs for a in d.get("artifacts") or [])


def is_this_machine(host: str) -> bool:
    """Whether a node an alert named is this machine: a loopback name or address, or this host's own name (short
    or fully qualified)."""
    import ipaddress
    import socket

    name = host.strip().lower().rstrip(".")
    if name in ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    own = {socket.gethostname().lower(), socket.getfqdn().lower()}
    return name in own or name in {o.split(".")[0] for o in own}


def job_hosts(docs: list[dict], vouched: set[str]) -> set[str]:
    """The hosts a verdict may name as culprits: those the resolver vouched for and those whose probe found the
    job's processes, never one whose name does not resolve."""
    probed = {
        name
        for d in docs
        if not d.get("problem")
        and any(a.get("kind") in ("procstate", "pyspy") for a in d.get("artifacts") or [])
        for name in (d.get("host"), d.get("node_hostname"))  # as hangdx reached it, and as it names itself
    }
    unresolved = {d.get("host") for d in docs if (d.get("problem") or {}).get("kind") == "dns"}
    return {h for h in (vouched | probed) - unresolved if isinstance(h, str) and h}


def judge(docs: list[dict], job_id: str, vouched: set[str], notes: list[str]) -> Verdict:
    """The verdict of a live diagnosis, its culprit hosts confined to the job's hosts (`notes` says who was
    left out)."""
    verdict = verdict_of(docs, job_id)
    dropped = verdict.confine_hosts(job_hosts(docs, vouched))
    if dropped:
        from hangdx.playbooks.wording import name_set

        notes.append(
            f"{name_set(dropped)}: named by the evidence or an alert but not a verified host of this job (not "
            "listed by the resolver, not probed, or not resolvable): not a culprit, and nothing is offered for it"
        )
    return verdict


# Names every machine gives itself (not addresses: a bundle names the nodes it probed by address, 127.0.0.2 too).
_LOOPBACK = lazy(r"(?i)localhost(?:\.localdomain)?|ip6-localhost|ip6-loopback")


def indistinct_hosts(ev: Evidence) -> dict[str, str]:
    """Host names in offline evidence that do not tell machines apart, each with why: a loopback name (every
    machine has it), or one name printed by processes of several machines (two pods called `trainer`: two ranks
    of one local rank under one name)."""
    out: dict[str, str] = {}
    seen: dict[str, dict[int, set[int]]] = {}
    # Global ranks with their LOCAL_RANK only: torchrun's failure table and the processes' environment (NCCL's
    # init lines give a rank and local rank per communicator, which differ for one process).
    records = [
        (e.host, e.rank, e.fields.get("local_rank")) for e in ev.events if e.kind == "torchrun_failure"
    ]
    records += [(p.host, p.rank, p.local_rank) for p in ev.processes]
    records += [(e.host, None, None) for e in ev.events]
    for host, rank, local in records:
        if not isinstance(host, str) or not host:
            continue
        if _LOOPBACK.fullmatch(host):
            out[host] = "a loopback name, which every machine has"
        if isinstance(rank, int) and isinstance(local, int):
            seen.setdefault(host, {}).setdefault(local, set()).add(rank)
    for host, by_local in seen.items():
        for local, ranks in sorted(by_local.items()):
            if len(ranks) > 1 and host not in out:
                a, b = sorted(ranks)[:2]
                out[host] = (
                    f"printed by more than one machine (ranks {a} and {b} are both its local rank {local})"
                )
    return out


def name_hosts_apart(verdict: Verdict, ev: Evidence) -> Verdict:
    """Offline evidence: a culprit host only where the evidence tells hosts apart; a note says which were not."""
    bad = indistinct_hosts(ev)
    named = {h for f in verdict.findings for h in f.culprit.hosts}
    dropped = verdict.confine_hosts(named - set(bad))
    for host in dropped:
        verdict.notes.append(f"{host}: not named as a culprit host: {bad.get(host, 'not told apart')}")
    return verdict


def verdict_of(docs: list[dict], job_id: str) -> Verdict:
    from hangdx.probes.local import JobNotFound, evidence_for_job

    try:
        ev = evidence_for_job(docs, job_id)
    except JobNotFound as e:
        raise DiagnosisError(str(e)) from None
    return engine.run(ev)


def diagnose(
    job_id: str, opts: DiagnoseOptions, progress: Progress | None = None
) -> tuple[Verdict, list[dict]]:
    """The verdict and the raw documents it came from (a bundle to keep)."""
    started = time.monotonic()
    notes: list[str] = []
    vouched: set[str] = set()
    docs = collect(job_id, opts, progress, notes, vouched)
    verdict = judge(docs, job_id, vouched, notes)
    if opts.hint_hosts:
        from hangdx.playbooks.wording import name_set

        notes.insert(0, f"alert fired on {name_set(opts.hint_hosts)}")
    verdict.notes = notes + verdict.notes
    verdict.elapsed_seconds = time.monotonic() - started
    return verdict, docs


def analyze_texts(parts: list[tuple[str, BinaryIO]]) -> Verdict | None:
    """Diagnose what a person pasted or uploaded (Slack messages, files): each part streamed by the one reader.

    The verdict's `read` says which parts were read as what and which lines were skipped; a part that holds no
    evidence is a gap. None when nothing at all was readable (the same rule as `hangdx analyze`'s exit 2).
    Caps (how many parts, how many bytes) belong to the caller, who knows where they came from.
    """
    from hangdx.probes import reader
    from hangdx.probes.model import Evidence, Source

    started = time.monotonic()
    ev = Evidence()
    for name, stream in parts:
        reader.read_any(stream, Source(name), ev, limit=reader.STDIN_MAX)
    if not reader.readable(ev):
        return None
    verdict = name_hosts_apart(engine.run(ev), ev)
    verdict.elapsed_seconds = time.monotonic() - started
    return verdict


def ssh_targets(
    job_id: str | None,
    how: str,
    opts: DiagnoseOptions,
    notes: list[str] | None = None,
    vouched: set[str] | None = None,
) -> tuple[list[HostSpec], SshSettings]:
    """The hosts to reach and how: the job's hosts (job_id None: every host of an inventory's jobs) and the
    SSH settings (the flags over the inventory's `ssh:` section over the defaults), the nodes an alert named
    first. When the resolver does not know the job, the alert's nodes alone, with the default settings (said in
    `notes`). Used by diagnose and doctor."""
    from hangdx.probes import resolve
    from hangdx.probes.hosts import HostError, parse_host

    try:
        try:
            hosts, overrides = resolve.resolve_with_settings(job_id, how)
            if vouched is not None:
                vouched.update(h.name for h in hosts)
        except (HostError, resolve.ResolveError) as e:
            if not opts.hint_hosts:
                raise
            hosts, overrides = resolve.resolve_with_settings(job_id, _hosts_how(opts.hint_hosts))
            if notes is not None:
                notes.append(
                    f"the resolver ({how.split(':')[0]}) does not know this job ({e}): probed only the nodes "
                    "the alert named, with the default SSH settings"
                )
        hinted = set(opts.hint_hosts)
        hosts = sorted(hosts, key=lambda h: h.name not in hinted)  # the alerting nodes first
        settings = SshSettings()
        for key, value in overrides.items():
            if hasattr(settings, key):
                setattr(settings, key, value)
        jump = parse_host(opts.jump) if opts.jump else None
        settings.user = opts.ssh_user or settings.user
        settings.key_file = opts.ssh_key or settings.key_file
        settings.known_hosts = opts.known_hosts or settings.known_hosts
    except (HostError, resolve.ResolveError) as e:
        raise DiagnosisError(str(e)) from None
    if not Path(settings.known_hosts).expanduser().is_file():
        raise DiagnosisError(
            f"no known_hosts file at {settings.known_hosts}: hangdx verifies every host key and never adds one "
            "(give --known-hosts FILE, or collect the keys with ssh-keyscan and check their fingerprints)"
        )
    if opts.connect_timeout is not None:
        settings.connect_timeout = opts.connect_timeout
    if opts.deadline is not None:
        settings.deadline = opts.deadline
    if jump is not None:
        hosts = [h if h.jump else replace(h, jump=jump) for h in hosts]
    return hosts, settings


def _collect_remote(
    job_id: str,
    how: str,
    opts: DiagnoseOptions,
    interval: float,
    progress: Progress | None = None,
    notes: list[str] | None = None,
    vouched: set[str] | None = None,
) -> list[dict]:
    from hangdx.probes import ssh

    hosts, settings = ssh_targets(job_id, how, opts, notes, vouched)
    if progress is not None:
        progress(0, len(hosts))
    return ssh.fan_out(hosts, settings, job_id, samples=opts.samples, interval=interval, progress=progress)
