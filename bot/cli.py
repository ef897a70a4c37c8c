"""The `hangdx` command line: analyze, diagnose, doctor, demo, serve, worker, incident, watch.

Exit status (CONTRACTS.md): 0 when a verdict was produced, 2 on bad usage or unreadable
input (one line naming the problem), 1 on internal error. `doctor`: 0 when every node has what
hangdx needs, 3 when one lacks something or cannot be reached.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from hangdx import __version__
from hangdx.probes.text import printable


class UsageError(Exception):
    """Bad usage or unreadable input: exit status 2."""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hangdx", description="Diagnose hung distributed training jobs.")
    ap.add_argument("--version", action="version", version=f"hangdx {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    a = sub.add_parser("analyze", help="diagnose saved artifacts (files, folders, bundles, - for stdin)")
    a.add_argument("paths", nargs="+", metavar="PATH")
    a.add_argument("--json", action="store_true", help="print the verdict as JSON")
    a.add_argument("--job-id", help="the job's id, when the artifacts do not say")
    a.add_argument("--world-size", type=int, help="how many ranks the job has, when the artifacts do not say")
    a.add_argument("-v", "--verbose", action="store_true")

    d = sub.add_parser("diagnose", help="probe a running job and diagnose it")
    d.add_argument("job_id", metavar="JOBID")
    where = d.add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true", help="probe this machine without SSH")
    where.add_argument("--hosts", help="comma-separated hosts to probe over SSH")
    where.add_argument("--inventory", metavar="FILE", help="YAML inventory of jobs and hosts")
    where.add_argument("--slurm", action="store_true", help="ask Slurm for the job's hosts")
    d.add_argument("--json", action="store_true", help="print the verdict as JSON")
    d.add_argument("--save-bundle", metavar="DIR", help="write the raw artifacts to DIR")
    _add_ssh_options(d)
    d.add_argument("--samples", type=int, default=3, help="stack samples per rank (default 3)")
    d.add_argument("--interval", type=float, default=0.7, help="seconds between samples (default 0.7)")
    d.add_argument("-v", "--verbose", action="store_true")

    o = sub.add_parser("doctor", help="check that the nodes have what hangdx needs, and say how to fix them")
    nodes = o.add_mutually_exclusive_group()  # checked in cmd_doctor: one line, not argparse's usage text
    nodes.add_argument("--hosts", help="comma-separated hosts to check over SSH (ranges like n[01-04])")
    nodes.add_argument("--inventory", metavar="FILE", help="every host of the inventory's jobs")
    nodes.add_argument("--slurm", metavar="JOBID", help="the nodes of this Slurm job")
    nodes.add_argument("--local", action="store_true", help="this machine, without SSH")
    o.add_argument("--json", action="store_true", help="print the report as JSON (docs/nodes.md)")
    _add_ssh_options(o)

    m = sub.add_parser("demo", help="start a real hung torch.distributed job here, diagnose it, clean up")
    m.add_argument("--fault", default=None, help="which fault to inject (see --list)")
    m.add_argument("--list", action="store_true", help="list the faults")
    m.add_argument("--world-size", type=int, default=4)
    m.add_argument("--json", action="store_true", help="print the verdict as JSON")
    m.add_argument(
        "--keep",
        action="store_true",
        help="leave the job hung (to try `hangdx console` on it); prints how to stop it",
    )

    c = sub.add_parser("console", help="talk to the bot's Slack handlers from this terminal (Redis needed)")
    c.add_argument(
        "--wait", type=float, default=300.0, help="seconds to wait for answers at the end (default 300)"
    )

    s = sub.add_parser("serve", help="the Slack bot")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=3000)
    sub.add_parser("worker", help="run diagnoses queued in Redis")
    i = sub.add_parser("incident", help="an incident kept in Redis, as Markdown for a hand-off or postmortem")
    i.add_argument("job_id", metavar="JOBID")
    h = sub.add_parser("history", help="the incidents that involved a host, GPU, link or job (fleet memory)")
    h.add_argument("name", metavar="HOST|JOB")
    h.add_argument("--json", action="store_true")
    d = sub.add_parser("drain", help="drain a Slurm node (scontrol update NodeName=... State=DRAIN)")
    d.add_argument("node", metavar="HOST")
    d.add_argument("--reason", required=True, help="why, kept by Slurm (e.g. 'hangdx: Xid 79 in job 4242')")
    d.add_argument("--job", default=None, metavar="JOBID", help="refuse unless Slurm runs job JOBID on HOST")
    for name, what in (
        ("requeue", "requeue a Slurm job (scontrol requeue)"),
        ("cancel", "cancel a Slurm job"),
    ):
        sub.add_parser(name, help=what).add_argument("job_id", metavar="JOBID")
    _add_watch(sub)
    return ap


def _add_watch(sub) -> None:
    w = sub.add_parser("watch", help="notice stalled jobs and open an incident for each, as an alert does")
    jobs = w.add_mutually_exclusive_group()  # checked in cmd_watch: one line, not argparse's usage text
    jobs.add_argument("--slurm", action="store_true", help="watch Slurm's running jobs")
    jobs.add_argument("--inventory", metavar="FILE", help="watch the jobs of this inventory")
    w.add_argument(
        "--interval",
        type=float,
        default=15.0,
        help="seconds between checks of the cheap signals (default 15)",
    )
    w.add_argument(
        "--stall",
        type=float,
        default=30.0,
        help="seconds every signal (outputs, /proc counters, GPUs) stays flat before the stacks are sampled "
        "(default 30)",
    )
    w.add_argument(
        "--collective-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="the jobs' collective timeout, for the warning before the watchdog (default 600, the process "
        "group's; a rank's HANGDX_COLLECTIVE_TIMEOUT or DEEPSPEED_TIMEOUT wins)",
    )
    w.add_argument("--partition", default="", help="comma-separated partitions to watch (default all)")
    w.add_argument("--user", default="", help="comma-separated users whose jobs to watch (default all)")
    w.add_argument("--job", default="", help="comma-separated job ids to watch (default all)")
    w.add_argument("--exclude", default="", help="comma-separated job ids never to watch")
    w.add_argument(
        "--probe",
        metavar="RESOLVER",
        help="how the confirmation probe reaches the ranks: local, slurm, inventory:PATH "
        "(default HANGDX_RESOLVER, else the watched source)",
    )
    w.add_argument(
        "--once", action="store_true", help="one check, print every decision, exit (a dry run unless --raise)"
    )
    w.add_argument(
        "--raise", dest="raise_", action="store_true", help="with --once: open the incidents found"
    )
    _add_ssh_options(w)


def _add_ssh_options(p: argparse.ArgumentParser) -> None:
    """How to reach the nodes: the same options for diagnose and doctor."""
    p.add_argument("--ssh-user", help="user to log in as on the nodes (default: inventory, else yours)")
    p.add_argument(
        "--ssh-key", metavar="FILE", help="private key file (default: inventory, agent, ~/.ssh keys)"
    )
    p.add_argument(
        "--known-hosts", metavar="FILE", help="known_hosts to verify host keys against (never added to)"
    )
    p.add_argument("--jump", metavar="HOST", help="reach the nodes through this bastion ([user@]host[:port])")
    p.add_argument(
        "--connect-timeout", type=float, help="seconds to reach one host (default: the inventory's, else 10)"
    )
    p.add_argument(
        "--deadline", type=float, help="seconds for the whole probe (default: the inventory's, else 120)"
    )


def _ssh_flags(args: argparse.Namespace) -> dict:
    """The values of _add_ssh_options's flags, as DiagnoseOptions fields."""
    keys = ("ssh_user", "ssh_key", "known_hosts", "jump", "connect_timeout", "deadline")
    return {key: getattr(args, key) for key in keys}


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)

    def fail(message: str) -> None:
        sys.stderr.write(f"hangdx: {printable(message, multiline=False)}\n")

    try:
        if args.command == "analyze":
            return cmd_analyze(args)
        if args.command == "diagnose":
            return cmd_diagnose(args)
        if args.command == "doctor":
            return cmd_doctor(args)
        if args.command == "console":
            from hangdx.bot.console import run_console

            return run_console(args)
        if args.command == "demo":
            from hangdx.bot.demo import run_demo

            return run_demo(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "worker":
            return cmd_worker(args)
        if args.command == "incident":
            return cmd_incident(args)
        if args.command == "history":
            return cmd_history(args)
        if args.command in ("drain", "requeue", "cancel"):
            return cmd_slurm_action(args)
        if args.command == "watch":
            return cmd_watch(args)
        ap.print_help()
        return 2
    except UsageError as e:
        fail(str(e))
        return 2
    except KeyboardInterrupt:
        fail("interrupted")
        return 130
    except Exception as e:  # noqa: BLE001 - one line, not a traceback, for a user at 3 AM
        fail(f"internal error: {type(e).__name__}: {e} (please report it)")
        if "HANGDX_DEBUG" in __import__("os").environ:
            raise
        return 1


def _print(verdict, as_json: bool, verbose: bool = False) -> None:
    from hangdx.bot import render

    if as_json:
        sys.stdout.write(render.to_json(verdict) + "\n")
    else:
        from rich.console import Console

        render.terminal(verdict, Console(highlight=False), verbose=verbose)


def cmd_analyze(args: argparse.Namespace) -> int:
    from hangdx.playbooks import engine
    from hangdx.probes.bundle import InputError, evidence_from_paths
    from hangdx.probes.reader import readable

    stdin = sys.stdin.buffer if "-" in args.paths else None
    try:
        ev = evidence_from_paths(args.paths, stdin=stdin)
    except InputError as e:
        raise UsageError(str(e)) from None
    if args.job_id:
        ev.job_id = args.job_id
    if args.world_size:
        ev.world_size = args.world_size
    if not readable(ev):
        reasons = "; ".join(f"{g.source}: {g.message}" for g in ev.gaps[:3])
        raise UsageError(
            f"nothing hangdx can read in {', '.join(args.paths)}" + (f" ({reasons})" if reasons else "")
        )
    from hangdx.bot.diagnosis import name_hosts_apart

    _print(name_hosts_apart(engine.run(ev), ev), args.json, args.verbose)
    return 0


def cmd_diagnose(args: argparse.Namespace) -> int:
    import os

    from hangdx.bot.diagnosis import DiagnoseOptions, DiagnosisError, collect, judge
    from hangdx.probes import bundle

    started = time.monotonic()
    opts = DiagnoseOptions(
        how=_resolver(args, os.environ.get("HANGDX_RESOLVER", "local")),
        samples=args.samples,
        interval=args.interval,
        **_ssh_flags(args),
    )
    if args.save_bundle:
        try:  # before probing anything: a refused folder is said at once, not after the probes
            bundle.check_destination(Path(args.save_bundle))
        except OSError as e:
            raise UsageError(f"cannot write bundle to {args.save_bundle}: {e.strerror or e}") from None
    notes: list[str] = []
    vouched: set[str] = set()
    try:
        docs = collect(args.job_id, opts, notes=notes, vouched=vouched)
        if args.save_bundle:
            try:
                bundle.save(docs, Path(args.save_bundle), args.job_id)
            except OSError as e:
                raise UsageError(f"cannot write bundle to {args.save_bundle}: {e.strerror or e}") from None
        verdict = judge(docs, args.job_id, vouched, notes)
    except DiagnosisError as e:
        raise UsageError(str(e)) from None
    verdict.notes = notes + verdict.notes
    verdict.elapsed_seconds = time.monotonic() - started
    _print(verdict, args.json, args.verbose)
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """Exit status 0 when every node has what hangdx needs, 3 when one lacks something or is unreachable."""
    import json

    from hangdx.bot.diagnosis import DiagnoseOptions, DiagnosisError, ssh_targets
    from hangdx.probes import doctor

    if not (args.local or args.hosts or args.inventory or args.slurm):
        raise UsageError(
            "doctor: which nodes? give --hosts H1,H2, --inventory FILE, --slurm JOBID or --local"
        )
    if args.local:
        report = doctor.check_local()
    else:
        opts = DiagnoseOptions(how=_resolver(args, "local"), **_ssh_flags(args))
        try:
            hosts, settings = ssh_targets(args.slurm, opts.how, opts)
        except DiagnosisError as e:
            raise UsageError(str(e)) from None
        report = doctor.check_hosts(hosts, settings)
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        from rich.console import Console

        doctor.render(report, Console(highlight=False))
    return 0 if report["ok"] else 3


def _resolver(args: argparse.Namespace, default: str) -> str:
    """Where the job's hosts come from: the flags, else HANGDX_RESOLVER."""
    if args.local:
        return "local"
    if args.hosts:
        return f"hosts:{args.hosts}"
    if args.inventory:
        return f"inventory:{args.inventory}"
    if args.slurm:
        return "slurm"
    return default


def _bot_config():
    from hangdx.bot.config import BotConfig, ConfigError

    try:
        return BotConfig.from_env()
    except ConfigError as e:
        raise UsageError(str(e)) from None


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)  # unwinds serve_forever: the scheduler stops and the socket closes


