"""Regular expressions compiled at their first use.

hangdx's readers and playbooks hold about 400 module-level patterns, and one text uses few of them: compiling
them all when the modules are imported cost about 0.03 s of every `hangdx analyze` (a tenth of its fixed
start-up). `lazy(pattern, flags)` stands where `re.compile(pattern, flags)` stood: the pattern is compiled the
first time one of its methods is asked for, and the compiled pattern's bound methods are then kept in the
object's slots, so that later calls cost what a compiled pattern's own do."""

from __future__ import annotations

import re
from typing import Any

_METHODS = ("search", "match", "fullmatch", "finditer", "findall", "sub", "subn", "split", "scanner")
_ATTRS = ("flags", "groups", "groupindex")


class LazyPattern:
    """A `re.Pattern` compiled when first used; `.pattern` is there at once (read, never compiled)."""

    __slots__ = ("pattern", "_flags", "_compiled", *_METHODS, *_ATTRS)

    def __init__(self, pattern: str | bytes, flags: int = 0) -> None:
        self.pattern = pattern
        self._flags = flags
        self._compiled: re.Pattern | None = None

    def compiled(self) -> re.Pattern:
        """The compiled pattern (compiled now, should it not be yet)."""
        if self._compiled is None:
            p = re.compile(self.pattern, self._flags)
            for name in _METHODS + _ATTRS:
                setattr(self, name, getattr(p, name))
            self._compiled = p
        return self._compiled

    def __getattr__(self, name: str) -> Any:
        # Only reached for a slot not filled yet (or a name a Pattern has and these slots do not).
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.compiled(), name)

    def __repr__(self) -> str:
        return f"lazy({self.pattern!r})"


def lazy(pattern: str | bytes, flags: int = 0) -> Any:
    """`re.compile(pattern, flags)`, compiled at the first use (typed Any: it answers as a Pattern does)."""
    return LazyPattern(pattern, flags)
