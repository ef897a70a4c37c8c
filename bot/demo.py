"""`hangdx demo`: start a real hung torch.distributed job here, diagnose it live, clean up."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from rich.console import Console


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_demo(args: argparse.Namespace) -> int:
    from hangdx.bot.cli import UsageError, _print

    try:
        from hangdx.zoo.launch import ALL_FAULTS as FAULTS
        from hangdx.zoo.launch import DEFAULT_FAULT, ZooJob
    except ImportError as e:  # torch missing: the zoo's job imports it lazily, the launcher should not
        raise UsageError(
            f"the demo needs its job's dependencies ({e}); install them with: pip install 'hangdx[demo]'"
        ) from None
    out = Console(highlight=False, stderr=args.json, soft_wrap=True)
    if args.list:
        for name, f in FAULTS.items():
            mark = " (default)" if name == DEFAULT_FAULT else ""
            print(f"{name:26} {f.category:24} {f.description}{mark}")
        return 0
    fault = args.fault or DEFAULT_FAULT
    if fault not in FAULTS:
        raise UsageError(f"no fault {fault!r}; choose one of: {', '.join(FAULTS)}")
    if not 2 <= args.world_size <= 16:
        raise UsageError("--world-size takes 2 to 16")
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UsageError(
            "the demo runs a real torch.distributed job and needs torch: pip install 'hangdx[demo]'"
        ) from None

    from hangdx.bot.diagnosis import DiagnoseOptions, diagnose

    spec = FAULTS[fault]
    # Ctrl-C, `timeout` (SIGTERM) and a closed terminal all end the job's processes.
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    # --keep: the job outlives this process, so any later `hangdx` of this user may attach py-spy to it.
    job = ZooJob(
        fault, world_size=args.world_size, ptracer_pid=-1 if args.keep else os.getpid(), control_plane=True
    )
    try:
        out.print(
            f"[bold]hangdx demo[/]: starting a {args.world_size}-rank gloo job with fault [cyan]{fault}[/] ({spec.description})"
        )
        job.start()
        out.print(
            f"  job id {job.job_id}, ranks {', '.join(f'{r}=pid {p}' for r, p in sorted(job.pids.items()))}"
        )
        t0 = time.monotonic()
        with out.status("waiting for the job to hang..."):
            job.wait_until_stuck()
        out.print(
            f"  the job {'hangs' if spec.hangs else 'crawls'} ({time.monotonic() - t0:.1f}s); diagnosing it live with py-spy and /proc"
        )
        verdict, _ = diagnose(job.job_id, DiagnoseOptions(how="local"))
        _print(verdict, args.json)
        if not args.json:
            rc = verdict.root_cause
            right = (
                rc is not None
                and rc.category == spec.category
                and sorted(set(rc.culprit.ranks)) == sorted(spec.culprit_ranks)
            )
            ranks = ", ".join(str(r) for r in spec.culprit_ranks)
            out.print(
                f"  injected: {spec.category} on rank {ranks} -> "
                + ("[bold green]diagnosed right[/]" if right else "[bold red]diagnosis differs[/]")
                + f" in {verdict.elapsed_seconds:.1f}s"
            )
        if args.keep:
            stop = job.detach()
            # On stderr with --json, so that stdout stays one JSON document.
            out.print(
                f"  left job [bold]{job.job_id}[/] hung, its ranks running (pids "
                f"{', '.join(str(p) for _, p in sorted(job.pids.items()))}); try it with `hangdx console` and "
                f"`/diagnose {job.job_id}`\n  stop it with: {stop}",
                markup=True,
            )
        return 0
    except TimeoutError as e:
        sys.stderr.write(f"hangdx: the demo job did not reach its hung state: {str(e).splitlines()[0]}\n")
        return 1
    finally:
        job.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if not args.json and not args.keep:
            out.print("  stopped every process of the demo job")
