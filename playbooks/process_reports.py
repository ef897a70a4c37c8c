"""What a process's own report says, with or without the rest of the job: a crash report Python printed as it
died (faulthandler's `Fatal Python error: Segmentation fault`), or a process table that shows a process asleep
in the kernel on a file system (`D` state, WCHAN `nfs_start_io_read`).
"""

from __future__ import annotations

from collections.abc import Iterator

from hangdx.playbooks.engine import Match, playbook
from hangdx.playbooks.facts import Facts, _norm, watchdog_abort
from hangdx.playbooks.verdict import Culprit
from hangdx.probes.model import LogEvent, ProcessState, Quote
from hangdx.probes.rx import lazy

# Kernel functions a task sleeps in when it waits for a file system or the block layer (WCHAN or
# /proc/PID/stack): NFS and its RPC client, Lustre, CIFS, FUSE, local file systems, page-cache and block I/O.
FS_WCHAN = lazy(
    r"^(?:nfs\w*|rpc_wait\w*|rpc_\w*|__rpc_\w+|io_schedule\w*|wait_on_page_bit\w*|folio_wait\w*|__folio_lock\w*"
    r"|__lock_page\w*|lock_page\w*|wait_on_buffer|__wait_on_buffer|bit_wait_io\w*|__filemap\w*|filemap_\w+"
    r"|do_truncate|ll_\w+|lustre\w*|osc_\w+|ptlrpc\w*|ldlm_\w+|cl_\w+|cifs\w*|smb2?_\w+|fuse_\w+|ext4_\w+"
    r"|jbd2\w*|xfs_\w+|btrfs_\w+|blk_\w+|blkdev_\w+|submit_bio\w*|fsync\w*|vfs_\w+|gpfs\w*|mmfs\w*|ceph_\w+"
    r"|wait_on_page_writeback|wait_on_page_locked\w*|writeback_\w+|sync_\w+"
    r"|txg_\w+|zio_\w+|zil_\w+|zpl_\w+|dmu_\w+)$"  # ZFS: a transaction group that does not sync blocks writers
)
# Kernel modules that are file systems or their transport: a frame in one of them is a storage wait.
FS_MODULES = lazy(
    r"^(?:nfs|nfsv[34]|nfsd|sunrpc|lustre|ptlrpc|osc|mdc|lov|lmv|obdclass|ksocklnd|ko2iblnd|xfs|ext4|jbd2|btrfs"
    r"|fuse|cifs|ceph|libceph|zfs|spl|mmfs\w*|gpfs\w*|beegfs|wekafsio)$"
)


def _host_of(facts: Facts, e: LogEvent) -> list[str]:
    """The host that printed a report: its own line's, another line of the same process's, or the one host."""
    if e.host:
        return [e.host]
    same = {
        x.host
        for x in facts.ev.events
        if x.host and ((e.pid is not None and x.pid == e.pid) or (e.rank is not None and x.rank == e.rank))
    }
    same |= {c.host for c in facts.ev.collectives if c.host and e.rank is not None and c.rank == e.rank}
    if len(same) == 1:
        return sorted(same)
    if e.rank is not None and facts.host_of(e.rank):
        return [facts.host_of(e.rank)]  # type: ignore[list-item]
    return list(facts.ev.hosts) if len(facts.ev.hosts) == 1 else []


def _short(where: str | None) -> str | None:
    """`barrier (/x/site-packages/torch/distributed/distributed_c10d.py:3938)` with the path from its package."""
    if not where or " (" not in where:
        return where
    func, _, rest = where.partition(" (")
    return f"{func} ({_norm(rest.rstrip(')'))})"


