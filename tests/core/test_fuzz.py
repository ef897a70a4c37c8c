"""Every parser, fed mutations of its own real-format fixtures: never a traceback, a hang or a lie.

tests/core/test_bad_input.py feeds random bytes and token soup; this feeds what real files turn into:
cut at any byte, bytes flipped, lines deleted, duplicated or shuffled, invalid UTF-8, CRLF, NULs, lines
from other artifacts spliced in, and huge inputs (a 5 MB line, a line 100,000 times) built from real lines,
which is where a regex that backtracks catastrophically shows. Each example runs under a wall-clock guard
(SIGALRM), so a hang fails the test instead of freezing CI.

Properties: parse never raises; the Evidence holds only records of the declared types; every quote of a
text artifact is the line it names; the registry reads a file or leaves a gap naming it; the playbooks
turn whatever was read into a verdict; and an unmutated fixture still yields what it yielded before
(FOUND, recorded before the parsers were hardened), so the property can fail.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import pickle
import re
import signal
import types
import typing
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hangdx.playbooks import engine
from hangdx.probes.model import Evidence, Quote, Source
from hangdx.probes.normalise import Normaliser
from hangdx.probes.registry import HEAD_BYTES, parse_artifact, parsers
from hangdx.probes.text import lines as text_lines

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
KINDS = {m.KIND: m for m in parsers()}
CORPUS = [
    (d.name, f.name, f.read_bytes())
    for d in sorted(FIXTURES.iterdir())
    if d.name in KINDS  # a folder per artifact kind (real/ is whole pastes: tests/core/test_real_corpus.py)
    for f in sorted(d.iterdir())
    if f.is_file() and f.suffix not in (".md", ".py", ".source")
]
CATEGORIES = {
    "conditional_collective", "collective_mismatch", "rank_crashed", "dataloader_stall", "io_stall",
    "user_deadlock", "p2p_deadlock", "ddp_unused_parameters", "gpu_fault", "network_fault",
    "comm_init_failure", "straggler", "unknown",
}  # fmt: skip
# Seconds: a hang guard, not a timing target (timings live in bench/). The inputs that once hung a parser took
# minutes to hours at these sizes (regex backtracking, quadratic loops); a linear read of the biggest takes 1-4 s
# here, and more when two test streams share this machine's 2 cores, which a 5 s guard did not allow for.
GUARD = 30.0

# What each parser found in each fixture before the parsers were hardened (same records, field for field).
FOUND = {
    "flight_recorder/gloo_rank0.json": "collectives=9 fr_dump=1 fr_pg_status=2",
    "flight_recorder/gloo_rank0.pkl": "collectives=9 fr_dump=1 fr_pg_status=2",
    "flight_recorder/gloo_rank1.json": "collectives=9 fr_dump=1 fr_pg_status=2",
    "flight_recorder/gloo_rank1.pkl": "collectives=9 fr_dump=1 fr_pg_status=2",
    "flight_recorder/gloo_rank2.json": "collectives=7 fr_dump=1 fr_pg_status=1",
    "flight_recorder/gloo_rank2.pkl": "collectives=7 fr_dump=1 fr_pg_status=1",
    "flight_recorder/gloo_rank3.json": "collectives=8 fr_dump=1 fr_pg_status=1",
    "flight_recorder/gloo_rank3.pkl": "collectives=8 fr_dump=1 fr_pg_status=1",
    "flight_recorder/nccl_trace_rank_0": "collectives=8 fr_dump=1 fr_pg_status=1",
    "flight_recorder/nccl_trace_rank_0.json": "collectives=8 fr_dump=1 fr_pg_status=1",
    "flight_recorder/nccl_trace_rank_1": "collectives=8 fr_dump=1 fr_pg_status=1",
    "flight_recorder/nccl_trace_rank_1.json": "collectives=8 fr_dump=1 fr_pg_status=1",
    "flight_recorder/nccl_trace_rank_2": "collectives=7 fr_dump=1 fr_pg_status=1",
    "flight_recorder/nccl_trace_rank_2.json": "collectives=7 fr_dump=1 fr_pg_status=1",
    "flight_recorder/nccl_trace_rank_3": "collectives=6 fr_dump=1 fr_pg_status=1",
    "flight_recorder/nccl_trace_rank_3.json": "collectives=6 fr_dump=1 fr_pg_status=1",
    "ibstat/ibstat_10hca_mlx5_7_polling.txt": "ib_ports=10",
    "ibstat/ibstatus_one_down.txt": "ib_ports=3",
    "ip_link/ip_addr.txt": "links=4",
    "ip_link/ip_d_link_show.txt": "links=4",
    "ip_link/ip_link_gpu_node.txt": "links=10",
    "kernel_log/dmesg_T_ecc_oom.txt": "oom_kill=1 pcie_error=1 segfault=2 xid=4",
    "kernel_log/dmesg_xid79.txt": "hung_task=1 nic_link=2 pcie_error=1 xid=1",
    "kernel_log/journalctl_k_gpu-node-03.txt": "hung_task=1 nfs_not_responding=2 nfs_ok=1 nic_link=8 xid=4",
    "nccl_log/ib_completion_error_2.18.log": "collectives=6 nccl_ib_completion_error=1 nccl_init=1 nccl_net=3 "
    "nccl_port_error=1",
    "nccl_log/ib_status_2.29.log": "collectives=4 nccl_conn_refused=1 nccl_ib_completion_error=1 nccl_init=2 "
    "nccl_port_error=3",
    "nccl_log/single_node_2.27.log": "collectives=5 nccl_init=6 nccl_net=4",
    "nccl_log/socket_connect_refused.log": "nccl_conn_refused=3 nccl_net=3 nccl_timeout=1 nccl_warn=1",
    "nvidia_smi/compute_apps.csv": "gpu_process=8",
    "nvidia_smi/compute_apps_noheader_nounits.csv": "gpu_process=2",
    "nvidia_smi/failed_driver.txt": "nvidia_smi_failed=1",
    "nvidia_smi/gpu_lost_unknown_error.txt": "gpu_lost=1",
    "nvidia_smi/no_devices.txt": "nvidia_smi_failed=1",
    "nvidia_smi/nvml_mismatch.txt": "nvidia_smi_failed=1",
    "nvidia_smi/query_gpu_8xh100_one_idle.csv": "gpus=8",
    "nvidia_smi/query_gpu_noheader_nounits.csv": "gpus=8",
    "nvidia_smi/query_gpu_nounits.csv": "gpus=8",
    "nvidia_smi/query_gpu_one_lost.csv": "gpus=7 gpu_lost=1",
    "nvidia_smi/query_gpu_unknown_error.csv": "gpus=4 gpu_error=1",
    "nvidia_smi/smi_470_a100_4gpu_err.txt": "gpus=4 gpu_error=1",
    "nvidia_smi/smi_535_h100_8gpu_one_idle.txt": "gpus=8",
    "nvidia_smi/smi_570_h100_8gpu.txt": "gpus=8",
    "perfquery/perfquery_collector_time_only.txt": "ib_ports=2",
    "perfquery/perfquery_failed.txt": "gaps=2",
    "perfquery/perfquery_plain_same_port_twice.txt": "ib_ports=2",
    "perfquery/perfquery_x_two_samples_rising.txt": "ib_ports=4",
    "pyspy/json_rank0.json": "stacks=1 frames=3",
    "pyspy/locals_rank0.txt": "stacks=1 frames=3",
    "pyspy/native_rank0.txt": "stacks=1 frames=10",
    "pyspy/text_rank0.txt": "stacks=1 frames=3",
    "torch_log/collective_mismatch_detail.log": "collective_mismatch=2 exception=2 process_exit=1 "
    "torchrun_failure=2",
    "torch_log/cuda_oom_rank1.log": "cuda_oom=1 exception=1",
    "torch_log/ddp_unused_default.log": "connection_closed=1 ddp_unused_parameters=1 exception=2 process_exit=2 "
    "torchrun_failure=2",
    "torch_log/ddp_unused_info.log": "connection_closed=1 ddp_unused_parameters=1 exception=2 process_exit=2 "
    "torchrun_failure=2",
    "torch_log/gloo_peer_died.log": "connection_closed=1 exception=1 process_exit=2 torchrun_failure=2",
    "torch_log/gloo_recv_timeout.log": "exception=1 gloo_timeout=1 process_exit=2 torchrun_failure=2",
    "torch_log/gloo_size_mismatch.log": "connection_closed=1 exception=1 gloo_size_mismatch=1 process_exit=2 "
    "torchrun_failure=2",
    "torch_log/monitored_barrier.log": "exception=1 monitored_barrier_failed=1 process_exit=3 torchrun_failure=3",
    "torch_log/nccl_watchdog_desync.log": "collectives=2 desync_report=1 process_exit=3 torchrun_failure=1 "
    "watchdog_timeout=2 work_progress=2",
    "torch_log/rank_exception.log": "connection_closed=1 exception=2 process_exit=2 torchrun_failure=2",
    "torch_log/torchrun_sigkill.log": "process_exit=2 torchrun_failure=2",
    "horovod_log/stall_0_11_ready_ranks.log": "horovod_stall=1",
    "horovod_log/stall_missing_ranks_logger.log": "horovod_stall=2",
    "horovod_log/stall_ops_missing_ranks.log": "horovod_stall=1",
    "horovod_log/stall_shutdown_mpirun.log": "horovod_shutdown=1 horovod_stall=1",
    "pystack/busy_has_gil.txt": "stacks=1 frames=7",
    "pystack/core_sleep.txt": "stacks=1 frames=2",
    "pystack/core_sleep_native.txt": "stacks=1 frames=17",
    "pystack/error_no_such_process.txt": "gaps=1",
    "pystack/error_not_python.txt": "gaps=1",
    "pystack/gloo_lock_deadlock_rank0.txt": "stacks=1 frames=13",
    "pystack/gloo_lock_deadlock_rank0_native.txt": "stacks=1 frames=39",
    "pystack/gloo_lock_deadlock_rank1.txt": "stacks=1 frames=8",
    "pystack/gloo_lock_deadlock_rank1_native.txt": "stacks=1 frames=26",
    "pystack/gloo_lock_deadlock_rank2.txt": "stacks=1 frames=8",
    "pystack/gloo_lock_deadlock_rank2_native.txt": "stacks=1 frames=26",
    "pystack/gloo_lock_deadlock_rank3.txt": "stacks=1 frames=8",
    "pystack/gloo_lock_deadlock_rank3_native.txt": "stacks=1 frames=26",
    "pystack/gloo_skip_collective_rank0.txt": "stacks=1 frames=8",
    "pystack/gloo_skip_collective_rank0_native.txt": "stacks=1 frames=26",
    "pystack/gloo_skip_collective_rank1.txt": "stacks=1 frames=8",
    "pystack/gloo_skip_collective_rank1_native.txt": "stacks=1 frames=26",
    "pystack/gloo_skip_collective_rank2.txt": "stacks=1 frames=8",
    "pystack/gloo_skip_collective_rank2_native.txt": "stacks=1 frames=26",
    "pystack/gloo_skip_collective_rank3.txt": "stacks=1 frames=8",
    "pystack/gloo_skip_collective_rank3_native.txt": "stacks=1 frames=26",
    "pystack/lock_two_threads.txt": "stacks=1 frames=9",
    "pystack/lock_two_threads_native.txt": "stacks=1 frames=37",
    "pystack/queue_get.txt": "stacks=1 frames=5",
    "pystack/queue_get_locals.txt": "stacks=1 frames=5",
    "pystack/queue_get_native.txt": "stacks=1 frames=21",
    "pystack/sleep.txt": "stacks=1 frames=2",
    "pystack/sleep_native.txt": "stacks=1 frames=17",
    "p2p_bandwidth/ginkgo_164_v100_header.txt": "p2p_devices=1",
    "p2p_bandwidth/nccl_1264_h100_healthy.txt": "p2p_matrix=1",
    "p2p_bandwidth/nccl_814_uniform_pcie.txt": "p2p_matrix=3",
    "p2p_bandwidth/tinygrad_44_two_gpus.txt": "p2p_matrix=3",
    "p2p_bandwidth/tinygrad_6_one_gpu_slow.txt": "p2p_matrix=1",
    "nvidia_smi_q/q_a100_xid63_row_remap_pending.txt": "gpus=1 gpu_memory_error=1",
    "nvidia_smi_q/q_a10_550_clean_full.txt": "gpus=1",
    "nvidia_smi_q/q_clocks_event_reasons_sw_power_cap.txt": "",
    "nvidia_smi_q/q_clocks_throttle_reasons_grep.txt": "",
    "nvidia_smi_q/q_ecc_sram_uncorrectable.txt": "gpu_memory_error=1",
    "nvidia_smi_q/q_remapped_rows_uncorrectable_pending.txt": "gpu_memory_error=1",
    "nvidia_smi_q/q_retired_pages_pending.txt": "gpu_memory_error=1",
    "dcgmi_diag/deployment_error_gpu3_row_remap_pending.txt": "dcgm_diag_fail=1 dcgm_diag_warning=1",
    "dcgmi_diag/r2_gpu_memory_fail_gpu0_thermal.txt": "dcgm_diag_fail=1 dcgm_diag_warning=1",
    "dcgmi_diag/r3_hardware_fail_gpu0_cuctxcreate.txt": "dcgm_diag_fail=3 dcgm_diag_warning=2",
    "dcgmi_diag/r_4x_software_pass_excerpt.txt": "",
}


# -- the guard and the checks --------------------------------------------------------------------------


class Hung(Exception):
    """Raised by SIGALRM inside the code under test."""


@contextmanager
def guard(seconds: float = GUARD, what: str = ""):
    def ring(signum, frame):
        raise Hung(f"still running after {seconds}s: {what}")

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def found(ev: Evidence) -> str:
    """A record count per kind: what a parser found."""
    parts = {
        "stacks": len(ev.stacks),
        "frames": sum(len(t.frames) for d in ev.stacks for t in d.threads),
        "processes": len(ev.processes),
        "collectives": len(ev.collectives),
        "gpus": len(ev.gpus),
        "ib_ports": len(ev.ib_ports),
        "links": len(ev.links),
        "gaps": len(ev.gaps),
    }
    out = [f"{k}={v}" for k, v in parts.items() if v]
    # Events only the signal catalogue read (the reader's floor, which a parser called alone does not have)
    # are not what a parser found.
    kinds = collections.Counter(e.kind for e in ev.events if not e.fields.get("signal_only"))
    return " ".join(out + [f"{k}={v}" for k, v in sorted(kinds.items())])


def _conforms(value: object, hint: object) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, h) for h in args)
    if hint is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if origin in (set, frozenset):
        return isinstance(value, origin) and all(_conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            _conforms(k, args[0]) and _conforms(v, args[1]) for k, v in value.items()
        )
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if dataclasses.is_dataclass(hint):
        return isinstance(value, hint) and not ill_typed(value)
    return isinstance(value, hint)


_hints = functools.cache(typing.get_type_hints)


def ill_typed(rec: object) -> list[str]:
    """Fields of a record (Evidence included, recursively) whose value is not of the declared type."""
    hints = _hints(type(rec))
    return [
        f"{type(rec).__name__}.{f.name}={getattr(rec, f.name)!r:.200}"
        for f in dataclasses.fields(rec)
        if not _conforms(getattr(rec, f.name), hints[f.name])
    ]


def quotes(ev: Evidence) -> list[Quote]:
    out = [t.quote for d in ev.stacks for t in d.threads] + [
        f.quote for d in ev.stacks for t in d.threads for f in t.frames
    ]
    out += [r.quote for r in (*ev.collectives, *ev.events, *ev.gpus, *ev.ib_ports, *ev.links)]
    return [q for q in out if q is not None]


def _sample(ev: Evidence, n: int = 1000) -> Evidence:
    """The first and last n records of each kind: all of a small Evidence, enough of a huge one."""
    cut = {
        f.name: v[:n] + v[-n:] if len(v) > 2 * n else v
        for f in dataclasses.fields(ev)
        if isinstance(v := getattr(ev, f.name), list)
    }
    return dataclasses.replace(ev, **cut)


def check(kind: str, data: bytes, ev: Evidence, src: Source) -> None:
    """The Evidence one parse left: well-typed, and quoting text artifacts line for line."""
    ev = _sample(ev)
    assert not ill_typed(ev), ill_typed(ev)
    for g in ev.gaps:
        assert g.source == src.name and g.message.strip() and "\n" not in g.message, g
    # probes/text.decode drops NUL bytes (a crash-cut log's zero-filled block) before the parser sees the text.
    pyspy_json = kind == "pyspy" and data.replace(b"\x00", b"").lstrip().startswith(b"[")
    verbatim = kind != "flight_recorder" and not pyspy_json  # (those quote a rendering, not a line)
    all_lines = text_lines(data) if verbatim else []
    for q in quotes(ev):
        assert q.source == src.name, q
        if verbatim:
            assert 1 <= q.line <= len(all_lines), (q, len(all_lines))
            assert _quotes_its_line(q.text, q.line, all_lines), (q, all_lines[q.line - 1])


def _quotes_its_line(quote: str, no: int, all_lines: list[str]) -> bool:
    """A quote is its line as printed, or as the reader cleaned it (prefix, colours, bar taken off; a wrap joined)."""
    raw = all_lines[no - 1]
    clean = raw.replace("\x00", "")  # the reader drops NUL bytes
    cleaned = Normaliser().line(no, clean)
    # The reader puts torchrun's `[rankN]:` back before a cleaned log line: its quote says who said it.
    forms = [raw, clean, *(ln.text for ln in cleaned), *(ln.torchrun + ln.text for ln in cleaned)]
    q = quote.strip()
    return any(q in f for f in forms) or any(f.strip() and q.startswith(f.strip()) for f in forms[2:])


def parse(kind: str, data: bytes, name: str = "fuzz.txt") -> Evidence:
    ev, src = Evidence(), Source(name)
    with guard(what=f"{kind}.parse of {len(data)} bytes"):
        assert KINDS[kind].sniff(data[:HEAD_BYTES]) >= 0
        KINDS[kind].parse(data, src, ev)
    check(kind, data, ev, src)
    return ev


def quiet_when_empty(kind: str | None) -> bool:
    """A log kind (kernel, NCCL, torch) where nothing of note is the usual case, so reading nothing is no gap."""
    return any(m.KIND == kind and getattr(m, "QUIET_WHEN_EMPTY", False) for m in parsers())


def read_and_diagnose(data: bytes, name: str = "fuzz.txt") -> None:
    """The offline path (`hangdx analyze`): detect, parse, run the playbooks; a file read or a gap naming it."""
    ev, src = Evidence(), Source(name)
    with guard(what=f"parse_artifact + engine.run of {len(data)} bytes"):
        kind = parse_artifact(data, src, ev)
        verdict = engine.run(ev)
    check(kind or "?", data, ev, src)
    held = ev.stacks or ev.processes or ev.collectives or ev.events or ev.gpus or ev.ib_ports or ev.links
    named = [g for g in ev.gaps if g.source == name]
    assert (kind is not None and (held or quiet_when_empty(kind))) or named, (kind, ev)
    assert verdict.findings and verdict.root_cause.category in CATEGORIES
    json.dumps(verdict.to_dict())  # what --json prints


# -- mutations -------------------------------------------------------------------------------------------

INVALID_UTF8 = [
    b"\xff",
    b"\xc3\x28",
    b"\xe2\x82",
    b"\xed\xa0\x80",
    b"\xf4\x90\x80\x80",
    b"\x80\x80",
    b"\xc0\xaf",
]
ALL_LINES = [ln for _, _, data in CORPUS if data[:1] != b"\x80" for ln in data.splitlines() if ln.strip()]


def _at(draw, data: bytes) -> int:
    return draw(st.integers(0, len(data)))


def _lines(data: bytes) -> list[bytes]:
    return data.split(b"\n")


def truncate(draw, data):
    return data[: _at(draw, data)]


def drop_head(draw, data):  # the tail of a log, as `tail -c` leaves it
    return data[_at(draw, data) :]


def flip(draw, data):
    if not data:
        return data
    i = draw(st.integers(0, len(data) - 1))
    return data[:i] + bytes([draw(st.integers(0, 255))]) + data[i + 1 :]


def insert(draw, data):
    i = _at(draw, data)
    junk = draw(
        st.sampled_from([b"\x00", b"\x00" * 64, b"\r", b"\n", *INVALID_UTF8]) | st.binary(max_size=32)
    )
    return data[:i] + junk + data[i:]


def delete_line(draw, data):
    ls = _lines(data)
    del ls[draw(st.integers(0, len(ls) - 1))]
    return b"\n".join(ls)


def duplicate_line(draw, data):
    ls = _lines(data)
    i = draw(st.integers(0, len(ls) - 1))
    ls[i:i] = [ls[i]] * draw(st.integers(1, 200))
    return b"\n".join(ls)


def shuffle_lines(draw, data):
    return b"\n".join(draw(st.permutations(_lines(data))))


def crlf(draw, data):
    return data.replace(b"\n", b"\r\n")


def splice(draw, data):  # a line of another artifact (any kind) in the middle of this one
    ls = _lines(data)
    ls.insert(draw(st.integers(0, len(ls))), draw(st.sampled_from(ALL_LINES)))
    return b"\n".join(ls)


def huge_number(draw, data):  # one number made 5000 digits long: int() refuses it (ValueError)
    runs = list(re.finditer(rb"\d+", data))
    if not runs:
        return data
    m = draw(st.sampled_from(runs))
    return data[: m.start()] + b"9" * 5000 + data[m.end() :]


MUTATIONS = [
    truncate,
    drop_head,
    flip,
    insert,
    delete_line,
    duplicate_line,
    shuffle_lines,
    crlf,
    splice,
    huge_number,
]


@st.composite
def mutated(draw):
    kind, name, data = draw(st.sampled_from(CORPUS))
    done = []
    for op in draw(st.lists(st.sampled_from(MUTATIONS), max_size=4)):
        data = op(draw, data)
        done.append(op.__name__)
    return kind, name, data, done


@pytest.mark.parametrize("kind,name,data", CORPUS, ids=[f"{k}/{n}" for k, n, _ in CORPUS])
def test_each_fixture_still_yields_what_it_yielded_before(kind, name, data):
    before = FOUND.get(f"{kind}/{name}")  # a fixture newer than this table: read, and by its own kind
    got = found(parse(kind, data, name))
    assert got == before or (before is None and got)
    ev = Evidence()
    assert parse_artifact(data, Source(name), ev) == kind  # detected by content, as before
    assert found(ev) == got


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=mutated())
@example(
    case=(
        "torch_log",
        "monitored_barrier.log",
        b'\n*****************************************\nSetting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system being overloaded, please further tune the variable for optimal performance in your application as needed. \n*****************************************\n[rank0]:[E1122 01:48:50.682679688 ProcessGroupGloo.cpp:2901] [Rank 0]: Rank 1 failed to pass monitoredBarrier in 3000 ms\n[rank0]:[E1122 01:48:50.682717997 ProcessGroupGloo.cpp:2901] [Rank 0]: Rank 2 failed to pass monitoredBarrier in 3000 ms\n[rank0]:[E1122 01:48:50.682727592 ProcessGrou\x1bGloo.cpp:67] [Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in 3000 ms\n[rank0]: Traceback (most recent call last):\n[rank0]:   File "/tmp/hangdx_fixture_dfs1c0bq/train.py", line 10, in <module>\n[rank0]:     dist.monitored_barrier(timeout=timedelta(seconds=3), wait_all_ranks=True)\n[rank0]:   File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 5435, in monitored_barrier\n[rank0]:     return group_to_use.monitored_barrier(  # type:ignore[attr-defined]\n[rank0]:            ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n[rank0]: RuntimeError: [Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in 3000 ms\nW1122 01:48:50.844000 8255 site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 8270 closing signal SIGTERM\nW1122 01:48:50.847000 8255 site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 8271 closing signal SIGTERM\nE1122 01:48:50.879000 8255 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 8269) of binary: /root/.pyenv/versions/3.11.7/bin/python\nTraceback (most recent call last):\n  File "<frozen runpy>", line 198, in _run_module_as_main\n  File "<frozen runpy>", line 88, in _run_code\n  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>\n    main()\n  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper\n    return f(*args, **kwargs)\n           ^^^^^^^^^^^^^^^^^^\n  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/run.py", line 1028, in main\n    run(args)\n  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/run.py", line 1019, in run\n    elastic_launch(\n  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 194, in __call__\n    return launch_agent(\n           ^^^^^^^^^^^^^\n  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent\n    raise ChildFailedError(\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n============================================================\n/tmp/hangdx_fixture_dfs1c0bq/train.py FAILED\n------------------------------------------------------------\nFailures:\n[1]:\n  time      : 2026-11-22_01:48:50\n  host      : localhost\n  rank      : 1 (local_rank: 1)\n  exitcode  : -15 (pid: 8270)  (SIGTERM)\n  error_file: <N/A>\n  traceback : Signal 15 (SIGTERM) received by PID 8270\n[2]:\n  time      : 2026-11-22_01:48:50\n  host      : localhost\n  rank      : 2 (local_rank: 2)\n  exitcode  : -15 (pid: 8271)  (SIGTERM)\n  error_file: <N/A>\n  traceback : Signal 15 (SIGTERM) received by PID 8271\n------------------------------------------------------------\nRoot Cause (first observed failure):\n[0]:\n  time      : 2026-11-22_01:48:50\n  host      : localhost\n  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 8269) \n  error_file: <N/A>\n  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n============================================================\n',
        ["flip"],
    ),
).via("discovered failure")
def test_mutated_fixtures_parse_to_valid_evidence(case):
    kind, name, data, done = case
    ev = parse(kind, data, name)
    if not done and f"{kind}/{name}" in FOUND:
        assert found(ev) == FOUND[f"{kind}/{name}"]
    read_and_diagnose(data, name)


def _claimed_by(kind: str, data: bytes) -> bool:
    """Whether a line of data is one that kind's own parser claims (any line, when it claims none by line)."""
    from hangdx.probes import registry

    mod = next((m for m in registry.parsers() if m.KIND == kind), None)
    if mod is None or not hasattr(mod, "claims"):
        return True
    return any(mod.claims(ln) for ln in data.decode("utf-8", "replace").splitlines())


