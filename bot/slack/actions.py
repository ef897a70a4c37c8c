"""The buttons under a verdict (ack, resolve, hand off, re-run, full stacks): checked, then handed on."""

from __future__ import annotations

import logging
import re

from slack_bolt import App

from hangdx.bot import access
from hangdx.bot.request import DiagnoseRequest
from hangdx.bot.slack import views
from hangdx.bot.slack.blocks import ACTION_PREFIX, ACTIONS, CONFIRM, SLURM_ACTIONS, clip, mrkdwn
from hangdx.bot.slack.common import Surfaces, one_line, submitted, tell

log = logging.getLogger("hangdx.bot")
PATTERN = re.compile("^" + ACTION_PREFIX + "(" + "|".join(ACTIONS + SLURM_ACTIONS + (CONFIRM,)) + ")$")


def register(app: App, s: Surfaces) -> None:
    @app.action(PATTERN)
    def verdict_button(ack, body, action, client):
        ack()  # first; the checks and the action talk to Redis and Slack: off the listener pool
        s.later(_press, s, body, action, client)


def _press(s: Surfaces, body: dict, action: dict, client) -> None:
    """A verdict button pressed: checked (who, which job, which thread), then done."""
    user = (body.get("user") or {}).get("id")
    channel = (body.get("channel") or {}).get("id") or (body.get("container") or {}).get("channel_id")
    name = action["action_id"][len(ACTION_PREFIX) :]
    if not (isinstance(user, str) and isinstance(channel, str) and user and channel):
        log.warning("button %s without a user or channel: ignored", name)
        return
    if name == CONFIRM:
        # A Slurm action confirmed: the value is only the nonce of what hangdx kept when the button was pressed
        # (the action, job and node); who may act is asked again, the service checks it is the same person.
        refusal = access.refusal(s.config, user, channel) or s.config.action_refusal(user)
        if refusal or s.act is None:
            tell(client, channel, user, refusal or "Slurm actions are off on this server.")
            return
        s.act(CONFIRM, str(action.get("value") or "")[:64], None, user)
        return
    job_id = action.get("value") or ""
    node = None
    if name in SLURM_ACTIONS and isinstance(job_id, str):
        job_id, _, node = job_id.partition("|")
    message = body.get("message") if isinstance(body.get("message"), dict) else {}
    refusal = (
        access.refusal(s.config, user, channel)
        or access.slack_job_refusal(job_id)
        or access.button_refusal(s.store, job_id, channel, message)
    )
    if not refusal and name in SLURM_ACTIONS:
        refusal = s.config.action_refusal(user) or (
            None if s.act else "Slurm actions are off on this server."
        )
    if refusal:
        tell(client, channel, user, refusal)
        return
    if name in SLURM_ACTIONS:
        s.act(name, job_id, node or None, user)
        return
    if name == "rerun":
        req = DiagnoseRequest(
            job_id=job_id,
            source="button",
            requested_by=user,
            channel=channel,
            thread_ts=message.get("thread_ts") or message.get("ts"),
        )
        say = lambda text: tell(client, channel, user, text)  # noqa: E731
        if not submitted(s.submit, req, f"diagnosis of job {job_id}", say):
            return
    if name == "resolve" and s.resolution is not None:
        views.ask(client, body.get("trigger_id"), job_id, channel)  # first: its trigger lasts 3 s
    if s.on_action is not None:
        try:
            s.on_action(name, job_id, user)
        except Exception as e:  # a resolved incident acknowledged, Redis down: say so to the presser
            log.warning("button %s on job %s failed: %s", name, job_id, one_line(e, 300))
            said = clip(mrkdwn("hangdx could not {name} job {job}: {e}", name=name, job=job_id, e=e), 300)
            tell(client, channel, user, said)
