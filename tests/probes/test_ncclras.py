"""NCCL RAS reports (probes/ncclras.py) and the playbook that reads them (playbooks/ncclras.py).

Fixtures: tests/fixtures/ncclras/README.md says which are real `ncclras` output and which are generated from
NCCL's own format strings.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hangdx.playbooks import engine
from hangdx.probes import reader, registry
from hangdx.probes.model import Evidence, Source

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "ncclras"


def _read(*names: str, data: bytes | None = None) -> Evidence:
    ev = Evidence()
    for name in names:
        raw = data if data is not None else (FIX / name).read_bytes()
        reader.read_any(io.BytesIO(raw), Source(name), ev)
    return ev


def _verdict(*names: str, data: bytes | None = None):
    ev = _read(*names, data=data)
    return ev, engine.run(ev)


def _ras(v):
    return [f for f in v.findings if f.playbook == "ncclras"]


def _texts(f) -> list[str]:
    return [q.text for q in f.evidence]


@pytest.mark.parametrize("name", ["gen_dead_2.29.7.txt", "gen_dead_2.29.7.json"])
def test_dead_rank_is_rank_crashed_with_its_host_pid_and_gpu(name):
    ev, v = _verdict(name)
    top = v.findings[0]
    assert top.playbook == "ncclras" and top.category == "rank_crashed"
    assert top.culprit.ranks == [5] and top.culprit.hosts == ["10.0.0.13"]
    assert top.culprit.gpus == ["10.0.0.13:GPU 1"]
    assert "rank 5 (process 48215 on node 10.0.0.13 (GPU 1))" in top.summary and "dead" in top.summary
    if name.endswith(".txt"):
        assert "  Process 48215 on node 10.0.0.13 managing GPU 1" in _texts(top)
        assert "  Rank 5 -- GPU 1 managed by process 48215 on node 10.0.0.13" in _texts(top)
        assert "  1 job process is considered dead (unreachable via the RAS network)" in _texts(top)
    else:
        assert '            "considered_dead": true' in _texts(top)
        assert '          "pid": 48215,' in _texts(top)
    assert "dmesg" in top.fix or "dmesg" in " ".join(top.next_steps)


def test_dead_rank_in_nvidia_guide_names_rank_21_from_the_one_dead_process():
    _, v = _verdict("docs_dead_2.24.txt")
    top = v.findings[0]
    assert top.category == "rank_crashed" and top.culprit.ranks == [21]
    assert top.culprit.hosts == ["172.16.64.213"] and top.culprit.gpus == ["172.16.64.213:GPU 5"]
    assert "  The missing rank: 21" in _texts(top)
    assert "  Process 3487984 on node 172.16.64.213 managing GPU 5" in _texts(top)
    assert "by number only" in top.summary  # says the rank-to-process join is inferred


@pytest.mark.parametrize(
    "name,rank,host,pid",
    [
        ("docs_unresponsive_2.24.txt", 21, "172.16.64.213", 3487984),
        ("docs_json_2.29.1.json", 1, "172.16.64.245", 1524345),
    ],
)
def test_unreachable_rank_is_named_but_less_surely_than_a_dead_one(name, rank, host, pid):
    _, v = _verdict(name)
    f = _ras(v)[0]
    assert f.category == "rank_crashed" and f.culprit.ranks == [rank] and f.culprit.hosts == [host]
    assert f.confidence < 0.7
    assert f"process {pid} on node {host}" in f.summary and "could not reach" in f.summary


@pytest.mark.parametrize("name", ["gen_lagging_2.29.7.txt", "gen_lagging_2.29.7.json"])
def test_lagging_rank_once_is_named_tentatively(name):
    _, v = _verdict(name)
    f = _ras(v)[0]
    assert f.category == "conditional_collective" and f.culprit.ranks == [3]
    assert f.culprit.hosts == ["10.0.0.12"] and f.culprit.gpus == ["10.0.0.12:GPU 3"]
    assert f.confidence <= 0.55
    assert "only up to #1041" in f.summary and "launched #1042 and wait in it" in f.summary
    assert "queried once" in f.summary and v.status != "hung"
    if name.endswith(".txt"):
        assert (
            "  Rank 3 has launched up to operation 1041 -- GPU 3 managed by process 48213 on node 10.0.0.12"
            in _texts(f)
        )
        assert "  7 ranks have launched up to operation 1042" in _texts(f)
    else:
        assert '            "AllReduce": 1041' in _texts(f) and '          "pid": 48213,' in _texts(f)


def test_lagging_rank_in_two_queries_with_the_same_counts_is_a_stuck_communicator():
    _, v = _verdict("gen_lagging_twice_2.29.7.txt")
    top = v.findings[0]
    assert top.playbook == "ncclras" and top.category == "conditional_collective"
    assert top.culprit.ranks == [3] and top.confidence >= 0.8 and v.status == "hung"
    assert "did not move across 2 RAS queries" in top.summary
    lines = sorted(q.line for q in top.evidence if "Rank 3 has launched" in q.text)
    assert lines == [27, 55]  # the line in each query


def test_counts_that_move_between_queries_are_no_finding():
    first = (FIX / "gen_lagging_2.29.7.txt").read_text()
    second = first.replace("operation 1042", "operation 1043").replace("operation 1041", "operation 1042")
    _, v = _verdict("two-queries.txt", data=(first + second).encode())
    assert not _ras(v)


def test_real_issue_1911_names_the_two_ranks_ras_singles_out():
    _, v = _verdict("issue1911_mismatch_2.26.2.txt")
    f = _ras(v)[0]
    assert f.category == "conditional_collective" and f.culprit.ranks == [12, 13]
    assert f.culprit.hosts == ["10.137.190.124"]
    assert set(f.culprit.gpus) == {"10.137.190.124:GPU 4", "10.137.190.124:GPU 5"}
    assert "launched AllGather #641 and wait in it" in f.summary and "only up to #640" in f.summary
    assert f.confidence < 0.5  # ahead of the crowd, one query: the culprit is not sure
    assert "issue an AllGather the other ranks never do" in f.fix
    assert "  Rank 12 -- GPU 4 managed by process 323032 on node 10.137.190.124" in _texts(f)


def test_nvidia_guide_mismatch_names_the_six_ranks_behind():
    _, v = _verdict("docs_mismatch_2.24.txt")
    f = _ras(v)[0]
    assert f.culprit.ranks == [0, 2, 3, 4, 5, 7] and "collective operations only up to #6649" in f.summary


def test_healthy_report_gives_no_ras_finding():
    ev, v = _verdict("gen_healthy_2.29.7.txt")
    assert ev.events_of("ncclras_report")[0].fields["healthy"] is True
    assert not _ras(v)


def test_json_is_read_as_ncclras_not_another_dump():
    data = (FIX / "docs_json_2.29.1.json").read_bytes()
    assert registry.detect(data).KIND == "ncclras"
    ev = Evidence()
    assert registry.parse_artifact(data, Source("x.json"), ev) == "ncclras"


def test_truncated_json_is_read_as_far_as_it_goes_with_a_gap():
    data = (FIX / "gen_dead_2.29.7.json").read_bytes()
    cut = data[: data.index(b'"missing_ranks"')]
    ev, v = _verdict("cut.json", data=cut)
    assert any("cut short" in g.message and "missing ranks" in g.message for g in ev.gaps)
    assert ev.events_of("ncclras_report")  # what was read before the cut is kept
    assert not _ras(v)  # the dead rank was in the part that is missing: nothing is made up


def test_text_cut_after_its_table_says_what_it_lacks():
    text = (FIX / "gen_lagging_2.29.7.txt").read_text()
    ev = _read("cut.txt", data=text[: text.index("Errors")].encode())
    assert any("lacks its Errors and Warnings sections" in g.message for g in ev.gaps)


@pytest.mark.parametrize(
    "data",
    [
        b"\x00\x01\x02ncclras\xff" * 50,
        b'{"nccl_version": "2.29.1", "communicators": 5}',
        b'{"nccl_version": 7, "communicators": [1, {"ranks": "x", "missing_ranks": [{"rank": "a"}]}]}',
        b"#0-0 (zz) MISMATCH\nRank x has launched\n",
    ],
)
def test_bad_input_is_a_gap_never_a_traceback(data):
    ev, v = _verdict("bad", data=data)
    assert ev.gaps or not ev.events_of("ncclras_report")
    assert not _ras(v)


def test_hangdx_analyze_on_a_saved_report_gives_the_verdict(tmp_path):
    saved = tmp_path / "ras-report"  # the name says nothing: the content is read
    saved.write_bytes((FIX / "gen_dead_2.29.7.txt").read_bytes())
    out = subprocess.run(
        [sys.executable, "-m", "hangdx", "analyze", str(saved), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    rc = doc["root_cause"]
    assert rc["category"] == "rank_crashed"
    assert rc["culprit"]["ranks"] == [5] and rc["culprit"]["hosts"] == ["10.0.0.13"]
    assert rc["culprit"]["gpus"] == ["10.0.0.13:GPU 1"]
    ev_lines = [e["text"] for e in doc["findings"][0]["evidence"]]
    assert "  Process 48215 on node 10.0.0.13 managing GPU 1" in ev_lines


@pytest.mark.parametrize("name", ["gen_async_error_2.29.7.txt", "gen_async_error_2.29.7.json"])
def test_cuda_error_reported_to_ras_is_that_rank_gpus_fault(name):
    _, v = _verdict(name)
    f = _ras(v)[0]
    assert f.category == "gpu_fault" and f.culprit.ranks == [6] and f.culprit.gpus == ["10.0.0.13:GPU 2"]
    assert "Unhandled CUDA error" in f.summary and "xid" in f.fix.lower()
    want = (
        "  Rank 6 reported Unhandled CUDA error -- GPU 2 managed by process 48216 on node 10.0.0.13"
        if name.endswith(".txt")
        else '            "async_error": 1,'
    )
    assert want in _texts(f)


def test_remote_errors_while_a_rank_is_dead_blame_the_dead_rank_only():
    dead = (FIX / "gen_dead_2.29.7.txt").read_text()
    errors = (
        (FIX / "gen_async_error_2.29.7.txt")
        .read_text()
        .replace("Unhandled CUDA error", "Remote process error")
    )
    _, v = _verdict("both.txt", data=(errors + dead).encode())
    cats = {f.category for f in _ras(v)}
    assert cats == {"rank_crashed"}


@pytest.mark.parametrize("name", sorted(p.name for p in FIX.iterdir() if p.suffix in (".txt", ".json")))
def test_every_cut_of_a_report_gives_a_verdict_never_a_failure(name):
    data = (FIX / name).read_bytes()
    for cut in range(1, len(data), max(1, len(data) // 20)):
        ev, v = _verdict(name, data=data[:cut])
        assert not [g for g in ev.gaps if g.source.startswith("playbook")], (cut, ev.gaps)
        for f in _ras(v):  # what a cut report still names, it names from lines it holds
            assert all(q.line <= data[:cut].count(b"\n") + 1 for q in f.evidence)


def test_culprit_host_is_the_name_hangdx_knows_the_rank_by_not_the_ras_address():
    from hangdx.playbooks import ncclras as playbook
    from hangdx.playbooks.facts import derive

    facts = derive(_read("gen_lagging_twice_2.29.7.txt"))
    assert [m.culprit.hosts for m in playbook.ncclras(facts)] == [
        ["10.0.0.12"]
    ]  # RAS's address, nothing else
    facts.missing_hosts[3] = "gpu-node-01"  # where hangdx's own evidence put rank 3
    (m,) = playbook.ncclras(facts)
    assert m.culprit.hosts == ["gpu-node-01"] and m.culprit.gpus == ["gpu-node-01:GPU 3"]


def test_a_2048_rank_json_report_names_the_dead_and_the_lagging_rank(monkeypatch):
    sys.path.insert(0, str(FIX))
    try:
        import generate  # the fixture generator: NCCL's JSON format strings
    finally:
        sys.path.remove(str(FIX))
    n = 2048
    monkeypatch.setattr(
        generate, "RANKS", {r: (f"10.1.{r // 8 // 256}.{r // 8 % 256}", 70000 + r, r % 8) for r in range(n)}
    )
    doc = generate.json_report(
        {r: (99 if r == 1500 else 100) for r in range(n) if r != 777}, {777: (True, True)}, "t"
    )
    _, v = _verdict("big.json", data=doc.encode())
    got = {(f.category, tuple(f.culprit.ranks)) for f in _ras(v)}
    assert got == {("rank_crashed", (777,)), ("conditional_collective", (1500,))}
    dead = next(f for f in _ras(v) if f.category == "rank_crashed")
    assert dead.culprit.hosts == ["10.1.0.97"] and dead.culprit.gpus == ["10.1.0.97:GPU 1"]