def _rank_by_pid(facts: Facts, e: LogEvent) -> int | None:
    """The rank of a crash report that names only its process: the one rank the other lines of that process (same
    pid, same host or none said) name (Ray's `(WorkerDict pid=18980)` before torchrun's `[rank4]:` on one line, and
    only the pid before Python's own crash report on another)."""
    if e.pid is None:
        return None
    named = {
        x.rank
        for x in facts.ev.events
        if x.rank is not None and x.pid == e.pid and (x.host == e.host or x.host is None or e.host is None)
    }
    return named.pop() if len(named) == 1 else None


@playbook("fatal_signal", order=12)
def fatal_signal(facts: Facts) -> Iterator[Match]:
    """Did a process print Python's own crash report (faulthandler: `Fatal Python error: Segmentation fault`)?"""
    crashes = [e for e in facts.ev.events_of("segfault") if e.fields.get("origin") == "faulthandler"]
    crashes = [e for e in crashes if not watchdog_abort(facts.ev, e)]
    if not crashes:
        return
    ranks = sorted(
        {r for e in crashes if (r := e.rank if e.rank is not None else _rank_by_pid(facts, e)) is not None}
    )
    hosts = sorted({h for e in crashes for h in _host_of(facts, e)})
    # The launcher's word on the same process: `failed (exitcode: -11) local_rank: 0 (pid: ...)`.
    exits = [
        x
        for x in facts.ev.events_of("process_exit", "torchrun_failure")
        if x.rank in ranks or (x.rank is None and not ranks)
    ]
    evidence: list[Quote] = [e.quote for e in crashes[:3]] + [x.quote for x in exits[:2]]
    named = [] if ranks else [f"pid {e.pid}" if e.pid is not None else "the process" for e in crashes[:1]]
    yield Match(
        "rank_crashed",
        0.86 if ranks else 0.7,
        Culprit(ranks=ranks, hosts=hosts, processes=named),
        evidence,
        {
            "ranks": ranks,
            "hosts": hosts,
            "what": crashes[0].fields.get("what"),
            "signal": crashes[0].fields.get("signal"),
            "frame": _short((crashes[0].fields.get("frames") or [None])[0]),
            "exit": exits[0].quote.text if exits else None,
        },
        status="failed",
    )


def _stacked(facts: Facts, s: ProcessState) -> bool:
    """A process whose stack was seen: the stack playbooks read its state with it."""
    return any(d.pid == s.pid and d.host == s.host for d in facts.ev.stacks) or (
        s.rank is not None and s.rank in facts.ranks and bool(facts.ranks[s.rank].stacks)
    )


# The NVIDIA GPU driver's kernel modules (the driver, its unified memory, GPUDirect RDMA's peer-memory clients).
_GPU_DRIVER_MODULES = frozenset({"nvidia", "nvidia_uvm", "nvidia_modeset", "nv_peer_mem", "nvidia_peermem"})


@playbook("blocked_in_gpu_driver", order=56)
def blocked_in_gpu_driver(facts: Facts) -> Iterator[Match]:
    """Does a process's kernel stack (`/proc/PID/stack`) run through the NVIDIA driver's modules? A task asleep in
    the kernel inside the GPU driver (a lock it never gets back, a peer-memory callback that waits on another
    driver) is held by the driver, not by its peers or its storage: a driver hang, which no signal ends (the task is
    in uninterruptible sleep) and which a GPU reset or a reboot clears."""
    held = [
        s
        for s in facts.ev.processes
        if s.kernel_modules and _GPU_DRIVER_MODULES & set(s.kernel_modules) and not _stacked(facts, s)
    ]
    # The kernel's own hung-task report says the same when its call trace runs through the driver.
    for e in facts.ev.events_of("hung_task"):
        modules = list(dict.fromkeys(f[3] for f in e.fields.get("frames") or [] if f[3]))
        if _GPU_DRIVER_MODULES & set(modules):
            frame = next((f for f in e.fields["frames"] if f[3] in _GPU_DRIVER_MODULES), None)
            held.append(
                ProcessState(
                    host=e.host,
                    pid=e.pid if e.pid is not None else -1,
                    rank=e.rank,
                    state="D",
                    wchan=frame[2] if frame else None,
                    quote=e.quote,
                    kernel_modules=modules,
                )
            )
    if held:
        yield _blocked("gpu_fault", 0.6, held)


