"""Job resolvers: a job id becomes the hosts to probe (given hosts, an inventory file, Slurm, this machine).

`HANGDX_RESOLVER` (and `resolve(job_id, how)`) spells the choice as `local`, `slurm`, `inventory:PATH`
or `hosts:H1,H2`.

Host lists (`--hosts`, inventory jobs) take Slurm-style ranges: `gpu-node-[01-04,07],login1` is
gpu-node-01..04, gpu-node-07 and login1 (zero padding follows the lower bound; several bracket groups
multiply out). `[fe80::1]:22` stays an IPv6 address.

Inventory file (YAML, read with yaml.safe_load; every section but `jobs` optional; unknown keys are errors):

    ssh:                          # defaults for every host
      user: hangdx
      key_file: ~/.ssh/hangdx_ed25519   # ~ expands; relative paths are relative to the inventory file
      known_hosts: ~/.ssh/known_hosts
      jump: admin@bastion.example.com:22  # optional bastion, [user@]host[:port]
      port: 22
      connect_timeout: 10         # also command_timeout, deadline (seconds), concurrency, use_agent
    hosts:                        # per-host settings: address, port, user, key_file, jump (null: no jump)
      gpu-node-03: {address: 10.1.2.3, port: 2222, user: root}
      bastion.example.com: {jump: null}
    jobs:                         # job id -> its hosts: a list, a host-range string, or both mixed
      "12345": {hosts: [gpu-node-01, gpu-node-02, gpu-node-03]}
      train-llama: {hosts: "gpu-node-[01-04]"}
      "777": [gpu-node-05, gpu-node-06]   # shorthand for {hosts: [...]}

Each HostSpec comes back complete (per-host values over the ssh defaults: address, port, user, key_file,
jump). `from_inventory` also returns the `ssh:` defaults that are SshSettings fields (known_hosts, key_file,
user, use_agent, connect_timeout, command_timeout, deadline, concurrency) as a dict, so
`dataclasses.replace(settings, **overrides)` applies them.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
import shutil
import socket
import subprocess

import yaml

from hangdx.probes.hosts import HostError, HostSpec, parse_host, parse_host_list
from hangdx.probes.rx import lazy

MAX_HOSTS = 65536  # one job's hosts; a range like n[0-99999999] is a typo, not a cluster
MAX_INVENTORY_BYTES = 8 << 20

# 123, 123_4 (array task), 123+1 (het job component): nothing else reaches scontrol.
_JOB_ID = lazy(r"\d{1,20}(?:_\d{1,10}|\+\d{1,5})?")
_RANGE_GROUP = lazy(r"\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*")
# Never a leading dash: a node list or name reaches scontrol and ssh as an argument, where it would be an option.
_NODELIST = lazy(r"[A-Za-z0-9._\[\]][A-Za-z0-9._,\[\]-]{0,65535}")
_NAME = lazy(r"[A-Za-z0-9._][A-Za-z0-9._-]{0,252}")
_USER = lazy(r"[A-Za-z0-9._-]{1,64}")
# States whose processes may still be on the nodes: a job stuck COMPLETING often has ranks that won't die.
LIVE_STATES = {"RUNNING", "COMPLETING"}


class ResolveError(Exception):
    """A job id that cannot be resolved (unknown job, not running, no inventory entry): one-line message."""


# ---------------------------------------------------------------- host ranges


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets: `n[1-2,5],m` -> [`n[1-2,5]`, `m`]."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostError(f"{text!r}: nested brackets in a host list")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostError(f"{text!r}: ']' without '[' in a host list")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise HostError(f"{text!r}: '[' without ']' in a host list")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_group(body: str, whole: str) -> list[str]:
    out: list[str] = []
    for part in body.split(","):
        lo, _, hi = part.partition("-")
        hi = hi or lo
        if int(hi) < int(lo):
            raise HostError(f"{whole!r}: range {part} runs backwards")
        if int(hi) - int(lo) >= MAX_HOSTS:
            raise HostError(f"{whole!r}: range {part} names more than {MAX_HOSTS} hosts")
        # Slurm pads to the width of the lower bound: [01-10] -> 01..10, [1-10] -> 1..10.
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def expand_hostlist(text: str) -> list[str]:
    """`gpu-node-[01-03],login1` -> gpu-node-01, gpu-node-02, gpu-node-03, login1 (order kept, no dups)."""
    names: list[str] = []
    for item in _split_top(text):
        pieces = re.split(r"(\[[^\]]*\])", item)
        choices: list[list[str]] = []
        for piece in pieces:
            body = piece[1:-1] if piece.startswith("[") else None
            if body is not None and _RANGE_GROUP.fullmatch(body):
                choices.append(_expand_group(body, item))
            else:
                choices.append([piece])  # plain text, or an IPv6 literal like [fe80::1]
        total = 1
        for c in choices:
            total *= len(c)
        if total + len(names) > MAX_HOSTS:
            raise HostError(f"{text!r} names more than {MAX_HOSTS} hosts")
        names.extend("".join(combo) for combo in itertools.product(*choices))
    return list(dict.fromkeys(names))


def from_hosts(text: str) -> list[HostSpec]:
    """--hosts a,b,user@c:2222 (ranges like gpu-[01-04] allowed) -> HostSpecs; HostError otherwise."""
    return parse_host_list(",".join(expand_hostlist(text)))


# ---------------------------------------------------------------- inventory

_SSH_KEYS = {
    "user",
    "key_file",
    "known_hosts",
    "jump",
    "port",
    "use_agent",
    "connect_timeout",
    "command_timeout",
    "deadline",
    "concurrency",
}
_HOST_KEYS = {"address", "port", "user", "key_file", "jump"}
_SETTINGS_KEYS = _SSH_KEYS - {"jump", "port"}  # the ones SshSettings has


def _type_name(value: object) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", type(None): "empty"}.get(
        type(value), type(value).__name__
    )


def _check_keys(where: str, value: object, allowed: set[str]) -> dict:
    if not isinstance(value, dict):
        raise HostError(f"{where} must be a mapping, not {_type_name(value)}")
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise HostError(f"{where}: unknown key {unknown[0]!r} (expected one of {', '.join(sorted(allowed))})")
    return value


def _name(where: str, value: object) -> str:
    """A bare host name or IP address: no user@, no :port, nothing a shell reads specially."""
    if isinstance(value, str) and _NAME.fullmatch(value):
        return value
    if isinstance(value, str):
        try:
            return str(ipaddress.ip_address(value.strip("[]")))
        except ValueError:
            pass
    raise HostError(f"{where}: {value!r} is not a host name")


def _port(where: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise HostError(f"{where}: port must be a number from 1 to 65535, not {value!r}")
    return value


def _user(where: str, value: object) -> str:
    if not isinstance(value, str) or not _USER.fullmatch(value):
        raise HostError(f"{where}: {value!r} is not a user name")
    return value


def _path(where: str, value: object, base: str) -> str:
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise HostError(f"{where}: expected a file path, not {value!r}")
    path = os.path.expanduser(value.strip())
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(base, path))


def _jump(where: str, value: object) -> HostSpec:
    if not isinstance(value, str):
        raise HostError(f"{where}: jump must be a string [user@]host[:port], not {_type_name(value)}")
    try:
        return parse_host(value)
    except HostError as e:
        raise HostError(f"{where}: {e}") from None


def _ssh_section(where: str, raw: object, base: str) -> tuple[dict, dict]:
    """(host defaults for HostSpec, overrides for SshSettings)."""
    sec = _check_keys(where, raw, _SSH_KEYS)
    defaults: dict = {}
    settings: dict = {}
    for key, value in sec.items():
        w = f"{where}.{key}"
        if key == "user":
            defaults[key] = settings[key] = _user(w, value)
        elif key == "key_file":
            defaults[key] = settings[key] = _path(w, value, base)
        elif key == "known_hosts":
            settings[key] = _path(w, value, base)
        elif key == "jump":
            defaults[key] = None if value is None else _jump(w, value)
        elif key == "port":
            defaults[key] = _port(w, value)
        elif key == "use_agent":
            if not isinstance(value, bool):
                raise HostError(f"{w} must be true or false, not {value!r}")
            settings[key] = value
        elif key == "concurrency":
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 4096:
                raise HostError(f"{w} must be a whole number from 1 to 4096, not {value!r}")
            settings[key] = value
        else:  # the timeouts
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86400:
                raise HostError(f"{w} must be a number of seconds above 0, not {value!r}")
            settings[key] = float(value)
    return defaults, settings


def _host_entry(where: str, raw: object, base: str) -> dict:
    if raw is None:
        return {}
    sec = _check_keys(where, raw, _HOST_KEYS)
    entry: dict = {}
    for key, value in sec.items():
        w = f"{where}.{key}"
        if key == "jump":
            entry[key] = None if value is None else _jump(w, value)
        elif value is None:
            continue  # `user: null` means "not set here"
        elif key == "address":
            entry[key] = _name(w, value)
        elif key == "port":
            entry[key] = _port(w, value)
        elif key == "user":
            entry[key] = _user(w, value)
        else:
            entry[key] = _path(w, value, base)
    return entry


def _job_hosts(where: str, raw: object) -> list[str]:
    if isinstance(raw, dict):
        raw = _check_keys(where, raw, {"hosts"}).get("hosts")
        where += ".hosts"
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items:
        raise HostError(f"{where} must be a host list or a host-range string, not {_type_name(raw)}")
    names: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise HostError(f"{where}: {item!r} is not a host name")
        try:
            expanded = expand_hostlist(item)
        except HostError as e:
            raise HostError(f"{where}: {e}") from None
        names.extend(_name(where, n) for n in expanded)
    names = list(dict.fromkeys(names))
    if not names:
        raise HostError(f"{where} names no host")
    return names


def _load_yaml(path: str) -> object:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_INVENTORY_BYTES + 1)
    except OSError as e:
        raise HostError(f"inventory {path}: cannot read it ({e.strerror or e})") from None
    if len(raw) > MAX_INVENTORY_BYTES:
        raise HostError(f"inventory {path}: larger than {MAX_INVENTORY_BYTES >> 20} MB; not an inventory")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise HostError(f"inventory {path}: not UTF-8 text") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise HostError(f"inventory {path}: not valid YAML{at}: {problem}") from None


def from_inventory(path: str, job_id: str | None) -> tuple[list[HostSpec], dict]:
    """A YAML inventory -> the hosts of job `job_id` (None: of every job) and the file's SshSettings overrides."""
    doc = _load_yaml(path)
    where = f"inventory {path}"
    if doc is None:
        raise HostError(f"{where}: the file is empty")
    doc = _check_keys(where, doc, {"ssh", "hosts", "jobs"})
    base = os.path.dirname(os.path.abspath(path))
    defaults, settings = _ssh_section(f"{where}: ssh", doc.get("ssh") or {}, base)

    host_sec = doc.get("hosts") or {}
    if not isinstance(host_sec, dict):
        raise HostError(f"{where}: hosts must be a mapping, not {_type_name(host_sec)}")
    entries: dict[str, dict] = {}
    for key, raw in host_sec.items():
        name = _name(f"{where}: hosts", key)
        entries[name] = _host_entry(f"{where}: hosts.{name}", raw, base)

    jobs = doc.get("jobs")
    if not isinstance(jobs, dict) or not jobs:
        raise HostError(f"{where}: needs a jobs: mapping of job id -> hosts")
    by_id: dict[str, object] = {}
    for key, raw in jobs.items():
        # YAML reads `12345:` as a number; a job id is text either way.
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise HostError(f"{where}: jobs: {key!r} is not a job id")
        by_id[str(key)] = raw
    if job_id is None:  # every node of every job (`hangdx doctor --inventory`)
        names = [n for key, raw in by_id.items() for n in _job_hosts(f"{where}: jobs.{key}", raw)]
        names = list(dict.fromkeys(names))
    elif str(job_id) not in by_id:
        known = sorted(by_id)
        listed = ", ".join(known[:20]) + (f" and {len(known) - 20} more" if len(known) > 20 else "")
        raise ResolveError(f"{where} has no job {job_id!r} (it knows: {listed})")
    else:
        names = _job_hosts(f"{where}: jobs.{job_id}", by_id[str(job_id)])

    hosts = []
    for name in names:
        spec = {**defaults, **entries.get(name, {})}
        hosts.append(
            HostSpec(
                name=name,
                address=spec.get("address"),
                port=spec.get("port", 22),
                user=spec.get("user"),
                key_file=spec.get("key_file"),
                jump=spec.get("jump"),
            )
        )
    return hosts, {k: v for k, v in settings.items() if k in _SETTINGS_KEYS}


