"""Who may run what, in one place: every Slack surface (commands, mentions, buttons, shortcuts) asks here.

`refusal(config, user, channel)` is the allowlists (HANGDX_ALLOWED_USERS, _GROUPS, _CHANNELS); `job_refusal` a job
id hangdx will not touch; `button_refusal` a verdict button used outside its own incident's thread. Each returns
the one line to show the person, or None when they may go ahead.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError

from hangdx.bot.config import BotConfig
from hangdx.bot.diagnosis import DiagnosisError, check_job_id
from hangdx.bot.incidents import IncidentStore, StoreUnavailable
from hangdx.bot.slack.blocks import clip, escape, mrkdwn
from hangdx.probes.collector import redact

log = logging.getLogger("hangdx.bot")


def refusal(config: BotConfig, user: Any, channel: Any) -> str | None:
    """Why this user in this channel may not use hangdx (allowlists), or None."""
    if not (isinstance(user, str) and isinstance(channel, str) and user and channel):
        return "hangdx: this request names no user or channel."
    return config.refusal(user, channel)


def job_refusal(job_id: str) -> str | None:
    """Why hangdx will not diagnose this job id (escaped for Slack), or None."""
    try:
        check_job_id(job_id)
    except DiagnosisError as e:
        return clip(redact(str(e)), 300)
    return None


def slack_job_refusal(job_id: str) -> str | None:
    why = job_refusal(job_id)
    return escape(why) if why else None


def button_refusal(store: IncidentStore | None, job_id: str, channel: str, message: dict) -> str | None:
    """A verdict's button acts on the job of the incident whose thread it is in, and on no other."""
    if store is None:
        return None
    try:
        inc = store.get(job_id)
    except StoreUnavailable as e:
        return clip(mrkdwn("hangdx cannot check this button now: {e}", e=e), 300)
    if inc is None:
        return mrkdwn(
            "There is no incident for job {job}: this button is not under one of its verdicts.", job=job_id
        )
    thread = message.get("thread_ts") or message.get("ts")
    if inc.channel != channel or (inc.thread_ts and inc.thread_ts != thread):
        return mrkdwn(
            "This button is not in the thread of job {job}'s incident: use the ones under its verdict.",
            job=job_id,
        )
    return None


class GroupMembers:
    """Members of a Slack user group (usergroups.users.list), cached for a few minutes."""

    def __init__(self, client: WebClient, ttl: float = 300.0) -> None:
        self.client, self.ttl = client, ttl
        self._cache: dict[str, tuple[float, frozenset[str]]] = {}
        self._lock = threading.Lock()

    def __call__(self, group: str) -> frozenset[str]:
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(group)
            if hit and now - hit[0] < self.ttl:
                return hit[1]
        try:
            users = frozenset(self.client.usergroups_users_list(usergroup=group).get("users") or [])
        except (SlackApiError, OSError) as e:
            log.warning("usergroups.users.list %s failed: %s", group, e)
            return hit[1] if hit else frozenset()  # Slack down: keep the last answer, else allow nobody new
        with self._lock:
            self._cache[group] = (now, users)
        return users
