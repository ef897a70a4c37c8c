"""Issue 10.2: the collector runs as root; a process only claims to belong to the job.

The attack: any local user starts a process with HANGDX_JOB_ID (or SLURM_JOB_ID) set to another user's job, and
NCCL_DEBUG_FILE or TORCH_FR_DUMP_TEMP_FILE pointing at a file only root may read (or a link to one); root used to
read it into the bundle and the verdict. Now a rank's files are read only when they are regular files its own
user owns, never through a link, and ranks running as different users are named as suspect."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid

import pytest

from hangdx.probes import collector

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the attack is on a collector running as root")


def _start(job: str, rank: int, env: dict, user: int | None = None) -> subprocess.Popen:
    base = {"PATH": "/usr/bin:/bin", "HANGDX_JOB_ID": job, "RANK": str(rank), "WORLD_SIZE": "2"}
    return subprocess.Popen(["sleep", "60"], env={**base, **env}, user=user, cwd="/")


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()


def test_files_a_fake_rank_names_are_not_read_when_its_user_does_not_own_them(tmp_path):
    secret = tmp_path / "root-only"
    secret.write_text("ROOT-ONLY-LINE root:$6$hash:19000\n")
    os.chmod(secret, 0o600)
    os.chmod(tmp_path, 0o755)
    link_dir = tmp_path / "fr"
    link_dir.mkdir()
    (link_dir / "dump1").symlink_to(secret)  # TORCH_FR_DUMP_TEMP_FILE=<dir>/dump + rank 1
    job = f"trust-{uuid.uuid4().hex[:8]}"
    fake = _start(job, 1, {"NCCL_DEBUG_FILE": str(secret), "TORCH_FR_DUMP_TEMP_FILE": str(link_dir / "dump")},
                  user=NOBODY)  # fmt: skip
    try:
        doc = collector.collect(job, samples=1, interval=0.1, hardware=False)
    finally:
        _stop(fake)
    assert "ROOT-ONLY-LINE" not in str(doc["artifacts"])
    said = " ".join(e["message"] for e in doc["errors"])
    assert f"NCCL_DEBUG_FILE {secret}: not owned by the rank's user (uid {NOBODY}), refused" in said
    assert "a link, refused" in said


def test_a_process_of_another_user_claiming_the_job_is_reported_never_read_as_a_rank(tmp_path):
    # Hardening 21.4: another local user's processes carrying the job's id decided the verdict ("rank 1 is
    # sleeping at dataloader_wait"). The job's user here is that of its first-started rank.
    job = f"trust-{uuid.uuid4().hex[:8]}"
    real = _start(job, 0, {})
    time.sleep(0.05)
    fake = _start(job, 1, {}, user=NOBODY)
    try:
        doc = collector.collect(job, samples=1, interval=0.1, hardware=False)
    finally:
        _stop(real, fake)
    said = " ".join(e["message"] for e in doc["errors"])
    assert (
        f"pid {fake.pid} claims rank 1 of this job but runs as uid {NOBODY}, not as the job's user (uid 0"
        in said
    )
    read = [a for a in doc["artifacts"] if a["kind"] in ("pyspy", "procstate")]
    assert all(a["pid"] != fake.pid for a in read)
    states = next(json.loads(a["data"]) for a in doc["artifacts"] if a["kind"] == "procstate")
    assert [s["pid"] for s in states["samples"]] == [real.pid] * len(states["samples"])


def test_with_slurm_naming_the_job_user_a_rank_of_another_user_is_reported_and_unread():
    procs = [
        {"pid": 10, "rank": 0, "uid": NOBODY, "role": "rank", "env": {}, "started": 1},  # first, but not Slurm's
        {"pid": 11, "rank": 1, "uid": 1000, "role": "rank", "env": {"NCCL_DEBUG_FILE": "/etc/shadow"}, "started": 9},
    ]  # fmt: skip
    kept, lines = collector.split_impostors(procs, 1000)
    assert [p["pid"] for p in kept] == [11]
    assert lines == [
        f"pid 10 claims rank 0 of this job but runs as uid {NOBODY}, not as the job's user (uid 1000, Slurm's user "
        "of the job): not read as a rank (another user's process carrying the job's id)"
    ]
    added: list = []
    collector._collect_rank_files(procs[:1], "node1", lambda *a, **k: added.append(a), [], uid=1000)
    assert added == []
