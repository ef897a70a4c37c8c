"""Issue 22 item 7: the lines the README gives a training script (prometheus_client) export what the progress rule
reads: `training_steps_total` and `training_heartbeat_timestamp_seconds`, labelled with Slurm's job id, over HTTP
and in a textfile that node exporter's textfile collector accepts (checked by `promtool check metrics`). The
snippet is taken from README.md as a user copies it; only its port, textfile folder, beat and loader are set here.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")
README = Path(__file__).resolve().parents[2] / "README.md"


def _snippet() -> str:
    text = README.read_text()
    start = text.index("No exporter counts training steps")
    block = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert block, "README: the training script's lines are gone"
    return block.group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_readme_lines_export_the_progress_counter_and_heartbeat_with_the_slurm_job_id(tmp_path):
    code = _snippet()
    port = _free_port()
    for old, new in (
        ("start_http_server(9464,", f"start_http_server({port}, addr='127.0.0.1',"),
        ("/var/lib/prometheus/node-exporter/", f"{tmp_path}/"),
        ("time.sleep(30)", "time.sleep(0.2)"),
        ("for batch in loader:\n    ...\n", "for batch in range(3):\n"),
    ):
        assert old in code, f"README snippet changed: {old!r} not found"
        code = code.replace(old, new)
    code += "\ntime.sleep(30)\n"  # the job now hangs; its heartbeat thread keeps writing
    env = {**os.environ, "SLURM_JOB_ID": "4242", "RANK": "0"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
    try:
        prom = tmp_path / "training-4242.prom"
        end = time.monotonic() + 20
        while time.monotonic() < end and 'training_steps_total{slurm_job_id="4242"} 3.0' not in (
            prom.read_text() if prom.exists() else ""
        ):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.1)
        first = prom.read_text()
        assert 'training_steps_total{slurm_job_id="4242"} 3.0' in first, first
        beat = float(
            re.search(r'training_heartbeat_timestamp_seconds\{slurm_job_id="4242"\} (\S+)', first)[1]
        )
        assert abs(beat - time.time()) < 10
        time.sleep(1.5)  # hung: the counter stays, the heartbeat moves on
        later = prom.read_text()
        assert 'training_steps_total{slurm_job_id="4242"} 3.0' in later
        assert float(re.search(r"training_heartbeat_timestamp_seconds\{[^}]*\} (\S+)", later)[1]) > beat
        import requests

        scraped = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert 'training_steps_total{slurm_job_id="4242"} 3.0' in scraped
    finally:
        proc.kill()
        proc.wait(timeout=10)
    promtool = shutil.which("promtool")
    if promtool:
        check = subprocess.run([promtool, "check", "metrics"], input=later, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
