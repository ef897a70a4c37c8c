"""What was tried against hangdx and what held: faults survived, bad inputs tried, incidents lost.

    python bench/hardening.py [--quick] [--junit FILE]

Runs the failure, abuse and fuzzing tests (real redis-server, real RQ workers, real `hangdx serve`,
the Slack stand-in, real sshd) under pytest and prints one table from what they measured. Each test
records its numbers with pytest's `record_property`:

- failure tests (tests/failure): `incidents` expected, `lost` and `doubled` incidents or verdict posts;
- abuse and fuzzing tests (tests/abuse, tests/core): `inputs`, how many hostile inputs were tried.

A row "held" when its test passed. The target: every fault survived, 0 incidents lost or doubled.
--quick leaves out the tests that start a real hung torch job (marker `zoo`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUITES = {
    "fault": ["tests/failure", "tests/bot/test_worker_redis_full.py"],
    "bad input": [
        "tests/abuse",
        "tests/core/test_fuzz.py",
        "tests/core/test_hostile_input.py",
        "tests/core/test_bad_input.py",
        "tests/bot/test_slack_app.py",
        "tests/bot/test_memory_notes.py",
        "tests/slurm/test_watch_hostile_names.py",
        "tests/ssh/test_ssh.py",
        "tests/bot/test_culprit_hosts.py",  # 21.1-2, 12: a name a log or an alert printed is never acted on
        "tests/slurm/test_actions.py",  # 21.1, 17: `drain all`, forged drain buttons and confirmations
        "tests/bot/test_watch_storm.py",  # 21.11: 40 jobs stalling at once
        "tests/bot/test_queue.py",  # 21.9: pastes behind alerts, limited per person and thread
        "tests/bot/test_incidents.py",  # 21.6: status reads one line per incident
    ],
}


def run(paths: list[str], junit: Path, quick: bool) -> int:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    cmd += ["-o", "junit_family=xunit1"]  # xunit1 keeps record_property's values in the XML
    if quick:
        cmd += ["-m", "not zoo"]
    existing = [p for p in paths if (ROOT / p).exists()]
    if not existing:
        return 0
    return subprocess.run(cmd + existing, cwd=ROOT).returncode


def rows(junit: Path) -> list[dict]:
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            continue
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        failed = case.find("failure") is not None or case.find("error") is not None
        name = case.get("name", "")
        module = case.get("classname", "").rsplit(".", 1)[-1]
        out.append({"test": f"{module}::{name}", "held": not failed, **props})
    return out


def _int(row: dict, key: str) -> int:
    try:
        return int(float(row.get(key) or 0))
    except ValueError:
        return 0


def grouped(found: list[dict]) -> list[dict]:
    """Bad-input rows by test function: its parametrized cases summed (inputs: recorded, else 1 per case)."""
    groups: dict[str, dict] = {}
    for r in found:
        g = groups.setdefault(r["test"].split("[", 1)[0], {"cases": 0, "held": 0, "inputs": 0})
        g["cases"] += 1
        g["held"] += r["held"]
        g["inputs"] += max(1, _int(r, "inputs"))
    return [{"test": name, **g} for name, g in groups.items()]


def _name(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def table(kind: str, found: list[dict]) -> list[str]:
    if kind == "fault":
        width = min(100, max([len(r["test"]) for r in found] + [20]))
        head = f"{'fault (test)':<{width}}  {'held':>4}  {'incidents':>9}  {'lost':>4}  {'doubled':>7}"
        lines = [head, "-" * len(head)]
        for r in found:
            lines.append(
                f"{_name(r['test'], width):<{width}}  {'yes' if r['held'] else 'NO':>4}  "
                f"{_int(r, 'incidents'):>9}  {_int(r, 'lost'):>4}  {_int(r, 'doubled'):>7}"
            )
        return lines
    groups = grouped(found)
    width = min(100, max([len(g["test"]) for g in groups] + [20]))
    head = f"{'bad input (test)':<{width}}  {'held':>7}  {'inputs':>7}"
    lines = [head, "-" * len(head)]
    for g in groups:
        held = f"{g['held']}/{g['cases']}"
        lines.append(f"{_name(g['test'], width):<{width}}  {held:>7}  {g['inputs']:>7}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="leave out tests that start a real hung torch job")
    args = ap.parse_args()
    report: list[str] = []
    totals = {"faults": 0, "survived": 0, "incidents": 0, "lost": 0, "doubled": 0, "inputs": 0, "bad": 0}
    bad_held = 0
    status = 0
    with tempfile.TemporaryDirectory() as tmp:
        for kind, paths in SUITES.items():
            junit = Path(tmp) / f"{kind.replace(' ', '_')}.xml"
            status |= run(paths, junit, args.quick)
            found = rows(junit) if junit.exists() else []
            report += ["", *table(kind, found)]
            for r in found:
                if kind == "fault":
                    totals["faults"] += 1
                    totals["survived"] += r["held"]
                    for k in ("incidents", "lost", "doubled"):
                        totals[k] += _int(r, k)
                else:
                    totals["bad"] += 1
                    bad_held += r["held"]
                    totals["inputs"] += max(1, _int(r, "inputs"))
    print("\n".join(report))
    print()
    print(
        f"faults survived {totals['survived']}/{totals['faults']}; incidents {totals['incidents']}, "
        f"lost {totals['lost']}, doubled {totals['doubled']} (target 0); "
        f"bad-input tests held {bad_held}/{totals['bad']}, {totals['inputs']} hostile inputs tried"
    )
    return 0 if status == 0 and totals["lost"] == 0 and totals["doubled"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
