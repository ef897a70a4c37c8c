"""A request for a diagnosis: what a Slack command, a mention, an alert, a button or the CLI all become."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SOURCES = ("slash", "mention", "alert", "button", "cli", "schedule", "watch")


@dataclass
class DiagnoseRequest:
    job_id: str
    source: str  # one of SOURCES
    requested_by: str  # a Slack user id, "alertmanager", "cli:<user>", "hangdx watch"
    channel: str | None = None  # where to answer (Slack channel id)
    thread_ts: str | None = None  # the thread to answer in, when there is one
    hosts: list[str] = field(default_factory=list)  # hosts named by an alert; else the resolver decides
    summary: str | None = None  # an alert's own words

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DiagnoseRequest:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)


@dataclass
class AnalyzeRequest:
    """Diagnose what people pasted in Slack: a thread (`@hangdx analyze`) or one message (the shortcut)."""

    channel: str
    thread_ts: str  # the thread read, and answered in
    requested_by: str  # a Slack user id
    source: str  # "mention" or "shortcut"
    message_ts: str | None = None  # the shortcut's one message; None reads the whole thread

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AnalyzeRequest:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)


class Busy(Exception):
    """A request refused for now (a per-person or per-thread limit): said to whoever asked, in one line."""
