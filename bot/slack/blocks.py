"""Slack messages for a verdict: pure functions from plain dicts to Block Kit, no I/O.

Everything user- or job-derived passes through `redact()` (tokens in logs must not reach a channel) and
mrkdwn escaping (a `<!channel>` quoted from a log must not ping anyone).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from hangdx.bot.render import culprit_text
from hangdx.bot.slurm_actions import looks_like_node
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
SLURM_ACTIONS = ("drain", "requeue", "cancel")
CONFIRM = "confirm"  # the button of a Slurm action kept server-side, its value the action's one-time nonce
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


def mrkdwn(template: str, **values: Any) -> str:
    """hangdx's own words with every value that did not come from hangdx (a job id, an error, a host, a node's
    or a user's text) redacted and escaped: the one way such text becomes a Slack message."""
    return template.format(**{k: escape(str(v), 1000) for k, v in values.items()})


def mention(user: str) -> str:
    """`<@U…>` for a Slack user id; anything else is shown as text, never as a mention or a link."""
    return f"<@{user}>" if re.fullmatch(r"[UW][A-Z0-9]{2,30}", user or "") else escape(str(user), 80)


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


# A thread link as the fleet memory writes it, once escaped: `job 812 (https://slack.com/app_redirect?...)`.
_THREAD_REF = re.compile(
    r"job ([^\s()<>|]{1,200}) \((https://slack\.com/app_redirect\?channel=[A-Z0-9]{2,30}&amp;message_ts=[0-9]{6,12}\.[0-9]{1,9})\)"
)
NOTES_MAX = 8


def linked(escaped: str) -> str:
    """Escaped text whose `job 812 (https://…)` thread references become Slack links named `job 812`."""
    return _THREAD_REF.sub(lambda m: f"<{m.group(2)}|job {m.group(1)}>", escaped)


def _notes_block(notes: list[str]) -> dict[str, Any] | None:
    """The verdict's notes, the most useful first (a known fix, a node to drain), each whole: none cut mid-link."""
    from hangdx.bot.memory import note_rank

    lines = [f"• {linked(escape(clip(str(n), 900), 1100))}" for n in sorted(notes, key=note_rank)[:NOTES_MAX]]
    while lines and len("*Notes*\n" + "\n".join(lines)) > SECTION_MAX:
        lines.pop()
    return _section("*Notes*\n" + "\n".join(lines)) if lines else None


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


