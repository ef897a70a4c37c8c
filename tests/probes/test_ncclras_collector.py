"""The collector asks NCCL RAS (`ncclras`) when it is on the node's PATH: a stand-in prints recorded reports.

The job's ranks are real processes found by their environment (as in tests/core/test_collector.py); `ncclras`
is a stand-in script first on PATH that prints a fixture of tests/fixtures/ncclras/ (text for `-v`, JSON for
`-f json`) and writes down the argv it was given.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hangdx.playbooks import engine
from hangdx.probes import collector
from hangdx.probes.bundle import evidence_from_documents

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "ncclras"
SLEEPER = "import time\ntime.sleep(600)\n"

STANDIN = """#!{python}
import sys, time
with open({log!r}, "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
mode = {mode!r}
if mode == "hang":
    time.sleep(600)
if mode == "flood":
    while True:
        sys.stdout.write("Rank 1 -- GPU 1 managed by process 2 on node 10.0.0.1\\n" * 1000)
if "-f" in sys.argv and sys.argv[sys.argv.index("-f") + 1] == "json":
    if mode == "old":  # ncclras before 2.28.7 has no -f
        sys.stderr.write("Usage: ncclras [OPTION]...\\n")
        sys.exit(1)
    sys.stdout.write(open({json_fixture!r}).read())
else:
    sys.stdout.write(open({text_fixture!r}).read())
"""


def _standin(tmp_path: Path, mode: str = "normal", kind: str = "dead") -> tuple[Path, Path]:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    log = tmp_path / "ncclras-argv.log"
    script = bindir / "ncclras"
    script.write_text(
        STANDIN.format(
            python=sys.executable,
            log=str(log),
            mode=mode,
            json_fixture=str(FIX / f"gen_{kind}_2.29.7.json"),
            text_fixture=str(FIX / f"gen_{kind}_2.29.7.txt"),
        )
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return bindir, log


@pytest.fixture
def job(tmp_path):
    """Sleeping 'ranks' of an 8-rank job on this node (ranks 0 and 1 unless told)."""

    def start(extra_env: dict | None = None, ranks: tuple[int, ...] = (0, 1)):
        job_id = f"t-{uuid.uuid4().hex[:8]}"
        for rank in ranks:
            env = dict(os.environ, HANGDX_JOB_ID=job_id, RANK=str(rank), WORLD_SIZE="8", LOCAL_RANK=str(rank))
            env.update(extra_env or {})
            procs.append(subprocess.Popen([sys.executable, "-c", SLEEPER], env=env))
        time.sleep(0.8)
        return job_id

    procs: list[subprocess.Popen] = []
    yield start
    for p in procs:
        p.kill()
        p.wait()


def _on_path(monkeypatch, bindir: Path) -> None:
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(collector, "NCCLRAS_PAUSE", 0.1)


def test_collector_brings_back_ncclras_text_and_json_and_the_verdict_names_the_dead_rank(
    tmp_path, monkeypatch, job
):
    bindir, log = _standin(tmp_path)
    _on_path(monkeypatch, bindir)
    job_id = job()
    doc = collector.collect(job_id, samples=1, interval=0.1, hardware=False)
    ras = {a["name"]: a for a in doc["artifacts"] if a["kind"] == "ncclras"}
    assert set(ras) == {"ncclras.txt", "ncclras.json"}
    assert ras["ncclras.txt"]["data"] == (FIX / "gen_dead_2.29.7.txt").read_text()
    assert log.read_text().splitlines() == ["-t 5 -v", "-t 5 -f json"]  # the fixed argv, nothing else
    # The recorded report's pids are not this job's: the collector says so, and keeps the report.
    assert any("names none of this job's processes" in e["message"] for e in doc["errors"])
    ev = evidence_from_documents([doc], job_id=job_id)
    v = engine.run(ev)
    f = next(f for f in v.findings if f.playbook == "ncclras")
    assert f.category == "rank_crashed" and f.culprit.ranks == [5] and "10.0.0.13" in f.culprit.hosts
    assert "  Process 48215 on node 10.0.0.13 managing GPU 1" in [q.text for q in f.evidence]


def test_a_report_naming_this_jobs_pid_raises_no_doubt(tmp_path, monkeypatch, job):
    job_id = job()
    pid = collector.find_job_processes(job_id)[0][0]["pid"]
    mine = tmp_path / "mine.json"
    mine.write_text((FIX / "gen_dead_2.29.7.json").read_text().replace('"pid": 48210,', f'"pid": {pid},'))
    bindir, _ = _standin(tmp_path)
    script = bindir / "ncclras"
    script.write_text(script.read_text().replace(str(FIX / "gen_dead_2.29.7.json"), str(mine)))
    _on_path(monkeypatch, bindir)
    doc = collector.collect(job_id, samples=1, interval=0.1, hardware=False)
    assert [a["name"] for a in doc["artifacts"] if a["kind"] == "ncclras"] == ["ncclras.txt", "ncclras.json"]
    assert not [e for e in doc["errors"] if e["source"] == "ncclras"]


def test_two_queries_with_the_same_counts_make_the_lagging_rank_sure(tmp_path, monkeypatch, job):
    bindir, _ = _standin(tmp_path, kind="lagging")
    _on_path(monkeypatch, bindir)
    job_id = job()
    doc = collector.collect(job_id, samples=1, interval=0.1, hardware=False)
    v = engine.run(evidence_from_documents([doc], job_id=job_id))
    f = next(f for f in v.findings if f.playbook == "ncclras")
    assert f.category == "conditional_collective" and f.culprit.ranks == [3] and f.confidence >= 0.8
    assert "did not move across 2 RAS queries" in f.summary


def test_an_ncclras_without_json_is_asked_for_text_twice(tmp_path, monkeypatch, job):
    bindir, log = _standin(tmp_path, mode="old")
    _on_path(monkeypatch, bindir)
    doc = collector.collect(job(), samples=1, interval=0.1, hardware=False)
    names = sorted(a["name"] for a in doc["artifacts"] if a["kind"] == "ncclras")
    assert names == ["ncclras-2.txt", "ncclras.txt"]
    assert not [e for e in doc["errors"] if e["source"] == "ncclras"]


def test_a_hung_ncclras_is_ended_and_named(tmp_path, monkeypatch, job):
    bindir, _ = _standin(tmp_path, mode="hang")
    _on_path(monkeypatch, bindir)
    monkeypatch.setattr(collector, "NCCLRAS_TIMEOUT", 1.0)
    started = time.monotonic()
    doc = collector.collect(job(), samples=1, interval=0.1, hardware=False)
    assert time.monotonic() - started < 20
    errs = [e["message"] for e in doc["errors"] if e["source"] == "ncclras"]
    assert errs and "did not finish within 1s" in errs[0]


def test_endless_ncclras_output_is_cut_at_the_limit(tmp_path, monkeypatch, job):
    bindir, _ = _standin(tmp_path, mode="flood")
    _on_path(monkeypatch, bindir)
    monkeypatch.setattr(collector, "NCCLRAS_MAX_BYTES", 100_000)
    doc = collector.collect(job(), samples=1, interval=0.1, hardware=False)
    ras = [a for a in doc["artifacts"] if a["kind"] == "ncclras"]
    assert ras and all(len(a["data"]) <= 100_000 for a in ras)
    assert any("cut there" in e["message"] for e in doc["errors"] if e["source"] == "ncclras")


@pytest.mark.parametrize(
    "addr,argv",
    [
        ("127.0.0.1:28100", "-t 5 -h 127.0.0.1 -p 28100 -v"),
        ("$(touch /tmp/owned):1", "-t 5 -v"),
        ("evil.example.com:28028", "-t 5 -v"),
        ("localhost:99999", "-t 5 -v"),
    ],
)
def test_nccl_ras_addr_from_the_job_is_used_only_as_an_ip_and_port(tmp_path, monkeypatch, job, addr, argv):
    bindir, log = _standin(tmp_path)
    _on_path(monkeypatch, bindir)
    doc = collector.collect(job({"NCCL_RAS_ADDR": addr}), samples=1, interval=0.1, hardware=False)
    assert log.read_text().splitlines()[0] == argv
    refused = [
        e["message"] for e in doc["errors"] if e["source"] == "ncclras" and "NCCL_RAS_ADDR" in e["message"]
    ]
    assert bool(refused) == (argv == "-t 5 -v")


def test_ras_switched_off_in_the_job_is_not_queried(tmp_path, monkeypatch, job):
    bindir, log = _standin(tmp_path)
    _on_path(monkeypatch, bindir)
    doc = collector.collect(job({"NCCL_RAS_ENABLE": "0"}), samples=1, interval=0.1, hardware=False)
    assert not log.exists()
    assert any("NCCL_RAS_ENABLE=0" in e["message"] for e in doc["errors"])


def test_no_ncclras_on_the_node_is_quiet(monkeypatch, job):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    doc = collector.collect(job(), samples=1, interval=0.1, hardware=False)
    assert not [a for a in doc["artifacts"] if a["kind"] == "ncclras"]
    assert not [e for e in doc["errors"] if e["source"] == "ncclras"]


def test_only_the_nodes_of_the_first_and_last_rank_ask(tmp_path, monkeypatch, job):
    bindir, log = _standin(tmp_path)
    _on_path(monkeypatch, bindir)
    collector.collect(job(ranks=(3, 4)), samples=1, interval=0.1, hardware=False)
    assert not log.exists()  # ranks 3 and 4 of 8: another node asks for the whole job
    collector.collect(job(ranks=(6, 7)), samples=1, interval=0.1, hardware=False)
    assert log.read_text().splitlines() == ["-t 5 -v", "-t 5 -f json"]  # rank 7 is the last
