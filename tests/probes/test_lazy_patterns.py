"""Every module-level pattern hangdx compiles at its first use (probes/rx.py) is a valid regular expression.

A pattern compiled lazily would otherwise fail only when a text first needs it, perhaps at 3 AM: here every
module of the readers, playbooks and bot is imported and each of its lazy patterns compiled and tried once."""

import importlib
import pkgutil
import re

import pytest

import hangdx.bot
import hangdx.playbooks
import hangdx.probes
from hangdx.probes.rx import LazyPattern, lazy


def _modules() -> list[str]:
    out = []
    for pkg in (hangdx.probes, hangdx.playbooks, hangdx.bot):
        for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            out.append(m.name)
    return sorted(out)


def _lazy_patterns() -> list[tuple[str, str, LazyPattern]]:
    found = []
    for name in _modules():
        try:
            mod = importlib.import_module(name)
        except ImportError:  # an optional dependency (slack_bolt, paramiko) absent: nothing of it to check
            continue
        for attr, value in vars(mod).items():
            if isinstance(value, LazyPattern):
                found.append((name, attr, value))
    return found


PATTERNS = _lazy_patterns()


def test_the_readers_patterns_are_lazy():
    # The point of probes/rx.py: the big parsers' patterns are not compiled at import.
    mods = {m for m, _, _ in PATTERNS}
    assert {"hangdx.probes.torch_log", "hangdx.probes.nccl_log", "hangdx.probes.kernel_log"} <= mods
    assert len(PATTERNS) > 300


@pytest.mark.parametrize("mod,attr,pat", PATTERNS, ids=[f"{m}.{a}" for m, a, _ in PATTERNS])
def test_each_lazy_pattern_compiles(mod, attr, pat):
    compiled = pat.compiled()
    assert isinstance(compiled, re.Pattern)
    assert compiled.pattern == pat.pattern
    empty = b"" if isinstance(pat.pattern, bytes) else ""
    pat.search(empty)  # the bound method, now in its slot, runs


def test_a_lazy_pattern_answers_as_the_compiled_one():
    p = lazy(r"rank (?P<rank>\d+)", re.I)
    assert p.pattern == r"rank (?P<rank>\d+)"
    assert p.search("RANK 7").group("rank") == "7"
    assert p.sub("x", "rank 1 and Rank 2") == "x and x"
    assert [m.group(1) for m in p.finditer("rank 3 rank 4")] == ["3", "4"]
    assert p.groupindex["rank"] == 1 and p.flags & re.I
    assert p.fullmatch("rank 5") and not p.match("a rank 5")


def test_a_bad_lazy_pattern_fails_when_compiled():
    p = lazy(r"(unclosed")
    with pytest.raises(re.error):
        p.search("x")
