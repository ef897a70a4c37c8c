"""The verdict for people: a terminal report (rich), Markdown for hand-offs, JSON for scripts."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from hangdx.playbooks.verdict import Culprit, Verdict
from hangdx.playbooks.wording import name_set, number_set
from hangdx.probes.text import printable

if TYPE_CHECKING:
    from rich.console import Console

_STATUS_STYLE = {
    "hung": "bold red",
    "failed": "bold red",
    "progressing": "bold yellow",
    "unknown": "bold white",
}


def culprit_text(c: Culprit) -> str:
    parts = []
    if c.ranks:
        parts.append(("rank " if len(set(c.ranks)) == 1 else "ranks ") + number_set(c.ranks))
    if c.hosts:
        parts.append(("host " if len(c.hosts) == 1 else "hosts ") + name_set(c.hosts))
    if c.gpus:
        parts.append("GPU " + name_set(c.gpus))
    if c.links:
        parts.append("link " + name_set(c.links))
    if c.processes and not c.ranks:
        parts.append(("process " if len(c.processes) == 1 else "processes ") + ", ".join(c.processes))
    return "; ".join(parts) or "none named"


def to_json(v: Verdict) -> str:
    return json.dumps(v.to_dict(), indent=2)


def terminal(v: Verdict, console: Console, verbose: bool = False) -> None:
    """Print the verdict as a report a tired on-call engineer can act on. Every string of the verdict came
    from evidence someone else wrote: each goes through printable()."""
    from rich.console import Group  # here: the JSON verdict (to_json) needs none of rich
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    p = printable
    rc = v.root_cause
    head = Text()
    head.append(f"job {p(v.job_id, False)}  " if v.job_id else "evidence  ", style="bold")
    head.append(p(v.status.upper()), style=_STATUS_STYLE.get(v.status, "bold"))
    if rc is None:
        console.print(Panel(Group(head, Text("no finding")), title="hangdx"))
        return
    body = [head, Text("")]
    body.append(
        Text.assemble(
            ("Root cause  ", "bold"), (p(rc.category), "bold cyan"), f"  (confidence {rc.confidence:.2f})"
        )
    )
    body.append(Text(p(rc.summary)))
    body.append(Text.assemble(("Culprit     ", "bold"), p(culprit_text(rc.culprit))))
    body.append(Text.assemble(("Fix         ", "bold"), p(rc.fix)))
    if rc.evidence:
        body.append(Text("Evidence", style="bold"))
        for q in rc.evidence[: 12 if verbose else 6]:
            where = f"{q.source}:{q.line}" if q.line else q.source
            body.append(Text.assemble(("  " + p(where, False) + "  ", "dim"), p(q.text[:240], False)))
    if rc.next_steps:
        body.append(Text("Next steps", style="bold"))
        for s in rc.next_steps:
            body.append(Text("  - " + p(s)))
    console.print(
        Panel(Group(*body), title="hangdx verdict", border_style="red" if v.status == "hung" else "yellow")
    )
    others = v.findings[1:]
    if others:
        t = Table(title="Other findings", show_lines=False, expand=True)
        t.add_column("category", style="cyan", no_wrap=True)
        t.add_column("conf", justify="right")
        t.add_column("culprit")
        t.add_column("summary", ratio=3)
        for f in others:
            t.add_row(p(f.category), f"{f.confidence:.2f}", p(culprit_text(f.culprit)), p(f.summary))
        console.print(t)
    if v.read and (verbose or len(v.read) <= 3):
        console.print(Text("Read:", style="bold dim"))
        for r in v.read[:20]:
            console.print(Text("  " + p(r, False), style="dim"))
    if v.gaps:
        console.print(Text("Not seen:", style="bold dim"))
        for g in v.gaps[: 20 if verbose else 6]:
            console.print(Text("  " + p(g, False), style="dim"))
        if len(v.gaps) > 6 and not verbose:
            console.print(Text(f"  ... and {len(v.gaps) - 6} more", style="dim"))


def markdown(v: Verdict) -> str:
    """The verdict as Markdown, for a hand-off or a postmortem."""
    rc = v.root_cause
    out = [f"## hangdx: {'job ' + v.job_id if v.job_id else 'the evidence'} is {v.status}", ""]
    if rc:
        out += [
            f"**Root cause:** `{rc.category}` (confidence {rc.confidence:.2f})",
            "",
            rc.summary,
            "",
            f"**Culprit:** {culprit_text(rc.culprit)}",
            "",
            f"**Fix:** {rc.fix}",
            "",
            "**Evidence:**",
            "",
            "```",
            *[f"{q.source}:{q.line}  {q.text}" if q.line else f"{q.source}  {q.text}" for q in rc.evidence],
            "```",
            "",
            "**Next steps:**",
            "",
            *[f"- {s}" for s in rc.next_steps],
        ]
    if len(v.findings) > 1:
        out += ["", "**Other findings:**", ""]
        out += [f"- `{f.category}` ({f.confidence:.2f}): {f.summary}" for f in v.findings[1:]]
    return "\n".join(out) + "\n"
