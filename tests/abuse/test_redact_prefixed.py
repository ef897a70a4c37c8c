"""Issue row 7: secrets that kept their value because of how a log or a tool wrote them.

A PEM key whose every line carries a log prefix (a timestamp and level, `INFO:root:`, journald, Open MPI's
`[1,0]<stdout>:`, a `grep -H` file name, Ray's `(pid=123) `, a chat quote, ANSI colours); a secret inside
JSON that was itself escaped into a string; passwords given as `sshpass -p V`, `docker login -p V`, a
`.netrc` `password V` and `pw=V`. The key below is made up (random base64), never a real credential."""

from __future__ import annotations

import base64
import json
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hangdx.probes.collector import redact

from .harness import live_bot, redis_text

BODY = [
    "MIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0tRgeLezV6ffAt0gunVTLw",
    "7onLRnrq0/IzW7yWR7QkrmBL7jTKEn5u+qKhbwKfBstIs+bMY2Zkp18gnTxKLxoS2tFc",
    "zGkPLPgizskuemMghRniWaoLcyehkd3qqGElvW/VDL5AaWTg0nLVkjRo9z+40RQzuVaE",
    "8AkAFmxZzow3x+VJYKdjykkJ0iT9wCS0DRTXu269V264Vf/3jvredZiKRkgwlL9xNAwx",
    "XFg0x/XFw005UWVRIkdgcKWTjpBP2dPwVZ4WWC+9aGVd+Gyn1o0CLelf4rEjGoXbAAEg",
    "Ag==",
]
PREFIXES = [
    "2024-01-01 00:00:00 INFO ",
    "2024-01-01T00:00:00.123Z ",
    "INFO:root:",
    "Jan 01 00:00:00 gpu-node-03 python[4242]: ",
    "[1,0]<stdout>:",
    "rank0.log:",
    "rank0.log:17:",
    "(pid=123) ",
    "(RayTrainWorker pid=615, ip=10.0.0.3) ",
    "> ",
    "\x1b[32m",
    "\x1b[0;33m[rank0]:\x1b[0m ",
    "3: ",
    "gpu-node-03: ",
]


def _key(prefix: str, end: bool = True) -> str:
    lines = ["-----BEGIN RSA PRIVATE KEY-----", *BODY]
    if end:
        lines.append("-----END RSA PRIVATE KEY-----")
    return "".join(f"{prefix}{line}\n" for line in lines)


@pytest.mark.parametrize("prefix", PREFIXES, ids=repr)
@pytest.mark.parametrize("end", [True, False], ids=["whole", "cut-short"])
def test_a_pem_key_under_any_log_prefix_loses_its_whole_body(prefix, end, hostile_inputs):
    text = f"{prefix}loading deploy key\n" + _key(prefix, end) + f"{prefix}step 10 loss 2.31\n"
    out = redact(text)
    kept = [line for line in BODY if line in out]
    assert not kept, out
    assert "loading deploy key" in out and "step 10 loss 2.31" in out
    assert redact(out) == out  # a second pass changes nothing


def test_a_key_whose_begin_line_was_cut_off_still_goes_under_a_prefix():
    """A log tail that starts inside the key: the body runs up to a prefixed END line."""
    text = "".join(f"INFO:root:{line}\n" for line in BODY[1:]) + "INFO:root:-----END RSA PRIVATE KEY-----\n"
    out = redact(text)
    assert not [line for line in BODY[1:] if line in out], out


def test_a_json_escaped_key_on_one_line_goes_whole_even_cut_short():
    escaped = "\\n".join(BODY)
    for text in (
        '{"key": "-----BEGIN RSA PRIVATE KEY-----\\n' + escaped + '", "step": 10}',
        'INFO:root:{"key": "-----BEGIN RSA PRIVATE KEY-----\\n'
        + escaped
        + '\\n-----END RSA PRIVATE KEY-----"}',
    ):
        out = redact(text)
        assert not [line for line in BODY[:-1] if line in out], out
        assert "\n" not in out and redact(out) == out


