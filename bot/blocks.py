"""Slack messages for a verdict: pure functions from plain dicts to Block Kit, no I/O.

Everything user- or job-derived passes through `redact()` (tokens in logs must not reach a channel) and
mrkdwn escaping (a `<!channel>` quoted from a log must not ping anyone).
"""

from __future__ import annotations

from typing import Any

from hangdx.bot.render import culprit_text
from hangdx.playbooks.verdict import Culprit
from hangdx.probes.collector import redact

# Slack's documented limits (Block Kit reference).
HEADER_MAX = 150
SECTION_MAX = 3000
FIELD_MAX = 2000
BLOCKS_MAX = 50
EVIDENCE_LINES = 10
EVIDENCE_LINE_MAX = 300

ACTIONS = ("rerun", "stacks", "ack", "resolve", "handoff")
ACTION_PREFIX = "hangdx_"
_BUTTON_LABELS = {
    "rerun": "Re-run",
    "stacks": "Full stacks",
    "ack": "Acknowledge",
    "resolve": "Resolve",
    "handoff": "Hand off",
}
_STATUS_ICON = {"hung": "🔴", "failed": "🔴", "progressing": "🟡", "unknown": "⚪"}


def escape(text: str, limit: int = SECTION_MAX) -> str:
    """Redact secrets, then escape the three characters mrkdwn treats as control (&, <, >)."""
    # Cut before redacting: redact() costs more than linear time on long unbroken runs of characters.
    text = redact(str(text)[: limit + 200])
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _plain(text: str, limit: int) -> dict[str, Any]:
    return {"type": "plain_text", "text": clip(redact(str(text)[: limit + 200]), limit), "emoji": True}


def _section(mrkdwn: str) -> dict[str, Any]:
    return {"type": "section", "text": {"type": "mrkdwn", "text": clip(mrkdwn, SECTION_MAX)}}


def _culprit(d: dict[str, Any] | None) -> str:
    d = d or {}
    return culprit_text(
        Culprit(
            ranks=list(d.get("ranks") or []),
            hosts=list(d.get("hosts") or []),
            gpus=list(d.get("gpus") or []),
            links=list(d.get("links") or []),
        )
    )


def _code(lines: list[str]) -> str:
    # Triple backticks inside a quoted line would close the code block early.
    return "```" + "\n".join(line.replace("```", "'''") for line in lines) + "```"


def progress_text(job_id: str, hosts_total: int, hosts_done: int) -> str:
    """The one-line progress message a diagnosis updates in place."""
    job = escape(job_id)
    if hosts_total <= 0:
        return f":hourglass_flowing_sand: Diagnosing job {job}… finding its hosts"
    done = max(0, min(hosts_done, hosts_total))
    if done >= hosts_total:
        return f":hourglass_flowing_sand: Diagnosing job {job}… evidence from {hosts_total}/{hosts_total} hosts, running playbooks"
    return (
        f":hourglass_flowing_sand: Diagnosing job {job}… collecting evidence from {done}/{hosts_total} hosts"
    )


def verdict_text(verdict: dict[str, Any]) -> str:
    """The notification fallback: one line that says what is wrong and who."""
    job = verdict.get("job_id") or "?"
    status = str(verdict.get("status") or "unknown").upper()
    rc = verdict.get("root_cause")
    if not rc:
        return clip(escape(f"hangdx: job {job} {status}: no root cause found"), SECTION_MAX)
    line = (
        f"hangdx: job {job} {status}: {rc.get('category')} ({float(rc.get('confidence') or 0):.2f}), "
        f"culprit {_culprit(rc.get('culprit'))}. {rc.get('summary') or ''}"
    )
    return clip(escape(line.strip()), SECTION_MAX)


