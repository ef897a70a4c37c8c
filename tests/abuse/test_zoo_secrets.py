"""Secrets of a really hung job never leave through the bot. A hang-zoo job (hangdx.zoo, gloo on CPU, rank 1
skips a collective) runs with cloud, Hugging Face, W&B, GitHub and Slack credentials and a database URL in its
ranks' environment; each rank prints some of them to its stderr log (a password, an Authorization header, a
PEM private key, an environment dump, a traceback quoting the database URL) and runs a thread whose name
carries a token (py-spy prints thread names). The job is diagnosed through the bot path: an alert to the live
bot (tests/abuse/harness.py), the real `python -m hangdx.bot.worker` posting through its Slack notifier to the
stand-in, then the "Full stacks" button and `/diagnose status|handoff`. No secret may appear in anything posted
(messages, blocks, the uploaded stacks file), in Redis (incident, timeline, verdicts, stacks, RQ jobs and
results), in `hangdx incident` Markdown, in `hangdx diagnose --json` or in its saved bundle; the verdict still
names rank 1. (The diagnosis never runs py-spy with --locals, so locals are not a channel.)"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from hangdx.zoo.launch import ZooJob  # noqa: E402

from .harness import BOT_TOKEN, CHANNEL, ONCALL, assert_no_traceback, live_bot, redis_text  # noqa: E402

pytestmark = pytest.mark.zoo

PEM_LINES = [
    "MIIEowIBAAKCAQEAzooSecretPemBodyLineOne0123456789abcdefABCDEFxyz",
    "ZooSecretPemBodyLineTwo0123456789abcdefABCDEFxyzQRSTUVWXYZ+/abc",
]
ENV = {
    "AWS_ACCESS_KEY_ID": "AKIAZOOSECRETTEST001",
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYZooSecretKey",
    "HF_TOKEN": "hf_ZooSecretHuggingFaceTokenAbCdEfGhIj",
    "WANDB_API_KEY": "9f3a1c7e5b2d4f6a8c0e1b3d5f7a9c1e3b5d7f91",
    "GITHUB_TOKEN": "ghp_ZooSecretGitHubToken0123456789abcdEF",
    "SLACK_WEBHOOK_TOKEN": "xoxb-2222222222-3333333333-ZooSecretSlackBot",
    "SLACK_USER_TOKEN": "xoxp-4444444444-5555555555-ZooSecretSlackUser",
    "DATABASE_URL": "postgresql://trainer:Pg-ZooSecret-Passw0rd@db.internal:5432/runs",
    "ZOO_DB_PASSWORD": "hunter2-ZooSecret-pw",
    "ZOO_JWT": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ6b29zZWNyZXQifQ.ZooSecretJwtSignature0123",
    "ZOO_PEM": "-----BEGIN RSA PRIVATE KEY-----\n" + "\n".join(PEM_LINES) + "\n-----END RSA PRIVATE KEY-----",
}
# What must never be seen outside the job: every credential above, whole or in its secret part.
SECRETS = [v for k, v in ENV.items() if k not in ("DATABASE_URL", "ZOO_PEM")] + ["Pg-ZooSecret-Passw0rd"]
SECRETS += PEM_LINES

# Loaded by every Python the test starts (PYTHONPATH); acts only in the ranks of the job below.
SITECUSTOMIZE = """
import os, sys, threading
e = os.environ
if e.get("HANGDX_JOB_ID", "").startswith("zoo-secrets-") and "RANK" in e:
    say = lambda s: print(s, file=sys.stderr, flush=True)
    say("db: connect host=db.internal user=trainer password=" + e["ZOO_DB_PASSWORD"])
    say("GET https://api.internal/v1/runs Authorization: Bearer " + e["ZOO_JWT"])
    say(e["ZOO_PEM"])
    say("export AWS_ACCESS_KEY_ID=" + e["AWS_ACCESS_KEY_ID"] + " AWS_SECRET_ACCESS_KEY=" + e["AWS_SECRET_ACCESS_KEY"])
    say("environ({'HF_TOKEN': %r, 'WANDB_API_KEY': %r, 'GITHUB_TOKEN': %r})"
        % (e["HF_TOKEN"], e["WANDB_API_KEY"], e["GITHUB_TOKEN"]))
    say("slack: posting with " + e["SLACK_WEBHOOK_TOKEN"] + " as " + e["SLACK_USER_TOKEN"])
    say("Traceback (most recent call last):")
    say('  File "/srv/train/db.py", line 12, in connect')
    say("ConnectionError: could not reach " + e["DATABASE_URL"] + " (HF_TOKEN=" + e["HF_TOKEN"] + ")")
    gate = threading.Event()
    threading.Thread(target=gate.wait, name="uploader token=" + e["GITHUB_TOKEN"], daemon=True).start()
    threading.Thread(target=gate.wait, name="sync " + e["DATABASE_URL"], daemon=True).start()