def verdict_text(verdict: dict[str, Any], what: str | None = None) -> str:
    """The notification fallback: one line that says what is wrong and who (about `what`: the job by default)."""
    job = what or (f"job {verdict['job_id']}" if verdict.get("job_id") else "the job")
    status = str(verdict.get("status") or "unknown").upper()
    rc = verdict.get("root_cause")
    if not rc:
        return clip(escape(f"hangdx: {job} {status}: no root cause found"), SECTION_MAX)
    line = (
        f"hangdx: {job} {status}: {rc.get('category')} ({float(rc.get('confidence') or 0):.2f}), "
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


def _confirm(title: str, text: str, go: str) -> dict[str, Any]:
    # "Go back", not "Cancel": under "Cancel job?" two buttons read "Cancel".
    return {
        "title": _plain(title, 100),
        "text": {"type": "mrkdwn", "text": clip(text, 300)},
        "confirm": _plain(go, 30),
        "deny": _plain("Go back", 30),
        "style": "danger",
    }


def _slurm_block(job_id: str, hosts: list[str]) -> dict[str, Any] | None:
    """Drain the culprit nodes, requeue or cancel the job: each behind Slack's confirmation dialog."""
    if not re.fullmatch(r"[0-9]+(?:_[0-9]+)?", job_id):
        return None  # not a Slurm job id: nothing Slurm can act on
    buttons = []
    for host in [h for h in hosts if len(h) <= 100 and looks_like_node(h)][:3]:  # never `all`: every node
        buttons.append({
            "type": "button", "action_id": ACTION_PREFIX + "drain", "style": "danger",
            "text": _plain(f"Drain {host}", 75), "value": f"{job_id}|{host}",
            "confirm": _confirm(f"Drain {host}?", f"No new job will start on *{host}* until someone resumes it "
                                "(`scontrol update NodeName=… State=RESUME`).", "Drain"),
        })  # fmt: skip
    for action, label, what in (
        ("requeue", "Requeue job", "put back in the queue"),
        ("cancel", "Cancel job", "ended"),
    ):
        buttons.append({
            "type": "button", "action_id": ACTION_PREFIX + action, "text": _plain(label, 75), "value": job_id,
            "confirm": _confirm(f"{label}?", f"Job *{job_id}* will be {what}.", label),
        })  # fmt: skip
    return {"type": "actions", "block_id": "hangdx_slurm", "elements": buttons}


def confirm_blocks(what: str, nonce: str) -> list[dict[str, Any]]:
    """The message only the presser sees after a Slurm button: what will be done, and the one button that does
    it (its value a one-time nonce; the action itself is kept by hangdx, never read back from Slack)."""
    return [
        {"type": "section", "text": {"type": "mrkdwn", "text": clip(what, 2900)}},
        {"type": "actions", "block_id": "hangdx_confirm", "elements": [{
            "type": "button", "action_id": ACTION_PREFIX + CONFIRM, "style": "danger", "value": nonce,
            "text": _plain("Confirm", 30),
        }]},
    ]  # fmt: skip


def verdict_blocks(verdict: dict[str, Any], job_id: str | None, slurm: bool = False) -> list[dict[str, Any]]:
    """The verdict message: status, root cause, culprit, summary, fix, evidence, next steps, and the buttons
    of the job's incident (none for pasted evidence, `job_id` None); the Slurm buttons only for a job Slurm
    knows (`slurm`: the caller asked it)."""
    status = str(verdict.get("status") or "unknown")
    icon = _STATUS_ICON.get(status, "⚪")
    title = f"Job {job_id}" if job_id else "Pasted evidence"
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": _plain(f"{icon} {title}: {status.upper()}", HEADER_MAX)}
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
        notes_block = _notes_block(verdict.get("notes") or [])
        if notes_block:
            blocks.append(notes_block)
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
    notes = verdict.get("notes") or []
    if notes and not rc:
        context.append("Notes: " + "; ".join(linked(escape(n, 600)) for n in notes[:NOTES_MAX]))
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
    if not job_id:
        return blocks[:BLOCKS_MAX]
    tail = [_actions_block(job_id)]
    hosts = [str(h) for h in ((rc or {}).get("culprit") or {}).get("hosts") or []]
    slurm_block = _slurm_block(job_id, hosts) if slurm else None
    if slurm_block is not None:
        tail.append(slurm_block)
    # The action blocks are last and must survive the cap.
    return blocks[: BLOCKS_MAX - len(tail)] + tail


def analysis_blocks(verdict: dict[str, Any]) -> list[dict[str, Any]]:
    """The verdict on pasted evidence, then which parts were read as what and which were skipped."""
    said = []
    read = [escape(r, 300) for r in verdict.get("read") or []]
    if read:
        said.append("Read: " + "; ".join(read[:8]) + (f"; and {len(read) - 8} more" if len(read) > 8 else ""))
    skipped = [escape(s, 200) for s in verdict.get("skipped") or []]
    if skipped:
        more = f"; and {len(skipped) - 8} more" if len(skipped) > 8 else ""
        said.append("Skipped: " + "; ".join(skipped[:8]) + more)
    # Nothing was collected from a paste: what could not be used is said with what was read and skipped.
    gaps = [escape(g, 200) for g in verdict.get("gaps") or []]
    if gaps:
        said.append(
            "Could not use: " + "; ".join(gaps[:5]) + (f"; and {len(gaps) - 5} more" if len(gaps) > 5 else "")
        )
    blocks = verdict_blocks({**verdict, "gaps": []}, None)[: BLOCKS_MAX - 1]
    if said:
        blocks.append(
            {"type": "context", "elements": [{"type": "mrkdwn", "text": clip(t, SECTION_MAX)} for t in said]}
        )
    return blocks


def analysis_text(verdict: dict[str, Any]) -> str:
    """The notification fallback for pasted evidence."""
    return verdict_text(verdict, "pasted evidence")


def help_blocks() -> list[dict[str, Any]]:
    """What `/diagnose help` answers."""
    text = (
        "*hangdx* diagnoses a hung distributed training job: it probes every rank and names the culprit.\n"
        "• `/diagnose <jobid>`: diagnose a job (Slurm job id or torchrun run id)\n"
        "• `@hangdx diagnose <jobid>` in a thread: diagnose and answer in that thread\n"
        "• `/diagnose status`: the open incidents (only you see it)\n"
        "• `/diagnose handoff`: post a hand-off summary for the next on-call in this channel\n"
        "• `/diagnose help`: this message\n"
        "On a verdict: *Re-run* diagnoses again, *Full stacks* uploads every rank's stacks, "
        "*Acknowledge*, *Resolve* and *Hand off* track the incident."
    )
    return [_section(text)]


# -- open incidents: `/diagnose status` and the hand-off summary ------------------------------------

_SLACK_ID = re.compile(r"^[UW][A-Z0-9]{2,}$")
_INCIDENT_ICON = {"investigating": "🔍", "diagnosed": "🔴", "acknowledged": "🟡", "resolved": "✅"}
# Header + one section per incident + a "more" context must stay under BLOCKS_MAX.
INCIDENTS_MAX = 40


def _count(n: int) -> str:
    return f"{n} open incident" + ("" if n == 1 else "s")


def _age(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def _owner(owner: Any) -> str:
    """A Slack user id becomes a mention; anything else is text (and cannot ping anyone)."""
    if not owner:
        return "nobody yet"
    owner = str(owner)
    return f"<@{owner}>" if _SLACK_ID.fullmatch(owner) else escape(owner, 200)


def _latest_root_cause(inc: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(root_cause, top finding) of the incident's latest verdict; the finding carries next_steps."""
    verdicts = inc.get("verdicts") or []
    v = verdicts[-1] if verdicts else {}
    findings = v.get("findings") or []
    rc = v.get("root_cause") or (findings[0] if findings else None)
    return rc, (findings[0] if findings else (rc or {}))


def _root_cause_line(inc: dict[str, Any]) -> str:
    rc, _ = _latest_root_cause(inc)
    if rc:
        return f"`{escape(rc.get('category', 'unknown'), 100)}`, culprit {escape(_culprit(rc.get('culprit')), 500)}"
    if inc.get("verdicts"):
        return "no root cause found"
    return "no verdict yet"


def _thread_link(inc: dict[str, Any]) -> str:
    channel, ts = inc.get("channel"), inc.get("thread_ts")
    if (
        not channel
        or not ts
        or not re.fullmatch(r"[A-Z0-9]+", str(channel))
        or not re.fullmatch(r"[0-9.]+", str(ts))
    ):
        return ""
    return f"<https://slack.com/app_redirect?channel={channel}&message_ts={ts}|thread>"


# A diagnosis that ended without a verdict: the incident's status (investigating) alone would say it is under way.
_DIAGNOSIS_ENDED = {"failed": "diagnosis failed", "interrupted": "diagnosis interrupted"}


def _incident_header(inc: dict[str, Any], now: float) -> str:
    status = str(inc.get("status") or "?")
    icon = _INCIDENT_ICON.get(status, "⚪")
    shown = escape(status, 50)
    ended = _DIAGNOSIS_ENDED.get(str(inc.get("diagnosis") or ""))
    if ended:
        icon, shown = "❌", f"{ended} ({shown})"
    age = _age(now - float(inc.get("created") or now))
    link = _thread_link(inc)
    head = f"{icon} *Job {escape(inc.get('job_id', '?'), 200)}*: {shown}, open {age}" + (
        f" · {link}" if link else ""
    )
    if ended and inc.get("diagnosis_error"):
        head += "\n" + escape(f"Why: {inc['diagnosis_error']}", 600)
    return head


def _incident_list(
    title: str, incidents: list[dict[str, Any]], body: Callable[[dict[str, Any]], str], now: float | None
) -> list[dict[str, Any]]:
    now = time.time() if now is None else now
    blocks: list[dict[str, Any]] = [{"type": "header", "text": _plain(title, HEADER_MAX)}]
    if not incidents:
        return blocks + [_section("No open incidents.")]
    for inc in incidents[:INCIDENTS_MAX]:
        blocks.append(_section(_incident_header(inc, now) + "\n" + body(inc)))
    if len(incidents) > INCIDENTS_MAX:
        more = f"…and {len(incidents) - INCIDENTS_MAX} more open incidents not shown."
        blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": more}]})
    return blocks


def status_blocks(incidents: list[dict[str, Any]], now: float | None = None) -> list[dict[str, Any]]:
    """`/diagnose status`: each open incident's job, status, age, owner, root cause, culprit and thread."""

    def body(inc: dict[str, Any]) -> str:
        return f"Owner: {_owner(inc.get('owner'))} · Root cause: {_root_cause_line(inc)}"

    return _incident_list("hangdx status: " + _count(len(incidents)), incidents, body, now)


def handoff_blocks(
    incidents: list[dict[str, Any]],
    now: float | None = None,
    lemons: list[tuple[str, int, list[str]]] | None = None,
    week: dict[str, list] | None = None,
) -> list[dict[str, Any]]:
    """The hand-off for the next on-call: per open incident its state, root cause, owner and next steps; then the
    lemon nodes (culprit again and again: drain them)."""

    def body(inc: dict[str, Any]) -> str:
        rc, top = _latest_root_cause(inc)
        lines = [f"Owner: {_owner(inc.get('owner'))}", f"Root cause: {_root_cause_line(inc)}"]
        if rc and rc.get("summary"):
            lines.append(f"Summary: {clip(escape(rc['summary'], 600), 600)}")
        steps = top.get("next_steps") or []
        if steps:
            lines.append("Next steps:")
            lines += [f"• {clip(escape(s, 300), 300)}" for s in steps[:5]]
        elif not rc:
            lines.append("Next steps: run `/diagnose " + escape(inc.get("job_id") or "JOBID", 200) + "`")
        return "\n".join(lines)

    oldest_first = sorted(incidents, key=lambda i: float(i.get("created") or 0))
    blocks = _incident_list("On-call hand-off: " + _count(len(incidents)), oldest_first, body, now)
    blocks += _week_blocks(week or {})
    if lemons:
        lines = [
            f"• {escape(host, 200)}: culprit in {n} incidents ({linked(escape(', '.join(jobs[:5]), 1500))})"
            for host, n, jobs in lemons[:10]
        ]
        blocks.append(
            _section(
                "*Lemon nodes* (drain them: `scontrol update NodeName=… State=DRAIN`)\n" + "\n".join(lines)
            )
        )
    return blocks[:BLOCKS_MAX]


def _week_blocks(week: dict[str, list]) -> list[dict[str, Any]]:
    """The hand-off's week: what was done from hangdx, repeat hangs, what was resolved and how."""
    out = []
    if week.get("actions"):
        lines = [f"• {escape(a['action'], 20)} {escape(a['target'], 200)} ("
                 + (f"job {escape(a['job'], 100)}, " if a.get("job") else "") + f"by {mention(a['user'])})"
                 for a in week["actions"][-10:]]  # fmt: skip
        out.append(_section("*Done this week*\n" + "\n".join(lines)))
    if week.get("repeats"):
        lines = [f"• `{escape(r['category'], 60)}` in {escape(r['where'], 200)}: jobs "
                 f"{escape(', '.join(r['jobs'][:8]), 300)}" for r in week["repeats"][:8]]  # fmt: skip
        out.append(_section("*Repeat hangs* (one cause, several jobs)\n" + "\n".join(lines)))
    if week.get("resolved"):
        lines = [f"• job {escape(r['job'], 100)} (`{escape(r['category'], 60)}`): {escape(r['resolution'], 300)}"
                 for r in week["resolved"][:8]]  # fmt: skip
        out.append(_section("*Resolved this week, and how*\n" + "\n".join(lines)))
    return out


def history_blocks(name: str, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`/diagnose history <host|job>`: the incidents that involved it, newest first, with their resolutions."""
    title = f"History of {name}: {len(records)} incident{'s' if len(records) != 1 else ''}"
    blocks: list[dict[str, Any]] = [{"type": "header", "text": _plain(title, HEADER_MAX)}]
    if not records:
        return blocks + [_section("No incident involved it in the fleet memory.")]
    for r in records[:INCIDENTS_MAX]:
        runs = f" (diagnosed {r['diagnoses']} times)" if int(r.get("diagnoses") or 1) > 1 else ""
        line = f"*{escape(r['day'], 20)}* job {escape(r['job'], 200)}{runs}: `{escape(r['category'], 60)}` ({escape(r['as'], 10)})"
        line += f"\n{clip(escape(r['summary'], 400), 400)}"
        if r.get("resolution"):
            line += f"\nResolved by: {clip(escape(r['resolution'], 300), 300)}"
        blocks.append(_section(line))
    return blocks[:BLOCKS_MAX]
