"""PyTorch Flight Recorder dumps (pickle or JSON, NCCL or gloo) -> CollectiveRecords and dump summaries.

A dump is what `torch._C._distributed_c10d._dump_fr_trace()` / `_dump_nccl_trace()` return (a pickle, protocol 2)
or their `_json` twins, and what ProcessGroupNCCL writes on a watchdog timeout to `<TORCH_FR_DUMP_TEMP_FILE><rank>`.
Top level: version, pg_config {name: {name, desc, ranks}}, comm_lib_version, pg_status {pg_id: {last_enqueued_-,
last_started_-, last_completed_collective}}, entries [...], maybe nccl_comm_state. The rank is in no key (only
the debug server adds "rank"): it comes from the caller or the file name (`nccl_trace_rank_3`, `gloo_rank3.pkl`).

What differs, and how this reader copes:
- Versions: keys come and go (thread_name/thread_id, duration_ms only with timing, seq_id before
  collective_seq_id, very old dumps were a bare list of entries). Every key is optional here.
- JSON vs pickle: JSON has no frames, process_group is a list not a tuple, pg_status values are strings,
  time_discovered_*_ns is 0 instead of None, and "entries" is absent when there are none.
- gloo (torch 2.13): every entry's state stays "scheduled" (gloo has no events to query) and `retired` is what
  says the work finished (successfully or not: a gloo timeout is retired too), so a retired gloo entry counts as
  completed. pg_status last_started_collective is always -1 and last_enqueued counts p2p ops too. Send/recv
  are not recorded at all. pg_config is keyed "" with desc "" (ProcessGroupGloo records its ranks in its
  constructor, before distributed_c10d gives it a name), and a later subgroup overwrites that one row with
  its own ranks (often "[]"), while entries name the group "0"/"default_pg". That mismatch is why torch 2.13's
  own `torchfrtrace` dies with KeyError: ('0', <rank>) in build_collectives (`_pg_guids[(pg_name, rank)]`).
  We never key entries by pg_config, so gloo dumps read fine.
- NCCL: a retired entry that is not completed is one the watchdog gave up on (timed out).
Unpickling is restricted: dumps are untrusted input, so no class or function may be loaded.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import pickletools
import re
from pathlib import PurePath
from typing import Any

from hangdx.probes.model import CollectiveRecord, Evidence, LogEvent, Quote, Source
from hangdx.probes.naming import rank_from_name
from hangdx.probes.rx import lazy

KIND = "flight_recorder"

_BACKENDS = ("nccl", "ncclx", "gloo", "xccl", "rccl", "rcclx", "mccl", "hccl", "ucc", "mpi")

# profiling_name (without backend, lower-case, underscores removed) -> the op name every parser uses.
_OP_ALIASES = {
    "allreducebarrier": "barrier",
    "allgatherbase": "allgather",
    "allgatherintotensor": "allgather",
    "allgathersingle": "allgather",
    "reducescatterbase": "reducescatter",
    "reducescattertensor": "reducescatter",
    "reducescattersingle": "reducescatter",
    "alltoallbase": "alltoall",
    "alltoallsingle": "alltoall",
    "broadcastoop": "broadcast",
    "reduceoop": "reduce",
    "allgatherintotensorcoalesced": "allgathercoalesced",
    "allgathersinglecoalesced": "allgathercoalesced",
    "reducescattertensorcoalesced": "reducescattercoalesced",
    "reducescattersinglecoalesced": "reducescattercoalesced",
}
_P2P_OPS = {"send", "recv", "recvanysource"}

_TRAILING_DIGITS = lazy(r"(\d+)$")
_DUMP_EXTENSIONS = (".pkl", ".pickle", ".json", ".bin", ".pt")

# A pickle may refer to one object many times (its memo): real dumps share strings and small lists, so that
# the data they unpack to is ~3x the file. A hostile one nests shared lists to unpack to terabytes ("billion
# laughs"), or into a cycle. What a pickle unpacks to is counted (one per object, one per character) and
# refused past EXPANSION times its size plus EXPANSION_SLACK, before anything reads it.
EXPANSION = 32
EXPANSION_SLACK = 1 << 20
# Flight Recorder keeps a ring of TORCH_FR_BUFFER_SIZE entries (2,000 by default); a dump with more than ten times
# that was not written by it. The newest are kept (the hang is at the end), the older ones counted.
MAX_ENTRIES = 20_000
LEFT_OUT = "_hangdx_entries_left_out"  # set on a decoded dump whose older entries were left out
MAX_STR = 1024  # a name, state or dtype longer than this is cut (it is quoted in every entry's line)
MAX_DIMS = 64  # a shape with more dimensions has no element count (the product would grow without bound)
_INT64 = 1 << 63


class _PlainDataUnpickler(pickle.Unpickler):
    """Unpickles only what the opcodes build themselves (dicts, lists, tuples, str, numbers, bool, None)."""

    _ALLOWED = {("builtins", "set"), ("builtins", "frozenset"), ("__builtin__", "set")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return set if name == "set" else frozenset
        raise pickle.UnpicklingError(f"refused {module}.{name}: a Flight Recorder dump holds only plain data")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused a persistent id: a Flight Recorder dump holds only plain data")


def sniff(head: bytes) -> int:
    """Score bytes as a Flight Recorder dump: a pickle or JSON object with FR's top-level or entry keys."""
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        top = b"pg_config" in head and b"version" in head
        entry = b"profiling_name" in head and b"collective_seq_id" in head
        if top and (b"entries" in head or b"pg_status" in head):
            return 95
        if top or entry:
            return 80
        return 0
    text = head.lstrip()
    if not text.startswith((b"{", b"[")):
        return 0
    # nlohmann sorts keys, so a big JSON dump shows "entries" first and "pg_config"/"version" only at the end.
    entry = b'"profiling_name"' in text and b'"collective_seq_id"' in text
    top = b'"pg_config"' in text and (b'"pg_status"' in text or b'"version"' in text)
    if entry and (b'"process_group"' in text or b'"record_id"' in text):
        return 90
    if top:
        return 85
    return 0


