"""Issue row 21: with HANGDX_ALLOWED_CHANNELS set (as the README advises), every note given in the Resolve dialog
was silently refused: a dialog's submission names no channel, and "no channel" is never an allowed one.

The dialog now carries the channel of the thread whose Resolve button opened it, and the note is checked
against the allowlists with it. Through the live bot (tests/abuse/harness.py): the button press, the
views.open, the view_submission as Slack sends it, and what the on-call then sees."""

from __future__ import annotations

import json
from urllib.parse import urlencode

import pytest

from .harness import CHANNEL, INTRUDER, ONCALL, OUTSIDE, live_bot

THREAD = "1700000100.000100"


def _submit(bot, view: dict, note: str, user: str = ONCALL):
    submission = {
        "type": "view_submission", "team": {"id": "T0HANGDX1"}, "user": {"id": user},
        "api_app_id": "A0HANGDX01", "token": "gIkuvaNzQIHg97ATvDxqgjtO", "trigger_id": "1.2.3",
        "view": {**view, "id": "V0HANGDX01", "state": {"values": {"resolution": {"note": {
            "type": "plain_text_input", "value": note}}}}},
    }  # fmt: skip
    return bot.signed(urlencode({"payload": json.dumps(submission)}), "application/x-www-form-urlencoded")


def _dialog(bot, job: str) -> dict:
    bot.incident_with_verdict(job, THREAD)
    assert bot.press("resolve", job, thread_ts=THREAD).status_code == 200
    assert bot.wait(lambda: bot.slack.calls_to("views.open"))
    view = bot.slack.calls_to("views.open")[-1].body["view"]
    return json.loads(view) if isinstance(view, str) else view


def _notes(bot, job: str) -> list[str]:
    inc = bot.service.store.get(job)
    return [e["detail"] for e in inc.timeline if e["event"] == "resolution"]


def test_a_resolution_note_is_kept_when_channels_are_allowlisted(redis_url):
    with live_bot(redis_url) as bot:
        assert bot.service.cfg.allowed_channels  # the README's setting
        view = _dialog(bot, "4242")
        r = _submit(bot, view, "drained gpu-node-17; NCCL_IB_HCA=mlx5_0")
        assert r.status_code == 200 and not r.content.strip(b"{} \n")  # closed, no error shown
        assert bot.wait(lambda: _notes(bot, "4242")) == ["drained gpu-node-17; NCCL_IB_HCA=mlx5_0"]


@pytest.mark.parametrize("who", ["intruder", "outside channel"])
def test_a_note_from_outside_the_allowlists_is_refused_in_the_dialog(redis_url, who, hostile_inputs):
    with live_bot(redis_url) as bot:
        view = _dialog(bot, "4243")
        user = ONCALL
        if who == "intruder":
            user = INTRUDER
        else:  # a dialog opened for a thread in a channel hangdx may not act in
            meta = json.loads(view["private_metadata"])
            view = {**view, "private_metadata": json.dumps({**meta, "channel": OUTSIDE})}
        r = _submit(bot, view, "rm -rf the evidence", user=user)
        assert r.status_code == 200
        said = r.json()
        assert said.get("response_action") == "errors" and said["errors"]["resolution"], said
        assert bot.wait(lambda: _notes(bot, "4243"), timeout=1.0) == []


def test_a_dialog_opened_before_the_upgrade_still_names_its_job(redis_url):
    """A view opened by the old code carries the bare job id: its note is checked with the incident's channel."""
    with live_bot(redis_url) as bot:
        view = _dialog(bot, "4244")
        view = {**view, "private_metadata": "4244"}
        r = _submit(bot, view, "replaced the IB cable")
        assert r.status_code == 200
        assert bot.wait(lambda: _notes(bot, "4244")) == ["replaced the IB cable"]
        assert CHANNEL == bot.service.store.get("4244").channel
