"""Accuracy of hangdx on the hang zoo: every fault, diagnosed live, against what was injected.

    python bench/accuracy.py [--faults a,b] [--repeat N]
    python bench/accuracy.py --real      # the real-world corpus instead (bench/real.py)
    python bench/accuracy.py --sealed    # the sealed corpus: counts only, never a case (tests/fixtures/sealed/)
    python bench/accuracy.py --sealed --added-since REV   # only the sealed cases added after REV, counts only
    python bench/accuracy.py --sealed --pairs    # also the misses counted by (expected, answered, shows the cause)
    python bench/accuracy.py --realistic # the held-out realistic training programs (hangdx/zoo/realistic/)

Prints: scenario, expected category, found category, culprit right, seconds from the start of
`hangdx diagnose` to the verdict (the whole command, Python start-up included), peak memory of the
hangdx process, and of it or the largest probe it ran (py-spy). Targets: every scenario right; median time to
verdict <= 5 s for 4 ranks; < 300 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from hangdx.probes.normalise import same_host
from hangdx.zoo.launch import FAULTS, REALISTIC, ZooJob

# hangdx run so that it reports its own peak memory at exit: wait4's ru_maxrss is the largest of the process and of
# every child it waited for, py-spy among them (`py-spy dump --native` loads the ranks' native symbol tables, some
# 300 MB for a rank with libtorch), which on a real job runs on the node, not where hangdx runs.
_OWN_PEAK = (
    "import atexit, resource, runpy, sys; "
    "atexit.register(lambda: sys.stderr.write("
    "'hangdx-own-peak-kb %d\\n' % resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)); "
    "runpy.run_module('hangdx', run_name='__main__', alter_sys=True)"
)


def diagnose(job_id: str) -> tuple[dict | None, float, float, float, str]:
    """Run `hangdx diagnose --local --json`; (verdict, seconds, peak MB of hangdx's own process, peak MB of it and
    the probes it ran, stderr)."""
    with tempfile.TemporaryFile() as errf:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-c", _OWN_PEAK, "diagnose", job_id, "--local", "--json"],
            stdout=subprocess.PIPE,
            stderr=errf,
        )
        out = proc.stdout.read()
        # wait4, not wait: its rusage is this one process's (and its waited-for children's), not every child's of
        # this bench (the ranks are ours too).
        _, _, usage = os.wait4(proc.pid, 0)
        seconds = time.monotonic() - t0
        proc.returncode = 0
        errf.seek(0)
        err = errf.read().decode(errors="replace").strip()
    own = usage.ru_maxrss / 1024
    lines = err.splitlines()
    for ln in lines:
        if ln.startswith("hangdx-own-peak-kb "):
            own = int(ln.split()[1]) / 1024
    err = "\n".join(ln for ln in lines if not ln.startswith("hangdx-own-peak-kb "))
    try:
        verdict = json.loads(out)
    except ValueError:
        verdict = None
    return verdict, seconds, own, usage.ru_maxrss / 1024, err


SEALED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "sealed")


def added_since(rev: str, folder: str = SEALED) -> set[str] | None:
    """Names of the sidecars in folder that are in HEAD and were not at `rev` (None when git cannot say); a case
    renamed since (an audit's corrected category) counts as added."""
    try:
        out = subprocess.run(
            ["git", "diff", "--no-renames", "--diff-filter=A", "--name-only", rev, "HEAD", "--", "."],
            cwd=folder, capture_output=True, text=True, check=True, timeout=60,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return {os.path.basename(x) for x in out.split() if x.endswith(".yaml")}


def sealed(folder: str = SEALED, only: set[str] | None = None, pairs: bool = False) -> int:
    """`hangdx analyze --json` on every sealed case; prints only counts per category, never a case or a line of one.

    The sealed set measures how the rules generalise: whoever writes rules must not learn which case failed, so
    nothing here names a case, quotes it, or says which one was missed.
    """
    import yaml

    tally: dict[str, list[int]] = {}  # category -> [category right, total, culprit right, culprit named]
    refused = 0  # exit 2: "nothing hangdx can read"
    missed: dict[tuple[str, str, str], int] = {}  # (expected, answered, shows) -> how many, for --pairs
    shows: dict[str, list[int]] = {}  # the annotation artifact_shows_cause -> [category right, total]
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".yaml") or (only is not None and name not in only):
            continue
        with open(os.path.join(folder, name)) as f:
            meta = yaml.safe_load(f) or {}
        expected = str(meta.get("category", "unknown"))
        culprit = meta.get("culprit") or {}
        want_ranks = {int(r) for r in culprit.get("ranks") or []}
        want_hosts = {str(h) for h in culprit.get("hosts") or []}
        log = os.path.join(folder, name[: -len(".yaml")] + ".log")
        proc = subprocess.run(
            [sys.executable, "-m", "hangdx", "analyze", log, "--json"],
            capture_output=True,
            timeout=300,
        )
        refused += proc.returncode == 2
        try:
            rc = json.loads(proc.stdout).get("root_cause") or {}
        except ValueError:
            rc = {}
        found = rc.get("category")
        got = rc.get("culprit") or {}
        label = "-"
        if "artifact_shows_cause" in meta:
            label = {True: "yes", False: "no"}.get(
                meta["artifact_shows_cause"], str(meta["artifact_shows_cause"])
            )
        if found != expected:
            key = (expected, "refused (exit 2)" if proc.returncode == 2 else str(found), label)
            missed[key] = missed.get(key, 0) + 1
        row = tally.setdefault(expected, [0, 0, 0, 0])
        row[0] += found == expected
        row[1] += 1
        if label != "-":
            by = shows.setdefault(label, [0, 0])
            by[0] += found == expected
            by[1] += 1
        if want_ranks or want_hosts:
            row[3] += 1
            row[2] += (
                found == expected
                and {int(r) for r in got.get("ranks") or []} == want_ranks
                and all(any(same_host(h, str(g)) for g in got.get("hosts") or []) for h in want_hosts)
            )
    print(f"{'category':24} {'category right':>15} {'culprit right':>14}")
    print("-" * 55)
    for cat in sorted(tally):
        right, total, cright, named = tally[cat]
        print(f"{cat:24} {f'{right}/{total}':>15} {f'{cright}/{named}' if named else '-':>14}")
    print("-" * 55)
    right, total, cright, named = (sum(r[i] for r in tally.values()) for i in range(4))
    pct = 100 * right / total if total else 0.0
    print(
        f"{'total':24} {f'{right}/{total}':>15} {f'{cright}/{named}':>14}   ({pct:.0f}% of categories right)"
    )
    print(f"refused as unreadable (exit 2): {refused}/{total}")
    if shows:
        # An annotator who writes no rules judged, per case, whether an engineer holding only the artifact could
        # name the cause the thread confirmed (yes), narrow it to two or three (partly), or not at all (no).
        print()
        print(f"{'the artifact alone shows the cause':34} {'category right':>15}")
        print("-" * 50)
        for label in ("yes", "partly", "no"):
            if label in shows:
                print(f"{label:34} {f'{shows[label][0]}/{shows[label][1]}':>15}")
    if pairs:
        print()
        # Each pair once per annotation (yes / partly / no, `-` where the case has none): where the misses the
        # artifacts do show lie, still counts only.
        print(f"{'expected':24} {'answered instead':24} {'shows':>6} {'cases':>5}")
        print("-" * 62)
        for (want, got, label), n in sorted(missed.items()):
            print(f"{want:24} {got:24} {label:>6} {n:>5}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--faults", help="comma-separated faults (default: all)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--real", action="store_true", help="the real-world corpus in tests/fixtures/real/")
    ap.add_argument(
        "--sealed",
        action="store_true",
        help="the sealed corpus in tests/fixtures/sealed/: prints counts per category only, never a case",
    )
    ap.add_argument(
        "--added-since",
        metavar="REV",
        help="with --sealed: only the cases added after this git revision (the fresh ones), still counts only",
    )
    ap.add_argument(
        "--pairs",
        action="store_true",
        help="with --sealed: also count the misses by (expected, answered) category pair, still never a case",
    )
    ap.add_argument(
        "--realistic",
        action="store_true",
        help="the held-out realistic training programs (hangdx/zoo/realistic/)",
    )
    args = ap.parse_args()
    if args.sealed:
        only = None
        if args.added_since:
            only = added_since(args.added_since)
            if only is None:
                print(f"accuracy: git cannot say which sealed cases were added since {args.added_since}")
                return 2
        return sealed(only=only, pairs=args.pairs)
    if args.real:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import real

        print(real.table([real.analyze(c) for c in real.cases()]))
        return 0
    table = REALISTIC if args.realistic else FAULTS
    faults = args.faults.split(",") if args.faults else list(table)
    rows = []
    for fault in faults:
        spec = table[fault]
        for _ in range(args.repeat):
            with ZooJob(fault) as job:
                job.start()
                job.wait_until_stuck(timeout=120 if args.realistic else 90)
                verdict, seconds, peak, probes_peak, err = diagnose(job.job_id)
            rc = (verdict or {}).get("root_cause") or {}
            found = rc.get("category", f"error: {err[:60]}")
            ranks = (rc.get("culprit") or {}).get("ranks")
            expected = f"{spec.category} {list(spec.culprit_ranks)}"
            rows.append(
                (
                    fault,
                    expected if args.realistic else spec.category,
                    found if not args.realistic else f"{found} {ranks}",
                    ranks == sorted(spec.culprit_ranks) and found == spec.category,
                    seconds,
                    peak,
                    probes_peak,
                )
            )
            print(f"  {fault}: {found} {ranks} in {seconds:.1f}s", file=sys.stderr)
    w = 28 if args.realistic else 18
    cw = 30 if args.realistic else 24
    rule = "-" * (w + 2 * cw + 30)
    print()
    print(
        f"{'scenario':{w}} {'expected':{cw}} {'found':{cw}} {'culprit':8} {'seconds':>8} {'peak MB':>8} "
        f"{'+ probes':>8}"
    )
    print(rule)
    for fault, expected, found, right, seconds, peak, probes_peak in rows:
        print(
            f"{fault:{w}} {expected:{cw}} {found:{cw}} {'right' if right else 'WRONG':8} {seconds:8.2f} {peak:8.1f} "
            f"{probes_peak:8.1f}"
        )
    print(rule)
    right = sum(1 for r in rows if r[3])
    median = statistics.median(r[4] for r in rows) if rows else 0.0
    peak = max((r[5] for r in rows), default=0.0)
    probes_peak = max((r[6] for r in rows), default=0.0)
    print(
        f"{right}/{len(rows)} right; median time to verdict {median:.2f}s (target <= 5 s); "
        f"peak memory {peak:.0f} MB (target < 300 MB; {probes_peak:.0f} MB with the largest probe it ran, "
        f"py-spy among them); {os.cpu_count()} cores"
    )
    return 0 if right == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