def load(data: bytes) -> tuple[Any, str | None]:
    """Decode a dump's bytes (pickle or JSON) into plain Python data, or (None, why not)."""
    if not data:
        return None, "empty file"
    if data[:1] == b"\x80":
        try:
            if data[1:2] >= b"\x04":
                # Protocols 4 and 5 carry 8-byte lengths, for which the C unpickler allocates before it reads
                # (a 2**62-byte bytearray: MemoryError, and noise on stderr). pickletools reads, never allocates.
                for _ in pickletools.genops(data):
                    pass
            obj = _unpickle(data)
        except Exception as e:  # noqa: BLE001 - truncated, corrupt or hostile pickles all end here
            if isinstance(e, Refused):
                return None, f"refused pickle: {e}"
            if isinstance(e, EOFError) or "truncated" in str(e) or "remain" in str(e):
                return None, "unreadable pickle: cut short (a truncated file?)"
            return None, f"unreadable pickle ({type(e).__name__}: {_short(e)})"
        budget = EXPANSION * len(data) + EXPANSION_SLACK
        if _unpacked_size(obj, budget) > budget:
            return (
                None,
                f"refused pickle: its {len(data)} bytes unpack to more than {budget} objects/characters",
            )
        return _trim(obj), None
    try:
        if len(data) > IN_PROCESS:
            return _in_child(data, "json"), None
        return _json_dump(data.decode("utf-8", errors="strict")), None
    except Refused as e:
        return None, f"refused JSON: {e}"
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        what = (
            "JSON that does not parse (cut short?)"
            if data.lstrip()[:1] in (b"{", b"[")
            else "neither a pickle nor JSON"
        )
        return None, f"{what} ({type(e).__name__}: {_short(e)})"


# Objects a pickle builds cost up to ~100 bytes per byte of pickle (an empty dict is 64 bytes, its opcode one), and
# the check on what it unpacked to can only run after: a pickle bigger than IN_PROCESS is unpickled in a child
# process whose memory and CPU time are capped, and comes back as marshal data (the same plain types).
IN_PROCESS = 256 << 10
CHILD_PER_BYTE = 16  # memory the child may add per byte of pickle (real dumps unpack to ~3x their size) ...
CHILD_SLACK = 64 << 20  # ... plus this
CHILD_MEMORY = 768 << 20  # and never more than this
CHILD_CPU_SECONDS = 20


class Refused(Exception):
    """A pickle whose unpickling would cost more than hangdx allows."""