def cmd_serve(args: argparse.Namespace) -> int:
    from hangdx.bot import server
    from hangdx.bot.config import ConfigError
    from hangdx.bot.incidents import StoreUnavailable
    from hangdx.bot.service import Service

    cfg = _bot_config()
    # SIGTERM (docker stop, a Kubernetes pod ending, systemctl stop) ends serve cleanly: as PID 1 in a
    # container the default action would be ignored and the process killed after the grace period.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        service = Service(cfg)
        for job in service.recover():  # diagnoses a restart cut off: said so in their threads
            sys.stderr.write(
                f"hangdx serve: the diagnosis of job {printable(job, False)} was interrupted; marked so\n"
            )
        server.serve(
            cfg,
            service.submit,
            args.host,
            args.port,
            on_action=service.on_action,
            report=service.report,
            store=service.store,
            health=service.health,
            analyze=service.analyze,
            history=service.history,
            resolution=service.resolution,
            act=service.act,
        )
    except (ConfigError, StoreUnavailable) as e:
        raise UsageError(str(e)) from None
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    import os

    from hangdx.bot import worker

    cfg = _bot_config()
    # The worker posts verdicts to Slack itself when it has a token; otherwise it only keeps them in Redis.
    if cfg.bot_token:
        os.environ.setdefault("HANGDX_NOTIFIER", "hangdx.bot.service:notify")
    return worker.main(cfg.redis_url)


