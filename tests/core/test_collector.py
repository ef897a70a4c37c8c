"""The node-side collector against real processes: finding a job's ranks, sampling them, redacting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from hangdx.probes import bundle, collector
from hangdx.probes.bundle import evidence_from_documents, evidence_from_paths

SLEEPER = "import time, sys\nsys.stdout.write('hello\\n'); sys.stdout.flush()\ndef wait_for_data():\n    time.sleep(600)\nwait_for_data()\n"


@pytest.fixture
def fake_job(tmp_path):
    """Two 'ranks' of a job that only sleep: real processes, found by their environment."""
    job = f"t-{uuid.uuid4().hex[:8]}"
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            HANGDX_JOB_ID=job,
            RANK=str(rank),
            WORLD_SIZE="3",
            LOCAL_RANK=str(rank),
            WANDB_API_KEY="wandb-secret-0123456789abcdef",
        )
        log = open(tmp_path / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-c", SLEEPER], env=env, stdout=log, stderr=log))
    time.sleep(1.0)
    yield job, procs
    for p in procs:
        p.kill()
        p.wait()


def test_collector_finds_ranks_samples_them_and_keeps_secrets_home(fake_job):
    job, procs = fake_job
    doc = collector.collect(job, samples=2, interval=0.2, hardware=False)
    text = json.dumps(doc)
    assert "wandb-secret" not in text
    kinds = {a["kind"] for a in doc["artifacts"]}
    assert {"pyspy", "procstate", "log"} <= kinds
    ev = evidence_from_documents([doc], job_id=job)
    assert ev.world_size == 3
    assert sorted({d.rank for d in ev.stacks}) == [0, 1]
    funcs = {f.function for d in ev.stacks for f in d.main_thread().frames}
    assert "wait_for_data" in funcs
    states = [s for s in ev.processes if s.rank == 0]
    assert len(states) == 3 and states[-1].syscall in ("clock_nanosleep", "nanosleep")


def test_missing_rank_and_sleeping_ranks_are_diagnosed(fake_job):
    from hangdx.playbooks import engine

    job, _ = fake_job
    doc = collector.collect(job, samples=2, interval=0.2, hardware=False)
    v = engine.run(evidence_from_documents([doc], job_id=job))
    assert v.root_cause.category == "rank_crashed"
    assert v.root_cause.culprit.ranks == [2]


def test_rank_exiting_while_probed_is_a_finding_not_a_crash(fake_job):
    from hangdx.playbooks import engine

    job, procs = fake_job
    procs[1].kill()
    procs[1].wait()
    doc = collector.collect(job, samples=2, interval=0.2, hardware=False)
    v = engine.run(evidence_from_documents([doc], job_id=job))
    assert v.root_cause.category == "rank_crashed"
    assert v.root_cause.culprit.ranks == [1, 2]


def test_saved_bundle_reads_back_to_the_same_evidence(fake_job, tmp_path):
    job, _ = fake_job
    doc = collector.collect(job, samples=2, interval=0.2, hardware=False)
    bundle.save([doc], tmp_path / "b", job)
    ev = evidence_from_paths([str(tmp_path / "b")])
    assert ev.job_id == job and ev.live
    assert sorted({d.rank for d in ev.stacks}) == [0, 1]
    assert len(ev.processes) == 6


def test_tail_of_a_huge_log_costs_only_the_tail(tmp_path):
    big = tmp_path / "nccl.log"
    with big.open("wb") as f:
        f.seek(3 * 1024**3)  # a sparse 3 GiB file: reading it whole would take seconds and memory
        f.write(b"\nlast line\n")
    t0 = time.monotonic()
    data = collector.tail_file(str(big), limit=4096)
    assert data.endswith(b"last line\n") and len(data) <= 4096
    assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize(
    "secret",
    [
        "SLACK_BOT_TOKEN=xoxb-1234567890-abcdefghij",
        "password: hunter2hunter2",
        "Authorization: Bearer abcdefghijklmnop1234",
        "https://user:s3cretpass@example.com/repo",
        "AWS key AKIAABCDEFGHIJKLMNOP",
        "HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz0123456789",
        "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----",
    ],
)
def test_redact_blanks_tokens_keys_and_passwords(secret):
    out = collector.redact(f"before {secret} after")
    for piece in (
        "xoxb-1234567890",
        "hunter2",
        "abcdefghijklmnop1234",
        "s3cretpass",
        "AKIAABCDEFGHIJKLMNOP",
        "hf_abcdef",
        "b3BlbnNzaC1rZXktdjEAAAAA",
    ):
        assert piece not in out
    assert out.startswith("before ") and out.endswith(" after")


def test_without_py_spy_the_diagnosis_says_so_and_goes_on(fake_job, monkeypatch):
    from hangdx.playbooks import engine

    job, _ = fake_job
    monkeypatch.setenv("HANGDX_PYSPY", "/nonexistent/py-spy")
    doc = collector.collect(job, samples=2, interval=0.1, hardware=False)
    assert not [a for a in doc["artifacts"] if a["kind"] == "pyspy"]
    v = engine.run(evidence_from_documents([doc], job_id=job))
    assert any("py-spy not found" in g and "pip install py-spy" in g for g in v.gaps)
    assert v.root_cause.category == "rank_crashed"  # rank 2 is missing whatever the stacks say
    assert v.root_cause.culprit.ranks == [2]


def test_nvml_state_is_read_as_nvidia_smi_csv(monkeypatch):
    """No GPU here: a stand-in pynvml answers as NVML does on an 4-GPU node with one GPU idle."""
    import types

    from hangdx.probes.model import Evidence, Source
    from hangdx.probes.registry import parse_artifact

    class H:
        def __init__(self, i):
            self.i = i

    util = [100, 100, 0, 100]
    nv = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 4,
        nvmlDeviceGetHandleByIndex=H,
        nvmlDeviceGetUUID=lambda h: f"GPU-0000000{h.i}-aaaa-bbbb-cccc-dddddddddddd",
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(
            busId=f"00000000:{0x1B + h.i:02X}:00.0".encode()
        ),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=util[h.i]),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=40 * 2**30, total=80 * 2**30),
        nvmlDeviceGetPowerUsage=lambda h: 650000 if util[h.i] else 90000,
        nvmlDeviceGetName=lambda h: "NVIDIA H100 80GB HBM3",
        nvmlDeviceGetComputeRunningProcesses=lambda h: [
            types.SimpleNamespace(pid=4100 + h.i, usedGpuMemory=2**34)
        ],
    )
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    gpus_csv, apps_csv = collector.nvml_csv()
    ev = Evidence()
    assert parse_artifact(gpus_csv.encode(), Source("n/gpus", host="n"), ev) == "nvidia_smi"
    assert parse_artifact(apps_csv.encode(), Source("n/apps", host="n"), ev) == "nvidia_smi"
    idle = [g for g in ev.gpus if g.util_pct == 0]
    assert [g.index for g in idle] == [2]
    assert idle[0].bus_id == "0000:1d:00.0"
    assert 4102 in idle[0].pids or any(e.fields.get("pid") == 4102 for e in ev.events_of("gpu_process"))


def test_kernel_log_excerpt_keeps_every_fault_line_and_the_tail():
    from pathlib import Path

    from hangdx.probes.model import Evidence, Source
    from hangdx.probes.registry import parse_artifact

    fixture = Path(__file__).parent.parent / "fixtures" / "kernel_log" / "dmesg_T_ecc_oom.txt"
    noise = "\n".join(
        f"[Sun Nov 22 01:{i // 60 % 60:02d}:{i % 60:02d} 2026] usb 1-1: reset device {i}"
        for i in range(30000)
    )
    text = noise + "\n" + fixture.read_text()
    excerpt = collector.kernel_excerpt(text)
    assert len(excerpt) < len(text) / 20
    full, cut = Evidence(), Evidence()
    parse_artifact(text.encode(), Source("k", host="n"), full)
    parse_artifact(excerpt.encode(), Source("k", host="n"), cut)
    kinds = lambda ev: sorted((e.kind, e.fields.get("xid")) for e in ev.events)  # noqa: E731
    assert kinds(cut) == kinds(full) and any(k == "xid" for k, _ in kinds(cut))


def test_redact_does_not_stall_on_long_words():
    """A log line of a million letters once took minutes (a quadratic pattern): it must be near-instant."""
    t0 = time.monotonic()
    collector.redact("a" * 1_000_000 + " token=abc")
    assert time.monotonic() - t0 < 5.0
