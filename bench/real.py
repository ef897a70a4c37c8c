"""The real-world corpus (tests/fixtures/real/): artifacts copied from public bug reports, each with its sidecar.

    python bench/accuracy.py --real

For each case: the category and culprit its sidecar names (what the thread confirmed, readable from the artifact
alone), and what `hangdx analyze` finds in the artifact. Targets: at least 90% of categories right; the culprit
right wherever the case names one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from hangdx.playbooks import engine
from hangdx.probes.bundle import evidence_from_paths
from hangdx.probes.normalise import same_host

REAL = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "real"


@dataclass
class Case:
    slug: str
    log: Path
    url: str
    category: str
    ranks: list[int]
    hosts: list[str]
    belief_only: bool


@dataclass
class Result:
    case: Case
    found: str
    ranks: list[int]
    hosts: list[str]
    seconds: float
    summary: str

    @property
    def category_right(self) -> bool:
        return self.found == self.case.category

    @property
    def culprit_named(self) -> bool:
        return bool(self.case.ranks or self.case.hosts)

    @property
    def culprit_right(self) -> bool:
        return set(self.case.ranks) == set(self.ranks) and all(
            any(same_host(h, g) for g in self.hosts) for h in self.case.hosts
        )


def cases(folder: Path = REAL) -> list[Case]:
    out = []
    for side in sorted(folder.glob("*.yaml")):
        meta = yaml.safe_load(side.read_text()) or {}
        log = side.with_suffix(".log")
        culprit = meta.get("culprit") or {}
        out.append(
            Case(
                side.stem,
                log,
                str(meta.get("url", "")),
                str(meta.get("category", "unknown")),
                [int(r) for r in culprit.get("ranks") or []],
                [str(h) for h in culprit.get("hosts") or []],
                bool(meta.get("belief_only")),
            )
        )
    return out


def analyze(case: Case) -> Result:
    """What `hangdx analyze FILE` finds, in process (the same path as the command line)."""
    t = time.monotonic()
    v = engine.run(evidence_from_paths([str(case.log)]))
    rc = v.root_cause
    return Result(
        case,
        rc.category if rc else "unknown",
        list(rc.culprit.ranks) if rc else [],
        list(rc.culprit.hosts) if rc else [],
        time.monotonic() - t,
        rc.summary if rc else "",
    )


def table(results: list[Result]) -> str:
    lines = [f"{'case':58} {'expected':24} {'found':24} {'culprit':8}", "-" * 118]
    for r in results:
        culprit = ("right" if r.culprit_right else "WRONG") if r.culprit_named else "-"
        mark = "" if r.category_right else "  <-"
        lines.append(f"{r.case.slug[:58]:58} {r.case.category:24} {r.found:24} {culprit:8}{mark}")
    n = len(results)
    right = sum(r.category_right for r in results)
    named = [r for r in results if r.culprit_named]
    cright = sum(r.culprit_right and r.category_right for r in named)
    lines.append("-" * 118)
    pct = 100 * right / n if n else 0.0
    lines.append(
        f"{right}/{n} categories right ({pct:.0f}%, target >= 90%); culprit right in {cright}/{len(named)} cases "
        f"that name one; {sum(r.case.belief_only for r in results)} cases rest on the reporter's belief only"
    )
    return "\n".join(lines)