ESCAPED = [
    ('{"msg": "{\\"password\\": \\"hunter2 correct horse\\"}"}', "hunter2 correct horse"),
    ('{"msg": "{\\"password\\":\\"hunter2-correct-horse\\"}"}', "hunter2-correct-horse"),
    ('"{\\"api_key\\": \\"0123456789abcdef0123\\", \\"lr\\": 3e-4}"', "0123456789abcdef0123"),
    ("{'env': \"{\\'HF_TOKEN\\': \\'abcdefghij1234567890\\'}\"}", "abcdefghij1234567890"),
    ('{"a": "{\\\\\\"db_password\\\\\\": \\\\\\"s3cr3t-horse-battery\\\\\\"}"}', "s3cr3t-horse-battery"),
]
COMMANDS = [
    ("sshpass -p hunter2-correct-horse ssh gpu-node-03", "hunter2-correct-horse"),
    ("sshpass -p 'hunter2 correct horse' ssh gpu-node-03", "hunter2 correct horse"),
    ("sshpass -e -p s3cr3tpw ssh root@gpu-node-03", "s3cr3tpw"),
    ("docker login -u ci -p hunter2-correct-horse registry.example.com", "hunter2-correct-horse"),
    ("docker login registry.example.com -u ci -p hunter2-correct-horse", "hunter2-correct-horse"),
    ("podman login -p hunter2-correct-horse quay.io", "hunter2-correct-horse"),
    ("machine registry.example.com login ci password hunter2-correct-horse", "hunter2-correct-horse"),
    ("machine hf.co\n  login ci\n  password hunter2-correct-horse\n", "hunter2-correct-horse"),
    ("pw=hunter2-correct-horse", "hunter2-correct-horse"),
    ("connect(host='db', user='ml', pw='hunter2 correct horse')", "hunter2 correct horse"),
    ("PW: hunter2-correct-horse", "hunter2-correct-horse"),
    ("\x1b[1mpassword\x1b[0m: hunter2-correct-horse", "hunter2-correct-horse"),
    ("\x1b[33mHF_TOKEN\x1b[0m=\x1b[32mabcdefghij1234567890\x1b[0m", "abcdefghij1234567890"),
    ("INFO:root:\x1b[1m--api-key\x1b[0m 0123456789abcdef0123", "0123456789abcdef0123"),
]


@pytest.mark.parametrize("text,secret", ESCAPED + COMMANDS, ids=[c[0][:40] for c in ESCAPED + COMMANDS])
def test_escaped_json_and_password_options_are_redacted(text, secret):
    out = redact(text)
    assert secret not in out, out
    assert "[REDACTED" in out
    assert redact(out) == out


def test_ordinary_text_near_those_forms_is_kept():
    text = (
        "ssh -p 2222 gpu-node-03\npython -m pdb -p 3 train.py\nshow power=300W pwr=on\n"
        "grep -p pattern\nlogin succeeded for user ci\npassword policy: 12 characters\n"
        '{"msg": "{\\"loss\\": 2.31, \\"step\\": 10}"}\n'
    )
    assert redact(text) == text


def test_a_secret_in_escaped_json_does_not_reach_redis_or_the_slack_thread(redis_url):
    """An alert whose summary is a JSON document escaped into a string (as log shippers forward it)."""
    summary = 'no step for 15m; payload={\\"user\\": \\"ml\\", \\"password\\": \\"hunter2 correct horse\\"}'
    with live_bot(redis_url) as bot:
        r = bot.alert(json.dumps({"job_id": "esc-1", "summary": summary}))
        assert r.status_code == 202
        bot.wait(bot.thread_posts)
        stored = redis_text(bot.conn)
        posted = json.dumps([c.body for c in bot.slack.calls])
    for where in (stored, posted):
        assert "hunter2" not in where and "no step for 15m" in where


PREFIX_CHARS = string.ascii_letters + string.digits + " :[]()<>=,.-_/|\t"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prefixes=st.lists(st.text(alphabet=PREFIX_CHARS, max_size=25), min_size=1, max_size=3),
    body=st.lists(st.binary(min_size=12, max_size=48), min_size=1, max_size=6),
    last=st.binary(min_size=1, max_size=20),
    end=st.booleans(),
    pick=st.randoms(use_true_random=False),
)
def test_a_key_under_any_prefix_never_keeps_a_body_line(prefixes, body, last, end, pick):
    """Any prefix (the same on every line, or a different one on each), a key whole or cut short."""
    lines = [base64.b64encode(b).decode() for b in body]
    key = ["-----BEGIN RSA PRIVATE KEY-----", *lines, base64.b64encode(last).decode()]
    if end:
        key.append("-----END RSA PRIVATE KEY-----")
    text = "".join(pick.choice(prefixes) + line + "\n" for line in key) + "step 10 loss 2.31\n"
    out = redact(text)
    assert not [line for line in lines if len(line) >= 16 and line in out], out
    if end:
        assert "step 10 loss 2.31" in out
    assert redact(out) == out