def _unpickle(data: bytes) -> Any:
    if len(data) <= IN_PROCESS:
        return _PlainDataUnpickler(io.BytesIO(data)).load()
    return _in_child(data, "pickle")


def _in_child(data: bytes, fmt: str) -> Any:
    """Decode a big dump (pickle or JSON) in a child process whose memory and CPU time are capped; its entries
    come back trimmed to MAX_ENTRIES, as marshal data."""
    import marshal
    import subprocess
    import sys

    code = "from hangdx.probes.flight_recorder import _child; _child()"
    try:
        r = subprocess.run(
            [sys.executable, "-c", code, str(CHILD_MEMORY), str(CHILD_CPU_SECONDS), fmt],
            input=data,
            capture_output=True,
            timeout=CHILD_CPU_SECONDS + 10,
        )
    except subprocess.TimeoutExpired:
        raise Refused(f"decoding took over {CHILD_CPU_SECONDS} s") from None
    if r.returncode == 0:
        return marshal.loads(r.stdout)
    why = r.stderr.decode("utf-8", "replace").strip().splitlines()
    if r.returncode in (3, -9, -24) or not why:  # MemoryError, killed at the memory or CPU limit
        allowed = min(CHILD_MEMORY, CHILD_PER_BYTE * len(data) + CHILD_SLACK) >> 20
        raise Refused(
            f"its {len(data):,} bytes need more than {allowed} MB or {CHILD_CPU_SECONDS} s to decode"
        )
    if fmt == "json":
        raise ValueError(why[-1][:200])
    raise pickle.UnpicklingError(why[-1][:200])


def _child() -> None:
    """In the child: limits first, then decode standard input (pickle or JSON), trim its entries and write it
    back as marshal data."""
    import marshal
    import resource
    import sys

    memory, cpu = int(sys.argv[1]), int(sys.argv[2])
    fmt = sys.argv[3] if len(sys.argv) > 3 else "pickle"
    data = sys.stdin.buffer.read()
    with open("/proc/self/status") as f:
        base = next((int(x.split()[1]) << 10 for x in f if x.startswith("VmSize:")), 0)
    limit = base + min(memory, CHILD_PER_BYTE * len(data) + CHILD_SLACK)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    try:
        if fmt == "json":
            obj = _json_dump(data.decode("utf-8", errors="strict"))
        else:
            obj = _trim(_PlainDataUnpickler(io.BytesIO(data)).load())
    except MemoryError:
        sys.exit(3)
    except Exception as e:  # noqa: BLE001 - said in one line to the parent
        sys.stderr.write(f"{type(e).__name__}: {_short(e)}\n")
        sys.exit(4)
    try:
        out = marshal.dumps(obj)
    except ValueError:
        sys.stderr.write("nested too deeply: a Flight Recorder dump is a few levels deep\n")
        sys.exit(4)
    except MemoryError:
        sys.exit(3)
    except Exception as e:  # noqa: BLE001 - said in one line to the parent
        sys.stderr.write(f"{type(e).__name__}: {_short(e)}\n")
        sys.exit(4)
    sys.stdout.buffer.write(out)


def _trim(obj: Any) -> Any:
    """A decoded dump with only its newest MAX_ENTRIES entries; how many were left out under LEFT_OUT."""
    if isinstance(obj, list) and len(obj) > MAX_ENTRIES:  # the first format: a bare list of entries
        obj = {"entries": obj[-MAX_ENTRIES:], LEFT_OUT: len(obj) - MAX_ENTRIES}
    elif isinstance(obj, dict) and isinstance(obj.get("entries"), list) and len(obj["entries"]) > MAX_ENTRIES:
        obj[LEFT_OUT] = len(obj["entries"]) - MAX_ENTRIES
        obj["entries"] = obj["entries"][-MAX_ENTRIES:]
    return obj


_WS = lazy(r"[ \t\n\r]*")