@playbook("blocked_in_kernel", order=57)
def blocked_in_kernel(facts: Facts) -> Iterator[Match]:
    """Does a process table show a process asleep in the kernel on a file system (D state, an NFS WCHAN)?"""
    blocked = [
        s
        for s in facts.ev.processes
        if s.wchan
        and FS_WCHAN.match(s.wchan)
        and (s.state == "D" or (s.state is None and s.quote is not None))
        and not _stacked(facts, s)
    ]
    confidence = 0.66
    if not blocked:
        # D state with no wait channel shown (`ps aux` has none): asleep in the kernel, uninterruptibly. Storage
        # (NFS, a disk, a FUSE mount) is the usual reason, a GPU driver's hang the other; the WCHAN or
        # /proc/PID/stack would say which, so the reading stays modest.
        blocked = [s for s in facts.ev.processes if s.state == "D" and not s.wchan and not _stacked(facts, s)]
        confidence = 0.45
    if blocked:
        yield _blocked("io_stall", confidence, blocked)


def _blocked(category: str, confidence: float, procs: list[ProcessState]) -> Match:
    """Processes asleep in the kernel: the ranks among them (else their pids) and their hosts, each with where."""
    ranks = sorted({s.rank for s in procs if s.rank is not None})
    hosts = sorted({s.host for s in procs if s.host})
    return Match(
        category,
        confidence,
        Culprit(
            ranks=ranks,
            hosts=hosts,
            processes=[] if ranks else [f"pid {s.pid}" for s in procs if s.pid >= 0][:8],
        ),
        [s.quote for s in procs if s.quote][:6],
        {
            "procs": [
                {
                    "pid": s.pid if s.pid >= 0 else None,
                    "rank": s.rank,
                    "host": s.host,
                    "state": s.state,
                    "wchan": s.wchan,
                    "modules": list(s.kernel_modules or []),
                }  # fmt: skip
                for s in procs[:6]
            ],
            "n": len(procs),
            "hosts": hosts,
        },
        status="hung",
    )


@playbook("hung_task_storage", order=58)
def hung_task_storage(facts: Facts) -> Iterator[Match]:
    """Does the kernel's hung-task report (a task in D state past hung_task_timeout_secs) show, in its call trace,
    that the task waits on a file system?"""
    stuck = []
    for e in facts.ev.events_of("hung_task"):
        frames = e.fields.get("frames") or []
        # The file system's own frame says most; a generic page-cache or block-layer wait, else.
        frame = next((f for f in frames if f[3] and FS_MODULES.match(f[3])), None) or next(
            (f for f in frames if FS_WCHAN.match(f[2]) and not f[2].startswith("io_schedule")), None
        )
        if frame is not None:
            stuck.append((e, frame))
    if not stuck:
        return
    hosts = sorted({h for e, _ in stuck for h in _host_of(facts, e)})
    ranks = sorted({e.rank for e, _ in stuck if e.rank is not None})
    evidence: list[Quote] = []
    for e, f in stuck[:3]:
        evidence += [e.quote, Quote(e.quote.source, f[0], f[1])]
    yield Match(
        "io_stall",
        0.82,
        Culprit(
            ranks=ranks,
            hosts=hosts,
            processes=[] if ranks else [f"pid {e.pid} ({e.fields.get('comm')})" for e, _ in stuck][:8],
        ),
        evidence,
        {
            "tasks": [
                {"comm": e.fields.get("comm"), "pid": e.pid, "host": e.host, "function": f[2], "module": f[3]}
                for e, f in stuck[:4]
            ],
            "n": len(stuck),
            "hosts": hosts,
            "seconds": max(int(e.fields.get("seconds") or 0) for e, _ in stuck),
        },
        status="hung",
    )
