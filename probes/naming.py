"""Host and rank from a file's path, when the content does not say."""

from __future__ import annotations

import re
from pathlib import PurePath

_RANK = re.compile(r"(?:^|[^a-z])(?:rank|default|r)[-_.]?(\d{1,6})(?![0-9])", re.I)
_HOSTISH = re.compile(r"^[a-z][a-z0-9-]*\d[a-z0-9-]*$", re.I)


def rank_from_name(path: str) -> int | None:
    """`rank3.txt`, `stacks_rank_12.log`, `nccl.r7.log` -> the rank number."""
    name = PurePath(path).name
    m = _RANK.search(name)
    return int(m.group(1)) if m else None


def host_from_path(path: str) -> str | None:
    """A host name from a bundle-like path: `gpu-node-03/dmesg.txt` -> gpu-node-03."""
    parts = PurePath(path).parts[:-1]
    for part in reversed(parts):
        if _HOSTISH.match(part) and not _RANK.fullmatch(part) and not part.lower().startswith("rank"):
            return part
    return None
