"""The claimers' needles (CLAIM_WORDS, CLAIM_PATTERNS): the reader asks a claimer about a line only when one of its
needles is in it, so every line a claimer claims must hold one. Checked on every line of every fixture (as read and
as the normaliser cleans it, and cut, indented, upper- and lower-cased), against claims() itself."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hangdx.probes import reader
from hangdx.probes.normalise import Normaliser

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"

pytest.importorskip("hyperscan")


def _lines() -> list[str]:
    found: set[str] = set()
    for p in sorted(FIXTURES.rglob("*")):
        if "sealed" in p.parts or not p.is_file():
            continue
        found.update(p.read_bytes()[:2_000_000].decode("utf-8", "replace").splitlines())
    norm = Normaliser()
    for i, ln in enumerate(sorted(found)):
        found.update(c.text for c in norm.line(i, ln))
    rnd = random.Random(7)
    for ln in rnd.sample(sorted(found), min(5000, len(found))):
        k = rnd.randint(0, len(ln))
        found.update((ln[:k], ln[k:], "  " + ln, ln.upper(), ln.lower()))
    return sorted(ln for ln in found if ln.strip())


def test_every_claimed_line_holds_a_needle_of_its_claimer():
    mods = reader._claimers()
    needles = reader._ClaimNeedles.of(mods)
    assert needles.db is not None
    assert len(needles.with_needles) >= 20  # most claimers have needles
    wrong = []
    for ln in _lines():
        skip = needles.skip(ln)
        for i in skip:
            try:
                score = int(mods[i].claims(ln))
            except Exception:  # noqa: BLE001 - a claim that raises is no claim (reader.kind_of)
                score = 0
            if score >= reader.REGION_CLAIM:
                wrong.append((mods[i].KIND, ln[:200]))
    assert not wrong, wrong[:10]


def test_a_line_gets_the_same_kind_with_and_without_needles():
    mods = reader._claimers()
    needles = reader._ClaimNeedles.of(mods)
    lines = _lines()
    assert [reader.kind_of(ln, mods, needles.skip(ln)) for ln in lines] == [
        reader.kind_of(ln, mods) for ln in lines
    ]
