"""The resolution dialog: resolving an incident asks for one line (optional) saying how it was fixed; the fleet
memory quotes it when the same hang comes back."""

from __future__ import annotations

import logging
from typing import Any

from slack_bolt import App
from slack_sdk.errors import SlackApiError

from hangdx.bot import access
from hangdx.bot.slack.blocks import clip
from hangdx.bot.slack.common import Surfaces, slack_error

log = logging.getLogger("hangdx.bot")
RESOLUTION = "hangdx_resolution"


def resolution_view(job_id: str) -> dict[str, Any]:
    return {
        "type": "modal",
        "callback_id": RESOLUTION,
        "private_metadata": job_id,
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


def ask(client, trigger_id: Any, job_id: str) -> None:
    """Open the dialog (Slack allows it within 3 s of the button press)."""
    if not isinstance(trigger_id, str) or not trigger_id:
        return
    try:
        client.views_open(trigger_id=trigger_id, view=resolution_view(job_id))
    except (SlackApiError, OSError) as e:
        log.warning("views.open of the resolution dialog failed: %s", slack_error(e))


def register(app: App, s: Surfaces) -> None:
    @app.view(RESOLUTION)
    def resolution_given(ack, body, view):
        ack()
        user = (body.get("user") or {}).get("id")
        job_id = view.get("private_metadata") or ""
        values = ((view.get("state") or {}).get("values") or {}).get("resolution") or {}
        note = (values.get("note") or {}).get("value") or ""
        if not isinstance(user, str) or not isinstance(note, str) or not note.strip() or s.resolution is None:
            return
        if access.slack_job_refusal(job_id) or s.config.refusal(
            user, None if not s.config.allowed_channels else ""
        ):
            log.warning("resolution for %r by %s refused", job_id[:80], user)
            return
        s.later(s.resolution, job_id, user, note)