def cmd_incident(args: argparse.Namespace) -> int:
    from hangdx.bot.diagnosis import DiagnosisError, check_job_id
    from hangdx.bot.incidents import IncidentStore, StoreUnavailable, connect

    cfg = _bot_config()
    try:
        check_job_id(args.job_id)
        store = IncidentStore(connect(cfg.redis_url))
        if store.get(args.job_id) is None:
            raise UsageError(f"no incident for job {args.job_id!r} in {store.where}")
        sys.stdout.write(printable(store.markdown(args.job_id)))
    except (DiagnosisError, StoreUnavailable) as e:
        raise UsageError(str(e)) from None
    return 0


def cmd_slurm_action(args: argparse.Namespace) -> int:
    """`hangdx drain|requeue|cancel`: the same checked argument lists as the Slack buttons."""
    from hangdx.bot import slurm_actions

    try:
        if args.command == "drain":
            said = slurm_actions.drain(args.node, args.reason, job=args.job)
        elif args.command == "requeue":
            said = slurm_actions.requeue(args.job_id)
        else:
            said = slurm_actions.cancel(args.job_id)
    except slurm_actions.ActionError as e:
        raise UsageError(str(e)) from None
    sys.stdout.write(printable(said) + "\n")
    job = args.job if args.command == "drain" else args.job_id
    _record_action(args.command, job, args.node if args.command == "drain" else job, said)
    return 0


