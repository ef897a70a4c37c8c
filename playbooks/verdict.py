"""Findings and the verdict, shaped as CONTRACTS.md says (`--json`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hangdx.probes.model import Quote

CATEGORIES = (
    "conditional_collective",
    "collective_mismatch",
    "rank_crashed",
    "dataloader_stall",
    "io_stall",
    "user_deadlock",
    "p2p_deadlock",
    "ddp_unused_parameters",
    "gpu_fault",
    "network_fault",
    "comm_init_failure",
    "straggler",
    "unknown",
)
STATUSES = ("hung", "progressing", "failed", "unknown")


@dataclass
class Culprit:
    ranks: list[int] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    gpus: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    # A process the evidence names without a rank ("gpu-node-01 pid 1005"): only when no rank names it.
    processes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "ranks": sorted(set(self.ranks)),
            "hosts": sorted(set(self.hosts)),
            "gpus": list(dict.fromkeys(self.gpus)),
            "links": list(dict.fromkeys(self.links)),
        }
        if self.processes:
            out["processes"] = list(dict.fromkeys(self.processes))
        return out


@dataclass
class Finding:
    playbook: str
    category: str
    confidence: float
    summary: str
    culprit: Culprit
    evidence: list[Quote]
    fix: str
    next_steps: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"unknown category {self.category!r}")
        self.confidence = round(max(0.0, min(1.0, self.confidence)), 2)

    def to_dict(self) -> dict[str, Any]:
        return {
            "playbook": self.playbook,
            "category": self.category,
            "confidence": self.confidence,
            "summary": self.summary,
            "culprit": self.culprit.to_dict(),
            "evidence": [q.to_dict() for q in self.evidence],
            "fix": self.fix,
            "next_steps": list(self.next_steps),
        }


@dataclass
class Verdict:
    job_id: str | None
    status: str
    findings: list[Finding]
    gaps: list[str] = field(default_factory=list)
    elapsed_seconds: float | None = None
    read: list[str] = field(default_factory=list)  # which parts of the texts were read as what, which skipped
    notes: list[str] = field(default_factory=list)  # how the evidence was gathered ("alert fired on node17")
    # Per rank role, where the ranks wait and the user frames under it (playbooks/roles.py): the fleet memory's
    # "same hang" signature. Not part of the JSON verdict.
    stack_roles: dict[str, list[str]] = field(default_factory=dict)

    @property
    def root_cause(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    def confine_hosts(self, job_hosts: set[str]) -> list[str]:
        """Keep as culprits only hosts of the job (a name the evidence printed is matched to the job's host of
        the same short name, and becomes that name); return the names left out. A log can print any name (a
        shell prompt, a node the job never ran on); only the job's own hosts may be acted on."""
        by_short: dict[str, str] = {}
        for h in sorted(job_hosts):
            by_short.setdefault(h.split(".")[0].lower(), h)
        dropped: list[str] = []
        for f in self.findings:
            kept: list[str] = []
            for h in f.culprit.hosts:
                mine = h if h in job_hosts else by_short.get(str(h).split(".")[0].lower())
                if mine is None:
                    dropped.append(h)
                elif mine not in kept:
                    kept.append(mine)
            f.culprit.hosts = kept
        return list(dict.fromkeys(dropped))

    def to_dict(self) -> dict[str, Any]:
        rc = self.root_cause
        return {
            "job_id": self.job_id,
            "status": self.status,
            "root_cause": {
                "category": rc.category,
                "summary": rc.summary,
                "confidence": rc.confidence,
                "culprit": rc.culprit.to_dict(),
                "fix": rc.fix,
            }
            if rc
            else None,
            "findings": [f.to_dict() for f in self.findings],
            "gaps": list(self.gaps),
            "read": list(self.read),
            "notes": list(self.notes),
        }