# ---------------------------------------------------------------- Slurm


def check_job_id(job_id: str) -> str:
    """A Slurm job id (123, 123_4, 123+1) or ResolveError: only these ever reach scontrol."""
    if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id):
        raise ResolveError(f"{job_id!r} is not a Slurm job id (expected digits, 123_4 or 123+1)")
    return job_id


def _scontrol(scontrol: str, args: list[str], timeout: float) -> str:
    exe = shutil.which(scontrol)
    if exe is None:
        raise ResolveError(f"{scontrol} not found: run hangdx where Slurm's client commands are installed")
    try:
        out = subprocess.run(
            [exe, *args], capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False
        )
    except subprocess.TimeoutExpired:
        raise ResolveError(f"{scontrol} {' '.join(args)} did not answer within {timeout:g}s") from None
    except OSError as e:
        raise ResolveError(f"{scontrol} could not run: {e}") from None
    if out.returncode != 0:
        err = out.stderr.decode("utf-8", "replace").strip().splitlines()
        first = next((line.strip() for line in err if line.strip()), f"exit status {out.returncode}")
        raise ResolveError(f"{scontrol} {' '.join(args)} failed: {first}")
    return out.stdout.decode("utf-8", "replace")


def _field(record: str, key: str) -> str | None:
    m = re.search(rf"(?:^|\s){key}=(\S*)", record)
    return m.group(1) if m else None