"""


def leaks(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


def hangdx(*args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hangdx", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_secrets_of_a_hung_job_never_reach_slack_redis_or_reports(
    redis_url, tmp_path, monkeypatch, caplog, hostile_inputs
):
    hostile_inputs.tried(len(SECRETS))
    caplog.set_level(logging.INFO)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)  # the ranks inherit the environment ZooJob starts them with

    with live_bot(redis_url) as bot, ZooJob("skip_collective", job_id=f"zoo-secrets-{os.getpid()}") as job:
        job.wait_until_stuck()
        assert leaks(job.log(1)), "the rank did not print its secrets: the test would prove nothing"

        summary = f"no training step for 15m; DATABASE_URL={ENV['DATABASE_URL']}"
        r = bot.alert(json.dumps({"job_id": job.job_id, "summary": summary}))
        assert r.status_code == 202, r.text
        env = {
            **os.environ,
            "REDIS_URL": redis_url,
            "SLACK_BOT_TOKEN": BOT_TOKEN,
            "SLACK_API_URL": bot.slack.url,
            "HANGDX_NOTIFIER": "hangdx.bot.service:notify",
        }
        worker = subprocess.run(
            [sys.executable, "-m", "hangdx.bot.worker", redis_url, "--burst"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert worker.returncode == 0, worker.stderr[-2000:]
        inc = bot.service.store.get(job.job_id)
        assert inc is not None and inc.latest_verdict, worker.stderr[-2000:]

        # On-call presses "Full stacks" under the verdict, asks for the status and the hand-off.
        r = bot.press("stacks", job.job_id, channel=inc.channel, thread_ts=inc.thread_ts)
        assert r.status_code == 200
        upload = bot.wait(lambda: [c for c in bot.slack.calls if c.method.startswith("upload/")], 30)
        assert upload, "the stacks file was not uploaded"
        for kind in ("status", "handoff"):
            assert bot.command(kind, user=ONCALL, channel=CHANNEL).status_code == 200
        assert bot.wait(lambda: len(bot.slack.calls_to("respond/T0HANGDX1/1234/abcd")) == 2, 30)

        markdown = hangdx("incident", job.job_id, env=env)
        bundle = tmp_path / "bundle"
        cli = hangdx("diagnose", job.job_id, "--local", "--json", "--save-bundle", str(bundle), env=env)

    # The verdict still names the culprit, everywhere.
    assert inc.latest_verdict["root_cause"]["category"] == "conditional_collective"
    assert inc.latest_verdict["root_cause"]["culprit"]["ranks"] == [1]
    verdict_posts = [c.body for c in bot.slack.calls_to("chat.postMessage") if c.body.get("blocks")]
    assert len(verdict_posts) == 1 and "conditional_collective" in json.dumps(verdict_posts)
    assert markdown.returncode == 0 and "conditional_collective" in markdown.stdout, markdown.stderr
    assert cli.returncode == 0, cli.stderr
    cli_verdict = json.loads(cli.stdout)
    assert cli_verdict["root_cause"]["category"] == "conditional_collective"
    assert cli_verdict["root_cause"]["culprit"]["ranks"] == [1]

    # The channels were live: what carried the secrets arrived, blanked.
    stacks_file = b"".join(c.raw for c in upload).decode()
    assert (
        "uploader token=[REDACTED]" in stacks_file and "sync postgresql://trainer:[REDACTED]@" in stacks_file
    )
    saved = "\n".join(p.read_text(errors="replace") for p in bundle.rglob("*") if p.is_file())
    assert "password=[REDACTED]" in saved and "[REDACTED KEY]" in saved and "Bearer [REDACTED]" in saved

    # And no secret anywhere.
    posted = json.dumps([c.body for c in bot.slack.calls]) + "".join(
        c.raw.decode(errors="replace") for c in bot.slack.calls
    )
    assert leaks(posted) == []
    assert leaks(redis_text(bot.conn)) == []
    assert leaks(markdown.stdout) == []
    assert leaks(cli.stdout) == []
    assert leaks(saved) == []
    assert leaks(worker.stdout + worker.stderr) == []
    assert_no_traceback(caplog.records)
