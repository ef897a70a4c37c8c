"""The resolution dialog: resolving an incident asks for one line (optional) saying how it was fixed; the fleet
memory quotes it when the same hang comes back."""

from __future__ import annotations

import json
import logging
from typing import Any

from slack_bolt import App
from slack_sdk.errors import SlackApiError

from hangdx.bot import access
from hangdx.bot.slack.blocks import clip
from hangdx.bot.slack.common import Surfaces, slack_error

log = logging.getLogger("hangdx.bot")
RESOLUTION = "hangdx_resolution"


def resolution_view(job_id: str, channel: str = "") -> dict[str, Any]:
    """The dialog for a job's incident. Its submission names no channel, so the view carries the channel of the
    thread whose button opened it (private_metadata is set by hangdx and comes back from Slack unchanged)."""
    return {
        "type": "modal",
        "callback_id": RESOLUTION,
        "private_metadata": json.dumps({"job_id": job_id, "channel": channel}),
        "title": {"type": "plain_text", "text": "Resolved: how?"},
        "submit": {"type": "plain_text", "text": "Save"},
        "close": {"type": "plain_text", "text": "Skip"},
        "blocks": [
            {
                "type": "input",
                "block_id": "resolution",
                "optional": True,
                "label": {"type": "plain_text", "text": clip(f"How was job {job_id}'s hang fixed?", 150)},
                "element": {
                    "type": "plain_text_input",
                    "action_id": "note",
                    "max_length": 300,
                    "placeholder": {
                        "type": "plain_text",
                        "text": "e.g. drained gpu-node-17; NCCL_IB_HCA=mlx5_0",
                    },
                },
            }
        ],
    }


def ask(client, trigger_id: Any, job_id: str, channel: str) -> None:
    """Open the dialog (Slack allows it within 3 s of the button press)."""
    if not isinstance(trigger_id, str) or not trigger_id:
        return
    try:
        client.views_open(trigger_id=trigger_id, view=resolution_view(job_id, channel))
    except (SlackApiError, OSError) as e:
        log.warning("views.open of the resolution dialog failed: %s", slack_error(e))


def _job_and_channel(s: Surfaces, metadata: Any) -> tuple[str, str]:
    """The job and channel a dialog was opened for. A view opened before the channel was carried holds the bare
    job id: its incident's own channel stands in (the Resolve button only works in that incident's thread)."""
    try:
        meta = json.loads(metadata) if isinstance(metadata, str) and metadata.startswith("{") else metadata
    except ValueError:
        meta = None
    if isinstance(meta, dict):
        job, channel = meta.get("job_id"), meta.get("channel")
        return (job if isinstance(job, str) else ""), (channel if isinstance(channel, str) else "")
    job = metadata if isinstance(metadata, str) else ""
    channel = ""
    if job and s.store is not None and not access.slack_job_refusal(job):
        try:
            inc = s.store.get(job)
        except Exception:  # noqa: BLE001 - Redis down: no channel, so the allowlist refuses
            inc = None
        channel = (inc.channel or "") if inc is not None else ""
    return job, channel


def register(app: App, s: Surfaces) -> None:
    @app.view(RESOLUTION)
    def resolution_given(ack, body, view):
        user = (body.get("user") or {}).get("id")
        job_id, channel = _job_and_channel(s, view.get("private_metadata"))
        values = ((view.get("state") or {}).get("values") or {}).get("resolution") or {}
        note = (values.get("note") or {}).get("value") or ""
        if not isinstance(user, str) or not isinstance(note, str) or not note.strip() or s.resolution is None:
            ack()
            return
        why = access.slack_job_refusal(job_id) or s.config.refusal(user, channel or None)
        if why:
            log.warning("resolution for %r by %s in %r refused", job_id[:80], user, channel[:40])
            # Said in the dialog, under the note: a refusal is never silent.
            ack(response_action="errors", errors={"resolution": clip(why, 150)})
            return
        ack()
        s.later(s.resolution, job_id, user, note)
