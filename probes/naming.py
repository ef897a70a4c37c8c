"""Host and rank from a file's path, when the content does not say."""

from __future__ import annotations

import re
from pathlib import PurePath

from hangdx.probes.rx import lazy

_RANK = lazy(r"(?:^|[^a-z])(?:rank|default|r)[-_.]?(\d{1,6})(?![0-9])", re.I)
_HOSTISH = lazy(r"^[a-z][a-z0-9-]*\d[a-z0-9-]*$", re.I)


# Slurm's `--output=%j-%t.out` (job id, then task id = global rank): `12345-7.out`.
_SLURM_TASK = lazy(r"^\d{1,12}-(\d{1,6})\.(?:out|err|log)$")
# torchrun's `--log-dir`: `<run id>/attempt_<n>/<local rank>/{stdout.log,stderr.log,error.json}`.
_TORCHRUN_DIR = lazy(r"(?:^|/)attempt_\d{1,4}/(\d{1,5})/(?:stdout\.log|stderr\.log|error\.json)$")


def rank_from_name(path: str) -> int | None:
    """`rank3.txt`, `stacks_rank_12.log`, `nccl.r7.log`, Slurm's `12345-7.out` -> the rank number."""
    name = PurePath(path).name
    m = _RANK.search(name) or _SLURM_TASK.match(name)
    return int(m.group(1)) if m else None


def local_rank_from_path(path: str) -> int | None:
    """torchrun's `--log-dir` layout names the local rank (`.../attempt_0/3/stderr.log` -> 3), not the global one."""
    m = _TORCHRUN_DIR.search(PurePath(path).as_posix())
    return int(m.group(1)) if m else None


def host_from_path(path: str) -> str | None:
    """A host name from a bundle-like path: `gpu-node-03/dmesg.txt` -> gpu-node-03."""
    parts = PurePath(path).parts[:-1]
    for part in reversed(parts):
        if _HOSTISH.match(part) and not _RANK.fullmatch(part) and not part.lower().startswith("rank"):
            return part
    return None
