"""Bad input never escapes as a traceback: every parser, fuzzed; the CLI, with broken files."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hangdx.probes.model import Evidence, Source
from hangdx.probes.registry import parse_artifact, parsers

PARSERS = parsers()


@pytest.mark.parametrize("mod", PARSERS, ids=lambda m: m.KIND)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=4096))
def test_parser_survives_random_bytes(mod, data):
    ev = Evidence()
    mod.sniff(data)
    mod.parse(data, Source("fuzz"), ev)


@pytest.mark.parametrize("mod", PARSERS, ids=lambda m: m.KIND)
@settings(max_examples=150, deadline=None)
@given(
    text=st.text(
        alphabet=st.sampled_from(list('Thread Process NCCL INFO WARN [rank1]: 0123456789:()"{}[],\n\t.x')),
        max_size=2000,
    )
)
def test_parser_survives_text_made_of_its_own_tokens(mod, text):
    ev = Evidence()
    data = text.encode()
    mod.sniff(data)
    mod.parse(data, Source("fuzz"), ev)


def test_empty_and_binary_artifacts_become_gaps():
    ev = Evidence()
    assert parse_artifact(b"", Source("empty.log"), ev) is None
    assert parse_artifact(bytes(range(256)) * 64, Source("blob.bin"), ev) is None
    assert [g.source for g in ev.gaps] == ["empty.log", "blob.bin"]
    assert "empty" in ev.gaps[0].message and "binary" in ev.gaps[1].message


def run(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hangdx", *args], input=stdin, capture_output=True, timeout=60
    )


def test_analyze_missing_path_is_a_one_line_usage_error(tmp_path):
    r = run("analyze", str(tmp_path / "nope"))
    assert r.returncode == 2
    assert r.stderr.decode().count("\n") == 1 and "no such file" in r.stderr.decode()


def test_analyze_nothing_readable_is_a_one_line_usage_error(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blob").write_bytes(b"\x00\xff" * 1000)
    r = run("analyze", str(tmp_path))
    assert r.returncode == 2
    err = r.stderr.decode()
    assert err.count("\n") == 1 and "nothing hangdx can read" in err and "empty" in err


def test_analyze_reads_stdin():
    dump = (
        b'Process 5: python\nPython v3.11.7 (x)\n\nThread 5 (idle): "MainThread"\n'
        b"    all_reduce (torch/distributed/distributed_c10d.py:3252)\n    <module> (train.py:7)\n"
    )
    r = run("analyze", "-", "--json", stdin=dump)
    assert r.returncode == 0, r.stderr
    assert b'"job_id"' in r.stdout


def test_unknown_job_says_which_jobs_are_here():
    r = run("diagnose", "no-such-job-4711", "--local")
    assert r.returncode == 2
    err = r.stderr.decode()
    assert err.count("\n") == 1 and "no process of job 'no-such-job-4711' found" in err


@pytest.mark.parametrize("job", ["1; rm -rf /", "$(id)", "a b", "../../etc", "`x`", ""])
def test_job_ids_with_shell_metacharacters_are_refused(job):
    r = run("diagnose", job, "--local")
    assert r.returncode == 2 and b"is not a job id" in r.stderr