def from_slurm(job_id: str, scontrol: str = "scontrol", timeout: float = 10) -> list[HostSpec]:
    """The nodes of running Slurm job `job_id` (scontrol show job, then scontrol show hostnames)."""
    check_job_id(job_id)
    try:
        text = _scontrol(scontrol, ["--oneliner", "show", "job", job_id], timeout)
    except ResolveError as e:
        if "Invalid job id" in str(e):
            raise ResolveError(f"Slurm knows no job {job_id}") from None
        raise
    # One line per job record: an array job or a het job has several.
    records = [line for line in text.splitlines() if _field(line, "JobId")]
    if not records:
        raise ResolveError(f"Slurm knows no job {job_id}")
    nodelists, states = [], []
    for rec in records:
        state = (_field(rec, "JobState") or "UNKNOWN").split("+")[0]
        states.append(state)
        nodes = _field(rec, "NodeList")
        if state in LIVE_STATES and nodes and nodes != "(null)":
            nodelists.append(nodes)
    if not nodelists:
        shown = "/".join(dict.fromkeys(states))
        raise ResolveError(f"job {job_id} is {shown}, not running")
    names: list[str] = []
    for nodes in nodelists:
        if not _NODELIST.fullmatch(nodes):
            raise ResolveError(f"Slurm gave job {job_id} a node list hangdx cannot read: {nodes[:200]!r}")
        out = _scontrol(scontrol, ["show", "hostnames", nodes], timeout)
        names.extend(line.strip() for line in out.splitlines() if line.strip())
    hosts = []
    for name in dict.fromkeys(names):
        if not _NAME.fullmatch(name):
            raise ResolveError(f"Slurm named a node of job {job_id} {name!r}: not a host name")
        hosts.append(HostSpec(name=name))
    if not hosts:
        raise ResolveError(f"Slurm lists no nodes for job {job_id}")
    return hosts


# ---------------------------------------------------------------- choice


def resolve(job_id: str, how: str, **kw) -> list[HostSpec]:
    """Hosts of `job_id` by HANGDX_RESOLVER syntax: local | slurm | inventory:PATH | hosts:H1,H2."""
    how = (how or "").strip()
    if how == "local":
        return [HostSpec(name=socket.gethostname())]
    if how == "slurm":
        return from_slurm(job_id, **kw)
    if how.startswith("inventory:") and how[len("inventory:") :].strip():
        return from_inventory(how[len("inventory:") :].strip(), job_id)[0]
    if how.startswith("hosts:"):
        return from_hosts(how[len("hosts:") :])
    raise ResolveError(f"resolver {how!r} is not one of: local, slurm, inventory:PATH, hosts:H1,H2")


def resolve_with_settings(job_id: str | None, how: str) -> tuple[list[HostSpec], dict]:
    """Like resolve(), plus the SSH settings an inventory carries (known_hosts, key, user, timeouts).

    job_id None (`hangdx doctor`): every host of an inventory's jobs; --hosts ignore the job id anyway."""
    if how.startswith("inventory:"):
        return from_inventory(how.split(":", 1)[1], job_id)
    return resolve(job_id, how), {}