def _record_action(action: str, job: str | None, target: str, said: str) -> None:
    """A drain, requeue or cancel done from the command line, as the Slack buttons do: on the job's incident when
    there is one, and in the fleet memory for the hand-off. Done already: a Redis that cannot say is one line."""
    import getpass

    import redis

    from hangdx.bot.incidents import IncidentStore, StoreUnavailable, connect
    from hangdx.bot.memory import Memory

    try:
        who = f"{getpass.getuser()} (command line)"
    except (KeyError, OSError):
        who = "command line"
    try:
        cfg = _bot_config()
        conn = connect(cfg.redis_url)
        store = IncidentStore(conn)
        if job and store.get(job) is not None:
            store.add_event(job, who, action, said)
            sys.stdout.write(printable(f"recorded on the incident of job {job}", multiline=False) + "\n")
        Memory(conn).note_action(job or "", action, target, who)
    except (UsageError, StoreUnavailable, redis.exceptions.RedisError) as e:
        why = " ".join(str(e).split())[:200]
        sys.stderr.write(
            printable(f"hangdx: {action} done, but not recorded for the hand-off: {why}", False) + "\n"
        )


def cmd_history(args: argparse.Namespace) -> int:
    import json
    import re

    import redis

    from hangdx.bot.incidents import connect
    from hangdx.bot.memory import Memory

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:@+/-]{0,252}", args.name):
        raise UsageError(f"{args.name[:80]!r} is not a host, GPU, link or job name")
    cfg = _bot_config()
    try:
        recs = Memory(connect(cfg.redis_url)).history(args.name)
    except redis.exceptions.RedisError as e:
        raise UsageError(f"redis at {cfg.redis_url}: {' '.join(str(e).split())[:200]}") from None
    if args.json:
        sys.stdout.write(json.dumps(recs, indent=2) + "\n")
        return 0
    if not recs:
        sys.stdout.write(f"no incident involved {args.name} in the fleet memory\n")
        return 0
    sys.stdout.write(f"{args.name}: {len(recs)} incident(s)\n")
    for r in recs:
        how = f"  resolved by: {r['resolution']}" if r["resolution"] else ""
        runs = f" (diagnosed {r['diagnoses']} times)" if r.get("diagnoses", 1) > 1 else ""
        line = f"  {r['day']}  job {r['job']}{runs}  {r['category']} ({r['as']})  {r['summary'][:120]}{how}"
        sys.stdout.write(printable(line, multiline=False) + "\n")
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    import os
    import threading

    from hangdx.bot.diagnosis import DiagnoseOptions, DiagnosisError, check_resolver
    from hangdx.bot.incidents import StoreUnavailable
    from hangdx.bot.service import Service
    from hangdx.bot.watch import RedisLedger, Watcher, WatchError, WatchSettings, keep_bundle

    if not (args.slurm or args.inventory):
        raise UsageError("watch: which jobs? give --slurm or --inventory FILE")
    if not (args.interval > 0 and args.stall > 0 and args.collective_timeout > 0):
        raise UsageError(
            "watch: --interval, --stall and --collective-timeout must be positive numbers of seconds"
        )
    if args.raise_ and not args.once:
        raise UsageError("watch: --raise goes with --once (the watcher raises what it finds)")
    source = "slurm" if args.slurm else f"inventory:{args.inventory}"
    how = args.probe or os.environ.get("HANGDX_RESOLVER", "").strip() or source
    try:
        check_resolver(how)
    except DiagnosisError as e:
        raise UsageError(f"watch --probe: {e}") from None

    def ids(text: str) -> frozenset[str]:
        return frozenset(x.strip() for x in text.split(",") if x.strip())

    settings = WatchSettings(
        source=source,
        interval=args.interval,
        stall=args.stall,
        partitions=ids(args.partition),
        users=ids(args.user),
        jobs=ids(args.job),
        exclude=ids(args.exclude),
        probe=DiagnoseOptions(how=how, samples=2, interval=1.0, **_ssh_flags(args)),
        collective_timeout=args.collective_timeout,
        dry_run=args.once and not args.raise_,
        once=args.once,
    )
    cfg = _bot_config()
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        service = Service(cfg)
        watcher = Watcher(
            settings,
            service.submit,
            ledger=RedisLedger(service.conn),
            keep=lambda job, docs: keep_bundle(service.conn, job, docs),
            say=lambda job, text: _watch_say(service, job, text),
        )
        if args.once:
            for d in watcher.check():
                fields = (d.job_id, d.outcome, d.reason)
                sys.stdout.write("\t".join(printable(f, multiline=False) for f in fields) + "\n")
            return 0
        sys.stderr.write(
            f"hangdx watch: {source} every {args.interval:g}s, confirmation window {args.stall:g}s, probe {how}\n"
        )
        watcher.run(threading.Event(), report=_watch_report)
    except (WatchError, StoreUnavailable) as e:
        raise UsageError(str(e)) from None
    except redis_errors() as e:
        raise UsageError(f"watch: Redis: {' '.join(str(e).split())[:200]}") from None
    return 0


def redis_errors() -> tuple[type[Exception], ...]:
    import redis

    return (redis.exceptions.RedisError,)


def _watch_say(service, job: str, text: str) -> None:  # noqa: ANN001 - a Service
    """A watcher's line (a warning, the job's end) in the job's incident thread and timeline; in the alert channel
    when the job has no incident."""
    from hangdx.bot.service import _post
    from hangdx.bot.slack.blocks import mrkdwn

    inc = service.store.get(job)
    if inc is not None and inc.thread_ts:
        service._say(inc, text)
        service.store.add_event(job, "hangdx watch", "watch", text)
    elif service.cfg.alert_channel:
        _post(service.client, channel=service.cfg.alert_channel, text=mrkdwn("{t}", t=text))


def _watch_report(d) -> None:
    """A line for what matters: a stall, a failure, a probe that could not tell or found the job moving."""
    if d.outcome in ("stalled", "failed", "unconfirmed", "warned", "ended") or d.probe_seconds is not None:
        said = printable(f"job {d.job_id} {d.outcome}: {d.reason}", multiline=False)
        sys.stderr.write(f"hangdx watch: {said}\n")
        sys.stderr.flush()
