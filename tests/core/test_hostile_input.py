"""Hostile input to the offline and collection paths: malicious pickles, escaping bundles, broken answers.

Each case is what a user or a node could really hand hangdx: a Flight Recorder "dump" that runs a command
when unpickled, JSON nested past Python's stack, a bundle whose manifest or symlinks point outside it, a
node whose answer is not the collector's document, and `hangdx analyze` pointed at a FIFO, a device, a
link loop, an unreadable file, 5,000 files or a sparse 2 GB file. The promise each time: one clear line
(a gap, a host problem, or exit status 2), nothing executed, nothing outside the bundle read, memory and
time bounded by the reader's own caps, and whatever else was readable still diagnosed.
"""

from __future__ import annotations

import copyreg
import io
import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hangdx.playbooks import engine
from hangdx.probes import bundle, collector, procstate
from hangdx.probes import flight_recorder as fr
from hangdx.probes.hosts import HostSpec, SshSettings
from hangdx.probes.model import Evidence, ProcessState, Source
from hangdx.probes.registry import parse_artifact
from hangdx.probes.ssh import _Probe
from hangdx.probes.text import MAX_TEXT_BYTES

from .test_fuzz import guard, ill_typed  # guard: SIGALRM, so that a read that blocks fails, not freezes

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
NCCL_LOG = FIXTURES / "nccl_log" / "ib_status_2.29.log"
FR_PICKLE = FIXTURES / "flight_recorder" / "gloo_rank0.pkl"
SLEEPER = "import time\ndef wait_for_data():\n    time.sleep(600)\nwait_for_data()\n"
FR_KEYS = {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}}}
DEEP = 200_000  # nesting far past Python's recursion limit


# The address space of every hangdx run here: a reader gone unbounded fails the test, not the machine.
MEMORY_LIMIT = 4 * 1024**3


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def run(*args: str, timeout: float = 60, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*prefix, sys.executable, "-m", "hangdx", *args],
        capture_output=True,
        timeout=timeout,
        preexec_fn=_limit_memory,
    )


def one_line(r: subprocess.CompletedProcess) -> str:
    err = r.stderr.decode()
    assert err.count("\n") == 1 and err.startswith("hangdx: ") and "Traceback" not in err, err
    return err


# -- a real collector document of a real (sleeping) two-rank job ----------------------------------------