def _json_dump(text: str) -> Any:
    """json.loads for a dump, but an array of entries (top level, or under "entries") is decoded one element at a
    time and only its newest MAX_ENTRIES are held: a million `{}` cost what 20,000 do."""
    dec = json.JSONDecoder()
    i = _WS.match(text, 0).end()
    if text.startswith("[", i):
        entries, left_out, i = _json_array(dec, text, i)
        obj: Any = {"entries": entries, LEFT_OUT: left_out} if left_out else entries
    elif text.startswith("{", i):
        obj, i = {}, _WS.match(text, i + 1).end()
        while not text.startswith("}", i):
            key, i = dec.raw_decode(text, i)
            i = _WS.match(text, i).end()
            if not isinstance(key, str) or not text.startswith(":", i):
                raise ValueError(f"expected a key and ':' at character {i}")
            i = _WS.match(text, i + 1).end()
            if key == "entries" and text.startswith("[", i):
                entries, left_out, i = _json_array(dec, text, i)
                obj["entries"] = entries
                if left_out:
                    obj[LEFT_OUT] = left_out
            else:
                obj[key], i = dec.raw_decode(text, i)
            i = _WS.match(text, i).end()
            if text.startswith(",", i):
                i = _WS.match(text, i + 1).end()
                if text.startswith("}", i):
                    raise ValueError(f"trailing comma at character {i}")
            elif not text.startswith("}", i):
                raise ValueError(f"expected ',' or '}}' at character {i}")
        i += 1
    else:
        obj, i = dec.raw_decode(text, i)
    if _WS.match(text, i).end() != len(text):
        raise ValueError(f"extra data at character {i}")
    return obj


def _json_array(dec: json.JSONDecoder, text: str, i: int) -> tuple[list, int, int]:
    """The newest MAX_ENTRIES elements of the JSON array at text[i] ('['), how many older ones were dropped, and
    the index after its ']'."""
    import collections

    kept: collections.deque = collections.deque(maxlen=MAX_ENTRIES)
    seen = 0
    i = _WS.match(text, i + 1).end()
    while not text.startswith("]", i):
        value, i = dec.raw_decode(text, i)
        kept.append(value)
        seen += 1
        i = _WS.match(text, i).end()
        if text.startswith(",", i):
            i = _WS.match(text, i + 1).end()
            if text.startswith("]", i):
                raise ValueError(f"trailing comma at character {i}")
        elif not text.startswith("]", i):
            raise ValueError(f"expected ',' or ']' at character {i}")
    return list(kept), seen - len(kept), i + 1


def _short(e: Exception) -> str:
    return " ".join(str(e).split())[:200]


def _unpacked_size(obj: Any, budget: int) -> int:
    """Objects plus characters in obj, counting every reference again (as a reader would), up to budget+1."""
    size, stack = 0, [obj]
    while stack and size <= budget:
        o = stack.pop()
        size += 1
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif isinstance(o, (str, bytes)):
            size += len(o)
        elif isinstance(o, int) and not -_INT64 <= o < _INT64:
            size += o.bit_length() // 8
    return size


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    """Add one CollectiveRecord per entry, an fr_dump event and fr_pg_status events; gaps for what is unreadable."""
    try:
        _parse(data, src, ev)
    except Exception as e:  # noqa: BLE001 - odd shapes must become a gap, never a traceback
        ev.gap(src.name, f"Flight Recorder dump only partly read: {type(e).__name__}: {e}")