def _evidence_block(finding: dict[str, Any]) -> dict[str, Any] | None:
    quotes = finding.get("evidence") or []
    if not quotes:
        return None
    lines = []
    for q in quotes[:EVIDENCE_LINES]:
        where = f"{q.get('source')}:{q.get('line')}" if q.get("line") else str(q.get("source"))
        lines.append(clip(escape(f"{where}  {q.get('text', '')}", EVIDENCE_LINE_MAX), EVIDENCE_LINE_MAX))
    title = f"*Evidence* ({len(lines)} of {len(quotes)} lines)" if len(quotes) > len(lines) else "*Evidence*"
    # Keep the whole section under Slack's limit: drop trailing lines rather than cut the fence.
    while lines and len(title) + 1 + len(_code(lines)) > SECTION_MAX:
        lines.pop()
    return _section(f"{title}\n{_code(lines)}")


def _actions_block(job_id: str) -> dict[str, Any]:
    buttons = []
    for action in ACTIONS:
        button: dict[str, Any] = {
            "type": "button",
            "action_id": ACTION_PREFIX + action,
            "text": {"type": "plain_text", "text": _BUTTON_LABELS[action], "emoji": True},
            "value": job_id,
        }
        if action == "rerun":
            button["style"] = "primary"
        buttons.append(button)
    return {"type": "actions", "block_id": "hangdx_actions", "elements": buttons}


def verdict_blocks(verdict: dict[str, Any], job_id: str) -> list[dict[str, Any]]:
    """The verdict message: status, root cause, culprit, summary, fix, evidence, next steps, buttons."""
    status = str(verdict.get("status") or "unknown")
    icon = _STATUS_ICON.get(status, "⚪")
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": _plain(f"{icon} Job {job_id}: {status.upper()}", HEADER_MAX)}
    ]
    rc = verdict.get("root_cause")
    findings = verdict.get("findings") or []
    top = findings[0] if findings else (rc or {})
    if rc:
        fields = [
            f"*Root cause*\n`{escape(rc.get('category', 'unknown'))}`",
            f"*Confidence*\n{float(rc.get('confidence') or 0):.2f}",
            f"*Culprit*\n{escape(_culprit(rc.get('culprit')))}",
        ]
        blocks.append(
            {
                "type": "section",
                "fields": [{"type": "mrkdwn", "text": clip(f, FIELD_MAX)} for f in fields],
            }
        )
        blocks.append(_section(f"*Summary*\n{escape(rc.get('summary') or '')}"))
        if rc.get("fix"):
            blocks.append(_section(f"*Fix*\n{escape(rc['fix'])}"))
        evidence = _evidence_block(top)
        if evidence:
            blocks.append(evidence)
    else:
        blocks.append(_section("*No root cause found.* The evidence does not support any known hang."))
    steps = top.get("next_steps") or []
    if steps:
        blocks.append(
            _section("*Next steps*\n" + "\n".join(f"• {clip(escape(s, 500), 500)}" for s in steps[:10]))
        )
    others = [
        f"{escape(f.get('category'))} ({float(f.get('confidence') or 0):.2f}): {escape(_culprit(f.get('culprit')))}"
        for f in findings[1:6]
    ]
    context = []
    if others:
        context.append("Also considered: " + "; ".join(others))
    gaps = verdict.get("gaps") or []
    if gaps:
        context.append("Not collected: " + "; ".join(escape(g) for g in gaps[:5]))
    if context:
        blocks.append(
            {
                "type": "context",
                "elements": [{"type": "mrkdwn", "text": clip(c, SECTION_MAX)} for c in context],
            }
        )
    blocks.append(_actions_block(job_id))
    # The actions block is last and must survive the cap.
    return blocks[: BLOCKS_MAX - 1] + [blocks[-1]] if len(blocks) > BLOCKS_MAX else blocks


def help_blocks() -> list[dict[str, Any]]:
    """What `/diagnose help` answers."""
    text = (
        "*hangdx* diagnoses a hung distributed training job: it probes every rank and names the culprit.\n"
        "• `/diagnose <jobid>`: diagnose a job (Slurm job id or torchrun run id)\n"
        "• `@hangdx diagnose <jobid>` in a thread: diagnose and answer in that thread\n"
        "• `/diagnose help`: this message\n"
        "On a verdict: *Re-run* diagnoses again, *Full stacks* uploads every rank's stacks, "
        "*Acknowledge*, *Resolve* and *Hand off* track the incident."
    )
    return [_section(text)]