@settings(max_examples=400, deadline=None)
@given(case=st.sampled_from(CORPUS), data=st.data())
def test_a_truncated_artifact_is_read_or_named_in_a_gap(case, data):
    kind, name, whole = case
    cut = whole[: data.draw(st.integers(0, len(whole) - 1))]
    ev = Evidence()
    with guard():
        got = parse_artifact(cut, Source(name), ev)
    mine = [g.message for g in ev.gaps if g.source == name]
    held = ev.stacks or ev.collectives or ev.events or ev.gpus or ev.ib_ports or ev.links or ev.processes
    # A cut that holds no line of its own kind (an ncclras report cut after its `NCCL version` line) is a text of
    # another kind, and reading it as that kind is right.
    other = got not in (None, kind) and held and not _claimed_by(kind, cut)
    assert (got == kind and (held or quiet_when_empty(kind))) or mine or other, (got, ev)
    if kind == "flight_recorder" and got == kind:  # a cut dump says so, not "corrupt"
        assert "cut short" in mine[0], mine


def test_a_prefixed_nccl_log_cut_anywhere_is_still_read_as_nccl():
    """Issue 14: a `[rank12]:`-prefixed NCCL log cut short was taken for a PyTorch log and yielded nothing."""
    whole = next(d for k, n, d in CORPUS if n == "ib_status_2.29.log")
    first_line = whole.index(b"\n") + 1
    for cut in range(first_line, len(whole), 97):
        ev = Evidence()
        assert parse_artifact(whole[:cut], Source("cut.log"), ev) == "nccl_log", cut
        assert ev.events or ev.collectives, cut
        assert all(e.rank == 12 for e in ev.events), cut