def _parse(data: bytes, src: Source, ev: Evidence) -> None:
    dump, err = load(data)
    if err:
        ev.gap(src.name, f"not a readable Flight Recorder dump: {err}")
        return
    fmt = "pickle" if data[:1] == b"\x80" else "json"
    if isinstance(dump, list) and dump and all(isinstance(e, dict) and "profiling_name" in e for e in dump):
        dump = {"entries": dump}  # the first Flight Recorder format: a bare list of entries
    if not isinstance(dump, dict) or not ({"entries", "pg_config", "pg_status", "version"} & set(dump)):
        ev.gap(src.name, f"not a Flight Recorder dump: top level is a {type(dump).__name__} without its keys")
        return

    rank = _int(dump.get("rank"))
    if rank is None:
        rank = src.rank if src.rank is not None else _rank_from_path(src.name)
    host = src.host or _host(dump.get("hostname") or dump.get("host_name"))
    entries = dump.get("entries") or []
    if not isinstance(entries, list):
        ev.gap(src.name, f"Flight Recorder entries are a {type(entries).__name__}, not a list: skipped")
        entries = []
    backend = _backend(entries, dump)

    records: list[CollectiveRecord] = []
    pg_names: dict[str, str | None] = {}  # pg_id (pg_status's key) -> the group's name:desc
    bad = 0
    for idx, e in enumerate(entries):
        if not isinstance(e, dict):
            bad += 1
            continue
        rec = _record(e, idx, backend, rank, host, src)
        records.append(rec)
        if _int(e.get("pg_id")) is not None:
            pg_names.setdefault(str(_int(e.get("pg_id"))), rec.pg)
    if bad:
        ev.gap(src.name, f"{bad} Flight Recorder entries are not dicts: skipped")
    left_out = _int(dump.get(LEFT_OUT)) if isinstance(dump, dict) else None
    if left_out:
        ev.gap(
            src.name,
            f"{left_out:,} older Flight Recorder entries left out: only the newest {MAX_ENTRIES:,} are read "
            "(Flight Recorder itself keeps TORCH_FR_BUFFER_SIZE, 2,000 by default)",
        )
    ev.collectives.extend(records)

    pg_status = _pg_status(dump.get("pg_status"))
    pg_ranks = _pg_ranks(dump.get("pg_config"))
    default_ranks = pg_ranks.get("0")
    if ev.world_size is None and default_ranks:
        ev.world_size = len(default_ranks)

    per_pg = _per_pg(records)
    main_pg = _main_pg(per_pg)
    main = per_pg.get(main_pg, {})
    fields: dict[str, Any] = {
        "rank": rank,
        "backend": backend,
        "version": _str(dump.get("version")),
        "format": fmt,
        "entries": len(records),
        "pg": main_pg,
        "last_completed_seq": main.get("last_completed_seq"),
        "last_started_seq": main.get("last_started_seq"),
        "pending_seqs": main.get("pending_seqs", []),
        "pgs": per_pg,
    }
    if pg_status:
        fields["pg_status"] = pg_status
    if pg_ranks:
        fields["pg_ranks"] = pg_ranks
    if dump.get("comm_lib_version"):
        fields["comm_lib_version"] = _str(dump.get("comm_lib_version"))
    summary = (
        f"Flight Recorder dump ({fmt}, {backend or 'unknown backend'}, version {fields['version']}): "
        f"rank {rank}, {len(records)} entries, pg {main_pg}: last completed seq {fields['last_completed_seq']}, "
        f"last started seq {fields['last_started_seq']}"
    )
    ev.events.append(
        LogEvent("fr_dump", Quote(src.name, 0, summary), host=host, rank=rank, pid=src.pid, fields=fields)
    )

    for pg_id, st in pg_status.items():
        text = (
            f"pg_status pg_id={pg_id} last_enqueued_collective={st.get('last_enqueued')} "
            f"last_started_collective={st.get('last_started')} last_completed_collective={st.get('last_completed')}"
        )
        ev.events.append(
            LogEvent(
                "fr_pg_status",
                Quote(src.name, 0, text),
                host=host,
                rank=rank,
                pid=src.pid,
                fields={"rank": rank, "pg_id": pg_id, "pg": pg_names.get(pg_id), "backend": backend, **st},
            )
        )


def _record(
    e: dict, idx: int, backend: str | None, rank: int | None, host: str | None, src: Source
) -> CollectiveRecord:
    pname = _str(e.get("profiling_name")) or ""
    own_backend, name = _split_name(pname)
    op = normalize_op(name)
    is_p2p = bool(e.get("is_p2p")) or op in _P2P_OPS
    seq = _int(e.get("p2p_seq_id")) if is_p2p else _int(e.get("collective_seq_id", e.get("seq_id")))
    pg = _pg_label(e)
    state = _state(e, own_backend or backend)
    in_sizes = _sizes(e.get("input_sizes"))
    out_sizes = _sizes(e.get("output_sizes"))
    in_dtypes = _strs(e.get("input_dtypes"))
    out_dtypes = _strs(e.get("output_dtypes"))
    created = _int(e.get("time_created_ns"))
    return CollectiveRecord(
        rank=rank,
        op=op,
        seq=seq,
        pg=pg,
        state=state,
        numel_in=_numel(in_sizes),
        numel_out=_numel(out_sizes),
        dtype=(in_dtypes or out_dtypes or [None])[0],
        sizes=in_sizes,
        host=host,
        time=created / 1e9 if created else None,
        quote=Quote(src.name, idx + 1, render_entry(e)),
        origin="flight_recorder",
    )


