"""Issue 10.6: the redaction gaps that reached Slack, each as the tool or service prints it.

Secret formats are those the services document (AWS's documented example key pair, an Azure storage connection
string's fields, a W&B key's 40 hex digits, `wandb.login(key=...)`, mysql's `-pPASSWORD`); the values here are
made up or the vendors' own documentation examples, never real credentials."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from hangdx.probes import collector
from hangdx.probes.collector import redact

WANDB = "0123456789abcdef0123456789abcdef01234567"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"  # AWS documentation's example secret access key
AZURE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="

CASES = [
    (f"python train.py --wandb-key={WANDB} --lr 3e-4", WANDB),
    (f"python train.py --key {WANDB}", WANDB),
    ("deepspeed train.py --pass hunter2-correct-horse", "hunter2-correct-horse"),
    ("mysqldump -uroot -phunter2-correct-horse metrics", "hunter2-correct-horse"),
    (f"WANDB_KEY={WANDB}", WANDB),
    ("DB_PASS=hunter2-correct-horse", "hunter2-correct-horse"),
    (f"DefaultEndpointsProtocol=https;AccountName=ckpts;AccountKey={AZURE_KEY};EndpointSuffix=core.windows.net",
     AZURE_KEY),
    (f"wandb.login(key='{WANDB}')", WANDB),
    (f"aws_secret_access_key = {AWS_SECRET}", AWS_SECRET),
    (f"sys.argv=['train.py', '--hub-token', 'hf-legacy-abcdefgh', '--wandb_api_key', '{WANDB}']", WANDB),
    ("sys.argv=['train.py', '--hub-token', 'hf-legacy-abcdefgh']", "hf-legacy-abcdefgh"),
]  # fmt: skip


@pytest.mark.parametrize("text,secret", CASES, ids=[c[0][:40] for c in CASES])
def test_each_gap_is_closed(text, secret):
    out = redact(text)
    assert secret not in out, out
    assert "[REDACTED]" in out


def test_a_pem_key_whose_lines_carry_a_log_prefix_goes_whole():
    body = "MIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0tRgeLezV6ffAt0gunVTLw7onLRnrq0"
    text = (
        "[rank0]: loading deploy key\n"
        "[rank0]: -----BEGIN RSA PRIVATE KEY-----\n"
        f"[rank0]: {body}\n"
        f"[rank0]: {body[::-1]}\n"
        "[rank0]: -----END RSA PRIVATE KEY-----\n"
        "[rank0]: step 10 loss 2.31\n"
    )
    out = redact(text)
    assert body not in out and body[::-1] not in out
    assert "loading deploy key" in out and "step 10 loss 2.31" in out


def test_words_that_only_contain_key_or_pass_are_kept():
    text = "monkey=3 bypass=ok compass: north hotkey=F5 gcc -pthread -pipe ssh -p2222"
    assert redact(text) == text


def test_a_secret_value_from_a_rank_argv_is_redacted_wherever_it_appears_again():
    """A value recognised as secret in one place (after --secret-key) is blanked where nothing names it."""
    job = f"redact-{uuid.uuid4().hex[:8]}"
    value = "s3cr3t-Value-" + uuid.uuid4().hex[:8]
    code = "import time; time.sleep(60)"
    env = {
        **os.environ,
        "HANGDX_JOB_ID": job,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MY_SERVICE_TOKEN": value + "-env",
    }
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            "--secret-key",
            value,
            "--run-name",
            f"exp-{value}",
            "--tag",
            value + "-env",
        ],
        env=env,
    )
    try:
        time.sleep(0.5)
        doc = collector.collect(job, samples=1, interval=0.1, hardware=False)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    text = str(doc)
    assert "--run-name exp-" in text  # the process was seen and its command line kept
    assert value not in text and value + "-env" not in text