@pytest.fixture(scope="module")
def job_doc(tmp_path_factory):
    """What the collector brings back from this host for a job of two live ranks (and a missing third)."""
    job = f"hostile-{uuid.uuid4().hex[:8]}"
    logs = tmp_path_factory.mktemp("ranks")
    procs = []
    for rank in range(2):
        env = dict(os.environ, HANGDX_JOB_ID=job, RANK=str(rank), WORLD_SIZE="3", LOCAL_RANK=str(rank))
        with open(logs / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-c", SLEEPER], env=env, stdout=log, stderr=log))
    try:
        time.sleep(1.0)
        doc = collector.collect(job, samples=2, interval=0.2, hardware=False, host="gpu-node-01")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert {a["kind"] for a in doc["artifacts"]} >= {"pyspy", "procstate"}
    return job, doc


def _ranks(ev: Evidence) -> list[int]:
    return sorted({d.rank for d in ev.stacks})


# -- Flight Recorder: the restricted unpickler --------------------------------------------------------


class _Reduce:
    """An object whose pickle calls func(*args) when loaded: the classic pickle exploit."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _payloads(marker: Path) -> dict[str, bytes]:
    """Pickles that, if loaded by a plain unpickler, create `marker` (each was checked to: see below)."""
    touch = f"touch {marker}"
    code = f"open({str(marker)!r}, 'w').close()"
    out = {}
    for proto in range(6):
        out[f"os.system, protocol {proto}"] = pickle.dumps(
            {**FR_KEYS, "entries": [_Reduce(os.system, touch)]}, proto
        )
        out[f"subprocess.Popen, protocol {proto}"] = pickle.dumps(
            {**FR_KEYS, "entries": [_Reduce(subprocess.Popen, ["touch", str(marker)])]}, proto
        )
    out["builtins.eval"] = pickle.dumps({**FR_KEYS, "entries": [_Reduce(eval, code)]}, 2)
    out["builtins.exec"] = pickle.dumps({**FR_KEYS, "entries": [_Reduce(exec, code)]}, 4)
    # Hand-written opcodes: GLOBAL+REDUCE (protocol 0), INST, OBJ, STACK_GLOBAL, and a BUILD on an allowed class.
    out["GLOBAL posix system, protocol 0"] = f"cposix\nsystem\n(V{touch}\ntR.".encode()
    out["INST os system"] = f"(V{touch}\nios\nsystem\n.".encode()
    out["OBJ os.system"] = (
        b"\x80\x02(cos\nsystem\nX" + len(touch).to_bytes(4, "little") + touch.encode() + b"o."
    )
    out["STACK_GLOBAL os.system"] = (
        b"\x80\x04\x8c\x02os\x8c\x06system\x93\x8c" + bytes([len(touch)]) + touch.encode() + b"\x85R."
    )
    out["BUILD __setstate__ on a set"] = (
        b"\x80\x02c__builtin__\nset\n)R}X\x04\x00\x00\x00evalX\x01\x00\x00\x001sb."
    )
    out["persistent id"] = b"\x80\x02X\x02\x00\x00\x00osQ."
    return out


def test_every_payload_would_run_a_command_when_loaded_by_plain_pickle(tmp_path):
    """The payloads are real: plain pickle.loads runs them (which is why hangdx must not)."""
    marker = tmp_path / "pwned-by-plain-pickle"
    for name, data in _payloads(marker).items():
        if name in ("BUILD __setstate__ on a set", "persistent id"):
            continue  # these two only probe the refusals; they run nothing even in plain pickle
        marker.unlink(missing_ok=True)
        try:
            loaded = pickle.loads(data)
        except Exception:
            loaded = None
        for p in loaded["entries"] if isinstance(loaded, dict) else []:
            if isinstance(p, subprocess.Popen):
                p.wait(timeout=10)  # the touch it started
        deadline = time.monotonic() + 5
        while not marker.exists() and time.monotonic() < deadline:  # Popen runs touch in the background
            time.sleep(0.02)
        assert marker.exists(), name


def test_malicious_pickles_are_refused_with_one_line_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    for name, data in _payloads(marker).items():
        ev = Evidence()
        fr.parse(data, Source(f"{name}.pkl"), ev)
        assert ev.collectives == [] and len(ev.gaps) == 1, (name, ev.gaps)
        msg = ev.gaps[0].message
        assert ev.gaps[0].source == f"{name}.pkl" and "\n" not in msg and len(msg) < 400, msg
        if data[:1] == b"\x80" and name not in ("BUILD __setstate__ on a set", "persistent id"):
            assert "refused" in msg, msg  # protocol 2+ (what torch writes); FR reads no protocol 0/1 at all
        elif data[:1] != b"\x80":
            assert "neither a pickle nor JSON" in msg, msg
    time.sleep(0.3)  # a Popen, had one run, would have touched the file by now
    assert not marker.exists()


def test_malicious_pickle_in_a_folder_runs_nothing_through_the_command_line(tmp_path):
    marker = tmp_path / "pwned-cli"
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "fr_rank0.pkl").write_bytes(_payloads(marker)["os.system, protocol 2"])
    shutil.copy(NCCL_LOG, tmp_path / "in" / "rank12.log")
    r = run("analyze", str(tmp_path / "in"), "--json")
    assert r.returncode == 0, r.stderr
    gaps = json.loads(r.stdout)["gaps"]
    assert [g for g in gaps if g.startswith("fr_rank0.pkl: ") and "refused posix.system" in g], gaps
    assert not marker.exists()


def test_copyreg_extension_codes_are_refused_too(tmp_path):
    marker = tmp_path / "pwned-ext"
    copyreg.add_extension("os", "system", 0xBEEF)
    try:
        data = (
            b"\x80\x02\x83"  # EXT2
            + (0xBEEF).to_bytes(2, "little")
            + b"X"
            + len(f"touch {marker}").to_bytes(4, "little")
        )
        data += f"touch {marker}".encode() + b"\x85R."
        ev = Evidence()
        fr.parse(data, Source("ext.pkl"), ev)
    finally:
        copyreg.remove_extension("os", "system", 0xBEEF)
    assert "refused os.system" in ev.gaps[0].message and not marker.exists()


def test_huge_lengths_in_a_pickle_cost_nothing():
    for opcode in (b"\x8d", b"\x8e", b"\x96", b"\x95"):  # BINUNICODE8, BINBYTES8, BYTEARRAY8, FRAME
        for length in (1 << 62, 1 << 40, 1 << 34):
            data = b"\x80\x05" + opcode + length.to_bytes(8, "little") + b"pg_config version entries"
            ev = Evidence()
            fr.parse(data, Source("huge.pkl"), ev)
            assert len(ev.gaps) == 1 and "unreadable pickle" in ev.gaps[0].message, ev.gaps
            assert opcode == b"\x95" or "cut short" in ev.gaps[0].message, ev.gaps  # a FRAME is not data


def _billion_laughs(levels: int = 9) -> bytes:
    """Lists of ten references to the list before: 10**levels elements from a few hundred bytes."""
    out = io.BytesIO()
    out.write(b"\x80\x02}(X\x07\x00\x00\x00entries")  # {"entries": ...
    out.write(b"]q\x01(K\x01K\x02e0")  # memo 1 = [1, 2], popped
    for n in range(2, levels + 2):  # memo n = [memo n-1] * 10, popped
        out.write(b"]q" + bytes([n]) + b"(" + (b"h" + bytes([n - 1])) * 10 + b"e0")
    out.write(b"h" + bytes([levels + 1]) + b"X\x07\x00\x00\x00versionX\x01\x00\x00\x001u.")
    return out.getvalue()


def test_a_pickle_that_unpacks_to_billions_of_objects_is_refused_fast():
    data = _billion_laughs()
    assert len(data) < 500
    ev = Evidence()
    t = time.monotonic()
    fr.parse(data, Source("laughs.pkl"), ev)
    assert time.monotonic() - t < 5
    assert ev.collectives == [] and "refused pickle" in ev.gaps[0].message


def test_a_pickle_that_holds_itself_is_refused():
    loop: list = []
    loop.append(loop)
    ev = Evidence()
    fr.parse(
        pickle.dumps(
            {"version": "1", "entries": [{"profiling_name": "nccl:all_reduce", "input_sizes": loop}]}
        ),
        Source("loop.pkl"),
        ev,
    )
    assert ev.collectives == [] and "refused pickle" in ev.gaps[0].message


def test_a_pickle_nested_past_the_stack_is_one_gap():
    data = b"\x80\x02" + b"]" * DEEP + b"a" * (DEEP - 1) + b"."  # [[[[...]]]]: unpickled without recursion
    ev = Evidence()
    fr.parse(data, Source("deep.pkl"), ev)
    assert ev.collectives == [] and [g.source for g in ev.gaps] == ["deep.pkl"]
    # Unpickled in the capped child (it is over IN_PROCESS bytes), it cannot come back: said in one line.
    assert "nested too deeply: a Flight Recorder dump is a few levels deep" in ev.gaps[0].message


def test_shared_strings_of_a_real_dump_are_not_mistaken_for_an_attack():
    ev = Evidence()
    fr.parse(FR_PICKLE.read_bytes(), Source(FR_PICKLE.name), ev)
    assert len(ev.collectives) == 9 and ev.gaps == []


# -- JSON nested past Python's stack -----------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,data",
    [
        (
            "flight_recorder",
            b'{"version": "2.1", "pg_config": {}, "entries": ' + b"[" * DEEP + b"]" * DEEP + b"}",
        ),
        ("pyspy", b'[{"thread_name": "MainThread", "frames": ' + b"[" * DEEP + b"]" * DEEP + b"}]"),
        ("procstate", b'{"hangdx": "procstate", "samples": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
    ],
    ids=["flight_recorder", "pyspy --json", "procstate"],
)
def test_json_nested_past_the_stack_is_one_gap(kind, data):
    ev = Evidence()
    assert parse_artifact(data, Source("deep.json"), ev) == kind
    assert [g.source for g in ev.gaps] == ["deep.json"] and "RecursionError" in ev.gaps[0].message


def test_deep_json_in_a_bundle_manifest_and_errors_is_a_gap(tmp_path, job_doc):
    job, doc = job_doc
    root = bundle.save([doc], tmp_path / "b", job)
    (root / "manifest.json").write_bytes(b"[" * DEEP + b"]" * DEEP)
    (root / "gpu-node-01" / "errors.json").write_bytes(b"[" * DEEP + b"]" * DEEP)
    (root / "gpu-node-01" / "problem.json").write_bytes(b"{" * 10 + b"[" * DEEP)
    ev = bundle.evidence_from_paths([str(root)])
    assert [g.source for g in ev.gaps] == ["manifest.json"] and "manifest unreadable" in ev.gaps[0].message
    assert _ranks(ev) == [0, 1]


# -- procstate: fields of the wrong type ---------------------------------------------------------------

WRONG = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)  # fmt: skip


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_process_states_of_the_wrong_type_are_dropped_field_by_field(job_doc, data):
    job, doc = job_doc
    art = next(a for a in doc["artifacts"] if a["kind"] == "procstate")
    states = json.loads(art["data"])
    for s in states["samples"]:
        for key in data.draw(st.lists(st.sampled_from(sorted(s)), max_size=4)):
            s[key] = data.draw(WRONG)
    for key in data.draw(st.lists(st.sampled_from(["job_id", "world_size", "host", "samples"]), max_size=2)):
        states[key] = data.draw(WRONG)
    ev = Evidence()
    procstate.parse(json.dumps(states).encode(), Source("processes.json", host="gpu-node-01"), ev)
    assert not ill_typed(ev), ill_typed(ev)
    samples = states["samples"] if isinstance(states["samples"], list) else []
    kept = [s for s in samples if isinstance(s, dict) and type(s.get("pid")) is int]
    assert len(ev.processes) == len(kept)  # every sample with a pid, whatever else it holds
    v = engine.run(ev)  # the facts and playbooks take whatever survived
    assert v.root_cause is not None


def test_typed_fields_keep_what_the_collector_writes(job_doc):
    _, doc = job_doc
    ev = bundle.evidence_from_documents([doc])
    assert ev.processes and all(isinstance(p, ProcessState) and isinstance(p.pid, int) for p in ev.processes)
    assert {p.state for p in ev.processes} <= set("RSDZTtXI") and ev.world_size == 3


# -- bundles ---------------------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path, job_doc):
    job, doc = job_doc
    return bundle.save([doc], tmp_path / "bundle", job)


def _manifest(root: Path, **changes) -> None:
    m = json.loads((root / "manifest.json").read_text())
    m.update(changes)
    (root / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("name", ["..", ".", "../../etc/passwd", "/etc/passwd", ".hidden", ""])
def test_artifact_names_from_a_node_stay_inside_the_bundle(tmp_path, job_doc, name):
    job, doc = job_doc
    art = next(a for a in doc["artifacts"] if a["kind"] == "pyspy")
    hostile = {**doc, "host": name or "..", "artifacts": [{**art, "name": name}]}
    root = bundle.save([hostile], tmp_path / "b", job)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert all(root in p.parents for p in written) and not (tmp_path / "etc").exists()
    ev = bundle.evidence_from_paths([str(root)])
    assert _ranks(ev) == [art["rank"]]  # saved under a name that is read back, not a hidden one


def test_a_saved_bundle_reads_back(saved):
    ev = bundle.evidence_from_paths([str(saved)])
    assert ev.live and ev.probed_hosts == ["gpu-node-01"] and _ranks(ev) == [0, 1] and ev.gaps == []


@pytest.mark.parametrize(
    "manifest",
    [b"not json at all", b"[1, 2, 3]", b'"a string"', b"\x00\xff" * 100, b""],
    ids=["not json", "a list", "a string", "binary", "empty"],
)
def test_a_manifest_that_is_not_json_is_a_gap_and_the_rest_is_read(saved, manifest):
    (saved / "manifest.json").write_bytes(manifest)
    ev = bundle.evidence_from_paths([str(saved)])
    assert [g.source for g in ev.gaps] == ["manifest.json"] and "manifest unreadable" in ev.gaps[0].message
    assert _ranks(ev) == [0, 1]


def test_a_manifest_with_wrong_types_is_read_for_what_fits(saved):
    _manifest(saved, job_id={"$ne": 1}, hosts="gpu-node-01", other_jobs=5, created="yesterday")
    ev = bundle.evidence_from_paths([str(saved)])
    assert ev.job_id == json.loads(next(saved.glob("*/processes.json")).read_text())["job_id"]  # not the dict
    assert ev.probed_hosts == [] and ev.other_jobs == [] and _ranks(ev) == [0, 1]
    _manifest(saved, job_id=12345, hosts=[7, None, "gpu-node-01"], other_jobs=["a", {"b": 1}])
    ev = bundle.evidence_from_paths([str(saved)])
    assert ev.job_id == "12345" and ev.probed_hosts == ["gpu-node-01"] and ev.other_jobs == ["a"]
    assert sum("no folder name" in g.message for g in ev.gaps) == 2


def test_a_host_named_in_the_manifest_without_its_folder_is_missing_evidence(saved):
    _manifest(saved, hosts=["gpu-node-01", "gpu-node-02"])
    ev = bundle.evidence_from_paths([str(saved)])
    assert ev.probed_hosts == ["gpu-node-01", "gpu-node-02"]
    assert [(g.source, "evidence is missing" in g.message) for g in ev.gaps] == [("gpu-node-02", True)]
    v = engine.run(ev)
    assert "gpu-node-02: named in the bundle's manifest" in " ".join(v.gaps)


@pytest.mark.parametrize("host", ["../../etc", "/etc", "..", "gpu-node-01/../../..", "a\nb"])
def test_manifest_hosts_that_escape_the_bundle_are_never_paths(tmp_path, saved, host):
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(NCCL_LOG, outside / "nccl.log")
    _manifest(saved, hosts=["gpu-node-01", host])
    ev = bundle.evidence_from_paths([str(saved)])
    assert ev.probed_hosts == ["gpu-node-01"] and ev.collectives == []
    assert [g.source for g in ev.gaps] == ["manifest.json"] and "no folder name" in ev.gaps[0].message


def test_symlinks_out_of_a_bundle_are_not_read(tmp_path, saved):
    outside = tmp_path / "secret"
    outside.mkdir()
    shutil.copy(NCCL_LOG, outside / "nccl.log")
    (saved / "gpu-node-01" / "rank12.log").symlink_to(outside / "nccl.log")
    (saved / "gpu-node-01" / "passwd").symlink_to("/etc/passwd")
    (saved / "gpu-node-01" / "more").symlink_to(outside, target_is_directory=True)
    (saved / "gpu-node-01" / "errors.json").symlink_to(outside / "nccl.log")
    ev = bundle.evidence_from_paths([str(saved)])
    assert ev.collectives == [] and not ev.events_of("nccl_port_error")  # nothing of the outside log
    out = {g.source: g.message for g in ev.gaps}
    for name in ("rank12.log", "passwd", "errors.json"):
        assert "a link out of the bundle" in out[f"gpu-node-01/{name}"]
    assert not any("root:" in g.message for g in ev.gaps)
    assert _ranks(ev) == [0, 1]


def test_a_link_inside_the_bundle_is_read(saved):
    (saved / "gpu-node-01" / "again.txt").symlink_to(next((saved / "gpu-node-01").glob("*stack*")))
    ev = bundle.evidence_from_paths([str(saved)])
    assert ev.gaps == [] and len(ev.stacks) > 2


def test_fifos_and_link_loops_in_a_bundle_become_gaps(saved):
    # (Devices are tried through the command line only, under a memory limit: see below.)
    d = saved / "gpu-node-01"
    os.mkfifo(d / "fifo.log")
    (d / "loop.log").symlink_to(d / "loop.log")
    with guard(30, "reading a bundle with a FIFO in it"):
        ev = bundle.evidence_from_paths([str(saved)])
    out = {g.source: g.message for g in ev.gaps}
    assert "not a regular file (a FIFO)" in out["gpu-node-01/fifo.log"]
    assert "unreadable: Too many levels of symbolic links" in out["gpu-node-01/loop.log"]
    assert _ranks(ev) == [0, 1]


def test_errors_and_problem_files_of_the_wrong_shape(saved):
    d = saved / "gpu-node-01"
    (d / "errors.json").write_text('{"source": "x"}')
    (d / "problem.json").write_text('["unreachable"]')
    ev = bundle.evidence_from_paths([str(saved)])
    assert ev.host_problems == [] and _ranks(ev) == [0, 1]
    (d / "errors.json").write_text('[1, "two", {"source": "py-spy", "message": "denied"}]')
    (d / "problem.json").write_text('{"kind": ["x"], "message": 7}')
    ev = bundle.evidence_from_paths([str(saved)])
    assert [(p.host, p.kind, p.message) for p in ev.host_problems] == [("gpu-node-01", "['x']", "7")]
    assert [(g.source, g.message) for g in ev.gaps] == [("gpu-node-01/py-spy", "denied")]


def test_standard_input_is_capped_like_a_file():
    with open("/dev/zero", "rb") as endless:
        t = time.monotonic()
        data = bundle.read_stream(endless)
    assert len(data) == MAX_TEXT_BYTES + 1 and time.monotonic() - t < 10
    dump = FR_PICKLE.read_bytes()
    assert bundle.read_stream(io.BytesIO(dump)) == dump
    log = NCCL_LOG.read_bytes() * (MAX_TEXT_BYTES // len(NCCL_LOG.read_bytes()) + 10)
    assert bundle.read_stream(io.BytesIO(log)) == log[-(MAX_TEXT_BYTES + 1) :]


# -- the collector's answer, as the host side reads it (probes/ssh.py) -------------------------------------


class _Answer(_Probe):
    """A probe whose node answered `out` (and `err`, status): the real parsing, without the network."""

    def __init__(self, name: str, out: bytes, err: bytes = b"", status: int | None = 0):
        super().__init__(HostSpec(name), SshSettings(), b"", time.monotonic() + 60)
        self.answer = (out, err, status)

    def _collect(self) -> dict:
        return self._document(*self.answer, "python3 -")


def _as_node_prints(doc: dict) -> bytes:
    return json.dumps(doc).encode() + b"\n"


def _answers(doc: dict) -> dict[str, bytes]:
    good = _as_node_prints(doc)
    return {
        "not JSON": b"Welcome to gpu-node!\nThis system is for authorized use only.\n",
        "JSON without the marker": b'{"hello": "world"}\n',
        "a JSON list": b"[1, 2, 3]\n",
        "cut in the middle": good[: len(good) // 2],
        "nested past the stack": b'{"hangdx_collector": 1, "x": ' + b"[" * DEEP + b"]" * DEEP + b"}",
        "NULs": b"\x00" * 100 + b'{"hangdx_collector": 1\x00}',
        "artifacts as a string": b'{"hangdx_collector": 1, "artifacts": "all of them"}',
        "artifacts of numbers": b'{"hangdx_collector": 1, "artifacts": [1, 2.5, null, "x"]}',
        "fields of the wrong type": json.dumps(
            {
                "hangdx_collector": 1,
                "host": 42,
                "errors": {"source": "x"},
                "other_jobs": "abc",
                "artifacts": [
                    {"name": {"a": 1}, "kind": ["pyspy"], "rank": "3", "pid": 1.5, "data": "hello"},
                    {"name": "d", "kind": "pyspy", "data": ["not", "text"]},
                    {"name": "n", "kind": "nccl_log", "data": 12},
                    {"name": "m", "kind": "no-such-kind", "rank": True, "data": "x"},
                ],
            }
        ).encode(),
        "missing keys": b'{"hangdx_collector": 1}',
    }


def _probe_all(answers: dict[str, bytes], good: dict) -> tuple[list[dict], Evidence]:
    docs = [_Answer(f"node-{i}", out).run() for i, out in enumerate(answers.values())]
    docs.append(_Answer("gpu-node-01", _as_node_prints(good)).run())
    return docs, bundle.evidence_from_documents(docs, job_id="j")


def test_every_broken_answer_is_one_line_for_its_host_and_the_others_are_kept(job_doc):
    _, good = job_doc
    answers = _answers(good)
    docs, ev = _probe_all(answers, good)
    by_host = {d["host"]: d for d in docs}
    for i, what in enumerate(answers):
        d = by_host[f"node-{i}"]
        problem = d.get("problem")
        gaps = [g for g in ev.gaps if g.source.startswith(f"node-{i}/")]
        assert problem or gaps or what == "missing keys", what
        for text in [problem["message"]] if problem else [g.message for g in gaps]:
            assert "\n" not in text and len(text) < 1200 and "Traceback" not in text, (what, text)
    problems = {p.host: p.kind for p in ev.host_problems}
    assert problems == {f"node-{i}": "garbage" for i in range(6)}
    assert ev.probed_hosts == [f"node-{i}" for i in range(len(answers))] + ["gpu-node-01"]
    assert _ranks(ev) == [0, 1] and {d.host for d in ev.stacks} == {"gpu-node-01"}
    wrong = [g.message for g in ev.gaps if g.source.startswith("node-6/")]
    assert wrong == ["the collector's artifacts are a str, not a list"]
    wrong = [g.message for g in ev.gaps if g.source.startswith("node-7/")]
    assert wrong == [
        f"an artifact is a {t}, not an object: skipped" for t in ("int", "float", "NoneType", "str")
    ]
    wrong = {g.source: g.message for g in ev.gaps if g.source.startswith("node-8/")}
    assert wrong["node-8/d"] == "unreadable artifact: its data is a list, not text"
    assert wrong["node-8/n"] == "unreadable artifact: its data is a int, not text"
    v = engine.run(ev)  # rank 2 may live on a host that answered garbage: the verdict says which to look at
    assert v.root_cause.category == "unknown"
    assert all(f"node-{i}" in v.root_cause.summary for i in range(6)), v.root_cause.summary
    readable = [d for d in docs if "problem" not in d]  # hosts that answered a document, however broken
    v = engine.run(bundle.evidence_from_documents(readable, job_id="j"))
    assert v.root_cause.category == "rank_crashed" and v.root_cause.culprit.ranks == [2]


def test_a_banner_holding_the_marker_does_not_hide_the_document(job_doc):
    _, good = job_doc
    banner = b'motd: {"hangdx_collector" is what this node prints}\n'
    doc = _Answer("gpu-node-01", banner + _as_node_prints(good)).run()
    assert "problem" not in doc and len(doc["artifacts"]) == len(good["artifacts"])
    assert any(f"printed {len(banner)} bytes before" in e["message"] for e in doc["errors"])


def test_a_document_printed_twice_is_read_once(job_doc):
    _, good = job_doc
    twice = _as_node_prints(good) * 2
    doc = _Answer("gpu-node-01", twice).run()
    assert "problem" not in doc and len(doc["artifacts"]) == len(good["artifacts"])
    ev = bundle.evidence_from_documents([doc], job_id="j")
    assert len(ev.stacks) == len(bundle.evidence_from_documents([good], job_id="j").stacks)


def test_a_saved_bundle_of_broken_answers_reads_back(tmp_path, job_doc):
    _, good = job_doc
    docs, _ = _probe_all(_answers(good), good)
    root = bundle.save(docs, tmp_path / "b", "j")
    ev = bundle.evidence_from_paths([str(root)])
    assert _ranks(ev) == [0, 1] and len(ev.host_problems) == 6


# -- `hangdx analyze` on what is not a file ----------------------------------------------------------------


def test_analyze_a_fifo_with_no_writer_returns_at_once(tmp_path):
    fifo = tmp_path / "stacks.fifo"
    os.mkfifo(fifo)
    r = run("analyze", str(fifo), timeout=30)
    assert r.returncode == 2 and "not a regular file (a FIFO)" in one_line(r)


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_analyze_a_device_reads_none_of_it(device):
    r = run("analyze", device, timeout=30)
    assert r.returncode == 2 and "not a regular file (a character device)" in one_line(r)


def test_analyze_an_endless_standard_input_reads_a_bounded_part_of_it():
    with open("/dev/zero", "rb") as endless:
        r = subprocess.run(
            [sys.executable, "-m", "hangdx", "analyze", "-"],
            stdin=endless,
            capture_output=True,
            timeout=60,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (1536 << 20, 1536 << 20)),
        )
    assert r.returncode == 2 and "<stdin>: not a known artifact (binary content" in one_line(r)


def test_analyze_a_link_loop_says_so(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    r = run("analyze", str(tmp_path / "a"), timeout=30)
    assert r.returncode == 2 and "link loop" in one_line(r)


def test_analyze_a_bundle_linking_to_devices_reads_none_of_them(saved):
    d = saved / "gpu-node-01"
    (d / "zero.log").symlink_to("/dev/zero")
    (d / "urandom.log").symlink_to("/dev/urandom")
    os.mkfifo(d / "fifo.log")
    r = run("analyze", str(saved), "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    v = json.loads(r.stdout)
    assert v["root_cause"]["category"] == "rank_crashed" and v["root_cause"]["culprit"]["ranks"] == [2]
    assert sorted(v["gaps"]) == [
        "gpu-node-01/fifo.log: not a regular file (a FIFO): not read",
        "gpu-node-01/urandom.log: a link out of the bundle (to /dev/urandom): not read",
        "gpu-node-01/zero.log: a link out of the bundle (to /dev/zero): not read",
    ]


def test_analyze_a_folder_of_fifos_devices_and_loops_diagnoses_what_is_readable(tmp_path):
    os.mkfifo(tmp_path / "fifo.log")
    (tmp_path / "zero.log").symlink_to("/dev/zero")
    (tmp_path / "urandom.log").symlink_to("/dev/urandom")
    (tmp_path / "loop.log").symlink_to(tmp_path / "loop.log")
    shutil.copy(NCCL_LOG, tmp_path / "rank12.log")
    r = run("analyze", str(tmp_path), "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    v = json.loads(r.stdout)
    assert v["root_cause"]["category"] == "network_fault"
    assert sorted(g.split(":")[0] for g in v["gaps"]) == ["fifo.log", "loop.log", "urandom.log", "zero.log"]


def test_analyze_a_file_root_cannot_read(tmp_path):
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) not installed: cannot drop root's CAP_DAC_OVERRIDE")
    f = tmp_path / "rank0.log"
    shutil.copy(NCCL_LOG, f)
    f.chmod(0)
    # root reads a mode-000 file anyway: drop the capabilities that let it, for hangdx only.
    drop = ("setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search", "--")
    r = run("analyze", str(f), prefix=drop)
    assert r.returncode == 2 and "permission denied" in one_line(r)
    (tmp_path / "ok.log").write_bytes(NCCL_LOG.read_bytes())
    r = run("analyze", str(tmp_path), "--json", prefix=drop)
    assert r.returncode == 0, r.stderr
    assert "rank0.log: unreadable: Permission denied" in json.loads(r.stdout)["gaps"]


def test_analyze_5000_small_files_in_bounded_time(tmp_path):
    for i in range(5000):
        (tmp_path / f"note{i:04d}.txt").write_text(f"job step {i} done, nothing to see\n")
    shutil.copy(NCCL_LOG, tmp_path / "rank12.log")
    t = time.monotonic()
    r = run("analyze", str(tmp_path), "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t < 90
    v = json.loads(r.stdout)
    assert v["root_cause"]["category"] == "network_fault" and len(v["gaps"]) == 5000


def _peak_rss_mb(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run hangdx in a fresh wrapper process, so that its peak RSS is the only child counted."""
    wrapper = (
        "import resource, subprocess, sys\n"
        "r = subprocess.run([sys.executable, '-m', 'hangdx', *sys.argv[1:]], capture_output=True)\n"
        "sys.stdout.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) + '\\n')\n"
        "sys.stderr.buffer.write(r.stderr)\n"
        "sys.exit(r.returncode)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", wrapper, *args], capture_output=True, timeout=120, preexec_fn=_limit_memory
    )
    return r, int(r.stdout.decode().split()[-1]) / 1024


def test_analyze_a_sparse_2gb_file_reads_only_its_tail(tmp_path):
    sparse = tmp_path / "huge.log"
    with sparse.open("wb") as f:
        f.truncate(2 * 1024**3)
    shutil.copy(NCCL_LOG, tmp_path / "small.log")
    base, base_mb = _peak_rss_mb("analyze", str(tmp_path / "small.log"))
    assert base.returncode == 0, base.stderr
    t = time.monotonic()
    r, peak_mb = _peak_rss_mb("analyze", str(sparse))
    assert time.monotonic() - t < 60
    assert r.returncode == 2 and f"binary file of {2 * 1024**3} bytes" in one_line(r)
    # Only the last MAX_TEXT_BYTES (+1) were read: never the 2 GB, nor MAX_FILE_BYTES.
    assert peak_mb - base_mb < 2 * MAX_TEXT_BYTES / 2**20, (peak_mb, base_mb)