def render_entry(e: dict) -> str:
    """One compact line for an entry: `#12 pg=0:default_pg seq=5 nccl:all_reduce state=started in=[[1000]] Float`."""
    pname = _str(e.get("profiling_name")) or "?"
    is_p2p = bool(e.get("is_p2p")) or normalize_op(_split_name(pname)[1]) in _P2P_OPS
    seq = (
        f"p2p_seq={_int(e.get('p2p_seq_id'))}"
        if is_p2p
        else f"seq={_int(e.get('collective_seq_id', e.get('seq_id')))}"
    )
    parts = [
        f"#{_int(e.get('record_id'))}",
        f"pg={_pg_label(e)}",
        seq,
        pname,
        f"state={_str(e.get('state'))}",
    ]
    if e.get("retired"):
        parts.append("retired")
    in_sizes, out_sizes = _sizes(e.get("input_sizes")), _sizes(e.get("output_sizes"))
    parts.append(f"in={_compact(in_sizes)}")
    if out_sizes != in_sizes:
        parts.append(f"out={_compact(out_sizes)}")
    dtypes = _strs(e.get("input_dtypes")) or _strs(e.get("output_dtypes"))
    if dtypes:
        parts.append(",".join(dtypes))
    duration = e.get("duration_ms")
    # An int past float's range (a corrupt dump) cannot be shown as a duration: left out, like a missing one.
    if isinstance(duration, (int, float)) and not isinstance(duration, bool) and abs(duration) < 1e300:
        parts.append(f"dur={duration:.3f}ms")
    return " ".join(parts)


def normalize_op(name: str) -> str:
    """`all_reduce` -> allreduce, `_all_gather_base` -> allgather, `all_reduce_barrier` -> barrier, `send 0->1` -> send."""
    base = name.strip().split(" ", 1)[0].lower().replace("_", "")
    return _OP_ALIASES.get(base, base) or "unknown"


def _split_name(pname: str) -> tuple[str | None, str]:
    backend, sep, rest = pname.partition(":")
    if sep and backend.lower() in _BACKENDS:
        return backend.lower(), rest
    return None, pname


def _backend(entries: list, dump: dict) -> str | None:
    counts: dict[str, int] = {}
    for e in entries:
        if isinstance(e, dict):
            b = _split_name(_str(e.get("profiling_name")) or "")[0]
            if b:
                counts[b] = counts.get(b, 0) + 1
    if counts:
        return max(counts, key=lambda b: counts[b])
    if dump.get("nccl_comm_state") or dump.get("comm_lib_version"):
        return "nccl"  # gloo records no library version; NCCL records its own
    return None


def _state(e: dict, backend: str | None) -> str:
    raw = _str(e.get("state")) or "unknown"
    if raw not in ("scheduled", "started", "completed"):
        return "unknown"
    if raw != "completed" and e.get("retired"):
        # gloo has no events: retired is the only sign its work ended. NCCL retires timed-out work unfinished.
        return "completed" if backend == "gloo" else "timed_out"
    return raw


def _pg_label(e: dict) -> str | None:
    """`name:desc` as torchfrtrace prints a group (e.g. 0:default_pg), or the pg_id when no name is known."""
    pg = e.get("process_group")
    name = desc = None
    if isinstance(pg, (list, tuple)) and pg:
        name = _str(pg[0])
        desc = _str(pg[1]) if len(pg) > 1 else None
    elif isinstance(pg, str):
        name = pg
    if not name:
        pg_id = _int(e.get("pg_id"))
        return None if pg_id is None else str(pg_id)
    return f"{name}:{desc}" if desc and desc != "undefined" else name


def _per_pg(records: list[CollectiveRecord]) -> dict[str, dict[str, Any]]:
    """Per group: entries, highest collective seq completed and issued, and the seqs still pending."""
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        if r.op in _P2P_OPS:
            continue
        d = out.setdefault(
            r.pg or "?",
            {"entries": 0, "last_completed_seq": None, "last_started_seq": None, "pending_seqs": []},
        )
        d["entries"] += 1
        if r.seq is None:
            continue
        d["last_started_seq"] = _max(d["last_started_seq"], r.seq)
        if r.state == "completed":
            d["last_completed_seq"] = _max(d["last_completed_seq"], r.seq)
        elif r.state in ("scheduled", "started", "timed_out"):
            d["pending_seqs"].append(r.seq)
    return out