def test_a_torchrun_log_cut_in_its_second_line_is_named_a_pytorch_log():
    """Too short for either sniff, glog lines of torchrun's own with no NCCL line were named an NCCL log that read
    nothing: neither the kind the text is nor a gap (found by the truncation fuzz above)."""
    whole = next(d for k, n, d in CORPUS if n == "two_pods_trainer_node0.log")
    second = whole.index(b"\n") + 1
    for cut in range(whole.index(b"] *", second) + 3, whole.index(b"\n", second)):
        ev = Evidence()
        assert parse_artifact(whole[:cut], Source("cut.log"), ev) == "torch_log", cut


# -- huge inputs made of real lines ----------------------------------------------------------------------

BIG = 5_000_000


def _longest(kind: str) -> bytes:
    return max((ln for k, _, d in CORPUS if k == kind and d[:1] != b"\x80" for ln in d.splitlines()), key=len)


def _typical(kind: str) -> bytes:
    """The line of median length in the kind's biggest fixture."""
    ls = sorted((ln for ln in _richest(kind).splitlines() if ln.strip()), key=len)
    return ls[len(ls) // 2]


def _richest(kind: str) -> bytes:
    return max((d for k, _, d in CORPUS if k == kind and d[:1] != b"\x80"), key=len)


HUGE = {
    "one 5 MB line": lambda k: b" ".join([_longest(k)] * (BIG // len(_longest(k)))),
    "a line 100,000 times": lambda k: (_typical(k) + b"\n") * 100_000,
    "the file repeated to 5 MB": lambda k: (_richest(k).rstrip(b"\n") + b"\n") * (BIG // len(_richest(k))),
    "5 MB of blanks in a line": lambda k: _longest(k)[:20] + b" \t" * (BIG // 2) + _longest(k)[20:],
}


@pytest.mark.parametrize("how", HUGE)
@pytest.mark.parametrize("kind", sorted(KINDS.keys() - {"procstate"}))
def test_huge_input_made_of_real_lines_is_read_in_bounded_time(kind, how):
    data = HUGE[how](kind)
    ev = parse(kind, data)
    if how == "the file repeated to 5 MB":
        assert found(ev), "a real file, repeated, is still read"


@st.composite
def long_line(draw):
    """A real line cut anywhere, repeated into one long line; or a run of one of its characters inside."""
    kind, _, data = draw(st.sampled_from([c for c in CORPUS if c[2][:1] != b"\x80"]))
    line = draw(st.sampled_from([ln for ln in data.splitlines() if ln.strip()]))
    cut = draw(st.integers(1, len(line)))
    if draw(st.booleans()):
        return kind, line[:cut] * (400_000 // cut + 1)
    run = draw(st.sampled_from([line[cut - 1 : cut], b" ", b"\t", b"0", b"a", b"(", b"[", b":", b","]))
    return kind, line[:cut] + run * 400_000 + line[cut:]


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(case=long_line())
def test_long_lines_built_from_real_lines_never_backtrack(case):
    kind, data = case
    parse(kind, data)
    parse(kind, data[: HEAD_BYTES - 1])  # what every sniff sees, through the parser too


def _prefix(path: str, start: str, end: str | None = None) -> bytes:
    """From the fixture's first line starting with `start`: that line up to and including `end`."""
    line = next(ln for ln in (FIXTURES / path).read_bytes().splitlines() if ln.startswith(start.encode()))
    return line[: line.index(end.encode()) + len(end)] if end else line


# Every input that once hung a parser (seconds to hours at 1 MB; regex backtracking, or a quadratic loop).
REGRESSIONS = {
    "nccl_log: one long word (sniff, _LINE)": ("nccl_log", lambda: b"a" * 1_000_000 + b" NCCL INFO x"),
    "nccl_log: 'gpu-' repeated (_LINE)": ("nccl_log", lambda: b"gpu-" * 250_000),
    "nccl_log: init line without 'Init COMPLETE' repeated (_INIT_DONE)": (
        "nccl_log",
        lambda: (
            _prefix(
                "nccl_log/single_node_2.27.log", "train-a100-7:5512:5531 [1] NCCL INFO ncclCommInitRankConfig"
            )
            * 6000
        ),
    ),
    "nccl_log: 'nccl' repeated as one word (_INIT_DONE)": (
        "nccl_log",
        lambda: b"h:1:2 [0] NCCL INFO " + b"nccl" * 250_000,
    ),
    "nccl_log: 'Connect to .. failed :' then blanks (_CONNECT_FAIL)": (
        "nccl_log",
        lambda: (
            _prefix(
                "nccl_log/socket_connect_refused.log", "worker-1:3310:3352 [0] misc/socket.cc", "failed :"
            )
            + b" " * 1_000_000
            + b"x"
        ),
    ),
    "nccl_log: 'Call to connect returned' repeated (_CONNECT_FAIL)": (
        "nccl_log",
        lambda: b"w:1:2 [0] NCCL INFO " + b"Call to connect returned " * 40_000,
    ),
    "nccl_log: 'async event :' then blanks (_IB_ASYNC)": (
        "nccl_log",
        lambda: (
            _prefix(
                "nccl_log/ib_completion_error_2.18.log", "gpu-node-02:41822:42012 [1] transport", "event :"
            )
            + b" " * 1_000_000
            + b"x"
        ),
    ),
    "nccl_log: 'Using network' then blanks (_NET_NETWORK)": (
        "nccl_log",
        lambda: b"w:1:2 [0] NCCL INFO Using network " + b" " * 1_000_000 + b"x",
    ),
    "torch_log: 'WorkNCCL(' repeated, never closed (_WATCHDOG)": (
        "torch_log",
        lambda: b"[rank0]: " + b"Watchdog caught collective operation timeout: WorkNCCL(" * 20_000,
    ),
    "torch_log: 'CollectiveFingerPrint(' repeated, never closed (_fingerprints)": (
        "torch_log",
        lambda: (
            b"[rank0]: Detected mismatch between collectives on ranks. "
            + b"Rank 1 is running collective: CollectiveFingerPrint(" * 20_000
        ),
    ),
    "torch_log: '[PG 1 (' repeated (_PG_RANK)": (
        "torch_log",
        lambda: b"[rank0]: last enqueued work: 1, " + b"[PG 1 (" * 150_000,
    ),
    "torch_log: torchrun field then blanks (_TR_FIELD)": (
        "torch_log",
        lambda: b"Root Cause (first observed failure):\n[0]:\n  time      : " + b" " * 1_000_000 + b"x\n",
    ),
    "torch_log: traceback frame then blanks (_FRAME)": (
        "torch_log",
        lambda: b'Traceback (most recent call last):\n  File "a.py", line 1, in ' + b" " * 1_000_000 + b"x\n",
    ),
    "torch_log: OOM 'total capacity;' then digits (_OOM_TOTAL_OLD)": (
        "torch_log",
        lambda: b"CUDA out of memory. Tried to allocate 2.00 GiB 1 GiB total capacity;" + b"1" * 1_000_000,
    ),
    "kernel_log: 'INFO: task ' repeated (_HUNG)": (
        "kernel_log",
        lambda: b"[ 1.000000] " + b"INFO: task a:1 " * 70_000,
    ),
    "kernel_log: 'Killed process 1 (' repeated (_OOM_KILLED)": (
        "kernel_log",
        lambda: b"[ 1.000000] " + b"Out of memory: Killed process 1 (" * 30_000,
    ),
    "kernel_log: 'fallen off the bus' lines after other events and an Xid 79 (list.remove per event)": (
        "kernel_log",
        lambda: (
            b"[1.000000] nfs: server a OK\n" * 50_000
            + b"[1.000000] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus.\n"
            + b"[1.000001] NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.\n" * 50_000
        ),
    ),
    "nvidia_smi: table row with a long blank name (_ROW1)": (
        "nvidia_smi",
        lambda: b"|   0  NVIDIA" + b" " * 1_000_000 + b"x | 00000000:04:00.0 Off | 0 |",
    ),
    "nvidia_smi: process row with a long blank name (_PROC)": (
        "nvidia_smi",
        lambda: b"| Processes: |\n|    0   N/A  N/A    1      C   " + b" " * 1_000_000 + b"x |",
    ),
    "nvidia_smi: CSV header with blanks before a unit (_csv_header)": (
        "nvidia_smi",
        lambda: b"index, name" + b" " * 1_000_000 + b"x [MiB],",
    ),
    "pyspy: frame prefix repeated (_FRAME)": ("pyspy", lambda: b"Thread 1 (idle)\n" + b"    f (" * 160_000),
    "pyspy: marker with one long word (_KV)": ("pyspy", lambda: b"# hangdx stack-sample " + b"a" * 1_000_000),
    "nccl_log: '(function' never closed, repeated (_LINE)": (
        "nccl_log",
        lambda: b"h:1:2 [0] a:1 (" * 70_000 + b" NCCL INFO x",
    ),
    "torch_log: digits before 'Received data size' (_GLOO_SIZE)": (
        "torch_log",
        lambda: b"1" * 1_000_000 + b" Received data size doesn't match expected size",
    ),
    "torch_log: 'Connection closed by peer [' repeated (_CONN_CLOSED)": (
        "torch_log",
        lambda: b"Connection closed by peer [" * 40_000,
    ),
    "nvidia_smi: second table row of digits (_MEM, _POWER)": (
        "nvidia_smi",
        lambda: (
            b"|   0  NVIDIA H100   On  | 00000000:04:00.0 Off | 0 |\n| x | " + b"1" * 1_000_000 + b" | 1 |"
        ),
    ),
    "perfquery: marker with one long word (_KV)": (
        "perfquery",
        lambda: b"# hangdx sample 1 " + b"a" * 1_000_000,
    ),
}


@pytest.mark.parametrize("name", REGRESSIONS)
def test_inputs_that_once_hung_a_parser(name):
    kind, build = REGRESSIONS[name]
    data = build()
    parse(kind, data)
    with guard(what=name):
        for mod in KINDS.values():  # every sniff sees the head of every file
            mod.sniff(data[:HEAD_BYTES])


# Numbers of 5000 digits: int() refuses them (ValueError), which once escaped these parsers.
HUGE_NUMBER = "9" * 5000
NUMBERS = {
    "pyspy": f'Process {HUGE_NUMBER}: python\nThread {HUGE_NUMBER} (idle): "MainThread"\n    f (a.py:{HUGE_NUMBER})\n'
    f'# hangdx stack-sample time={HUGE_NUMBER}x rank=1\nThread 1 (idle): "MainThread"\n',
    "perfquery": f"# Port counters: Lid {HUGE_NUMBER} port 1\nSymbolErrorCounter:....{HUGE_NUMBER}\nLinkDownedCounter:....007\n",
    "ibstat": f"CA 'mlx5_0'\n\tPort {HUGE_NUMBER}:\n\t\tState: Active\n",
    "ip_link": f"2: eth0: <UP> mtu {HUGE_NUMBER} qdisc mq state UP\n",
    "kernel_log": f"[ 1.000000] NVRM: Xid (PCI:0000:3b:00): {HUGE_NUMBER}, pid=1, name=python, x\n",
    "nvidia_smi": f"index, pci.bus_id\n{HUGE_NUMBER}, 00000000:04:00.0\n|  {HUGE_NUMBER}  NVIDIA H100   On  | 00000000:04:00.0 Off | 0 |\n",
}


@pytest.mark.parametrize("kind", NUMBERS)
def test_numbers_too_long_for_int_skip_their_line(kind):
    ev = parse(kind, NUMBERS[kind].encode())
    assert HUGE_NUMBER not in found(ev)


@pytest.mark.parametrize("kind,name,data", CORPUS, ids=[f"{k}/{n}" for k, n, _ in CORPUS])
def test_every_number_of_a_fixture_5000_digits_long(kind, name, data):
    if data[:1] != b"\x80":  # (a pickle's digits are not numbers)
        read_and_diagnose(re.sub(rb"\d+", HUGE_NUMBER.encode(), data), name)
        parse(kind, re.sub(rb"\d+", HUGE_NUMBER.encode(), data), name)


# -- Flight Recorder dumps with fields of every wrong type -----------------------------------------------

FR_DUMPS = [(n, d) for k, n, d in CORPUS if k == "flight_recorder"]
HOSTILE_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([2**63, -(2**63) - 1, 10**4000, -1, 0]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.sampled_from(["x" * 100_000, "[0, 1, 2, 3", "nccl:", ":", "gloo:all_reduce" * 1000]),
    st.recursive(
        st.integers() | st.text(max_size=5),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=5), c, max_size=4),
        max_leaves=12,
    ),
)


@st.composite
def fr_mutated(draw):
    name, data = draw(st.sampled_from(FR_DUMPS))
    dump = pickle.loads(data) if data[:1] == b"\x80" else json.loads(data)
    entries = dump.get("entries") if isinstance(dump, dict) else None
    for _ in range(draw(st.integers(1, 6))):
        dicts = [e for e in entries or [] if isinstance(e, dict) and e]
        if dicts and draw(st.booleans()):  # one field of one entry: where a dump's records come from
            entry = draw(st.sampled_from(dicts))
            entry[draw(st.sampled_from(sorted(entry)))] = draw(HOSTILE_VALUES)
            continue
        node = dump
        while True:  # walk down to a random container, then replace one of its values
            keys = list(node.keys()) if isinstance(node, dict) else list(range(len(node)))
            if not keys:
                break
            key = draw(st.sampled_from(keys))
            if isinstance(node[key], (dict, list)) and node[key] and draw(st.booleans()):
                node = node[key]
                continue
            node[key] = draw(HOSTILE_VALUES)
            break
    if draw(st.booleans()):
        return name, dump, pickle.dumps(dump, protocol=draw(st.integers(2, 5)))
    try:
        return name, dump, json.dumps(dump).encode()
    except ValueError:  # 10**4000 has no JSON form: Python refuses to print it
        return name, dump, pickle.dumps(dump, protocol=2)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=fr_mutated())
def test_flight_recorder_fields_of_the_wrong_type_lose_only_themselves(case):
    name, dump, data = case
    ev = parse("flight_recorder", data, name)
    entries = dump.get("entries") if isinstance(dump, dict) else None
    if isinstance(entries, list) and entries:
        # Every entry that is still a dict is a record, whatever its fields hold; the others are a gap.
        assert len(ev.collectives) == sum(isinstance(e, dict) for e in entries), ev.gaps
        assert not any("only partly read" in g.message for g in ev.gaps), ev.gaps
    read_and_diagnose(data, name)  # and the playbooks take whatever the records hold


@pytest.mark.parametrize(
    "value",
    [10**400, -(10**400), float("inf"), float("nan"), 2**64],
    ids=["1e400", "-1e400", "inf", "nan", "2^64"],
)
def test_flight_recorder_numbers_past_any_range_in_every_field_lose_only_themselves(value):
    """Found by the fuzzer above in CI: a `duration_ms` of 10**400 was formatted as a float (OverflowError) and
    the whole dump was lost. Every field of every entry, one at a time, in pickle (JSON has no 10**400)."""
    for name, data in FR_DUMPS:
        dump = pickle.loads(data) if data[:1] == b"\x80" else json.loads(data)
        entries = dump.get("entries") if isinstance(dump, dict) else None
        if not isinstance(entries, list) or not entries or not isinstance(entries[0], dict):
            continue
        for field in sorted(entries[0]) + ["duration_ms"]:
            mutated = pickle.loads(pickle.dumps(dump))
            mutated["entries"][0][field] = value
            ev = parse("flight_recorder", pickle.dumps(mutated, protocol=2), name)
            assert len(ev.collectives) == len(entries), (name, field, ev.gaps)
            assert not any("only partly read" in g.message for g in ev.gaps), (name, field, ev.gaps)