def _main_pg(per_pg: dict[str, dict[str, Any]]) -> str | None:
    """The default group (named "0") when present, else the group with the most entries."""
    for pg in per_pg:
        if pg == "0" or pg.startswith("0:"):
            return pg
    return max(per_pg, key=lambda pg: per_pg[pg]["entries"]) if per_pg else None


def _pg_status(raw: Any) -> dict[str, dict[str, int | None]]:
    if not isinstance(raw, dict):
        return {}
    out = {}
    for pg_id, st in raw.items():
        if isinstance(st, dict):
            out[str(pg_id)] = {
                "last_enqueued": _int(st.get("last_enqueued_collective")),
                "last_started": _int(st.get("last_started_collective")),
                "last_completed": _int(st.get("last_completed_collective")),
            }
    return out


def _pg_ranks(raw: Any) -> dict[str, list[int]]:
    """pg_config name -> global ranks (the ranks come as a string like "[0, 1, 2, 3]")."""
    if not isinstance(raw, dict):
        return {}
    out = {}
    for name, info in raw.items():
        ranks = info.get("ranks") if isinstance(info, dict) else None
        if isinstance(ranks, str):
            ranks = re.findall(r"-?\d+", ranks)
        if isinstance(ranks, (list, tuple)):
            out[str(name)] = [r for r in (_int(x) for x in ranks) if r is not None]
    return out


def _rank_from_path(name: str) -> int | None:
    rank = rank_from_name(name)
    if rank is not None:
        return rank
    stem = PurePath(name).name
    for ext in _DUMP_EXTENSIONS:
        if stem.lower().endswith(ext):
            stem = stem[: -len(ext)]
    m = _TRAILING_DIGITS.search(stem)  # torchfrtrace's convention: <prefix><rank>
    return int(m.group(1)) if m and stem != m.group(1) else None


def _host(raw: Any) -> str | None:
    if not isinstance(raw, str) or not raw or raw.startswith("host_rank"):
        return None
    raw = raw.split("://", 1)[-1]  # the debug server stores worker URLs
    return raw.split("/", 1)[0].rsplit(":", 1)[0] or None


def _sizes(raw: Any) -> list[list[int]] | None:
    if not isinstance(raw, (list, tuple)):
        return None
    out = []
    for shape in raw:
        if isinstance(shape, (list, tuple)):
            out.append([d for d in (_int(x) for x in shape) if d is not None])
    return out


def _numel(sizes: list[list[int]] | None) -> int | None:
    if sizes is None or any(len(s) > MAX_DIMS for s in sizes):
        return None
    return sum(math.prod(s) for s in sizes)


def _compact(sizes: list[list[int]] | None) -> str:
    return "?" if sizes is None else json.dumps(sizes, separators=(",", ":"))


def _strs(raw: Any) -> list[str]:
    return (
        [x[:MAX_STR] for x in raw[:MAX_DIMS] if isinstance(x, str)] if isinstance(raw, (list, tuple)) else []
    )


def _str(raw: Any) -> str | None:
    """A name or state as text, cut at MAX_STR; None for a container (never its repr: it may be huge)."""
    if isinstance(raw, bytes):
        return raw[:MAX_STR].decode("utf-8", errors="replace")
    if isinstance(raw, str):
        return raw[:MAX_STR]
    if isinstance(raw, float):
        return str(raw)
    if isinstance(raw, int):
        return str(raw) if _int(raw) is not None else None  # str() of a 5000-digit int raises
    return None


def _int(raw: Any) -> int | None:
    """An int64 (what torch records), or None: out-of-range numbers are corrupt, not counts to multiply."""
    if isinstance(raw, bool):
        return int(raw)
    value = None
    if isinstance(raw, int):
        value = raw
    elif isinstance(raw, float) and raw.is_integer():
        value = int(raw)
    elif isinstance(raw, (str, bytes)) and len(raw) <= 20:
        try:
            value = int(raw)
        except ValueError:
            return None
    return value if value is not None and -_INT64 <= value < _INT64 else None


def _max(a: int | None, b: int) -> int:
    return b if a is None else max(a, b)
