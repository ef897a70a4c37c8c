"""The signal catalogue: every row's examples match it, fill its fields, and reach it through the whole matcher."""

from __future__ import annotations

import re

import pytest

from hangdx.probes import catalogue, signals
from hangdx.probes.model import Evidence, Source
from hangdx.probes.reader import clean, read_any, readable

CAT = catalogue.load()
PY = catalogue.load("python")
ROWS = CAT.rows


def test_catalogue_loads_and_has_rows():
    assert ROWS, "no rows shipped in probes/catalogue/*.yaml"
    assert len({r.id for r in ROWS}) == len(ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_row_examples(row):
    for line in row.examples:
        fields = row.extract(line)
        assert fields is not None, f"{row.id} does not match its example {line!r}"
        assert set(row.fields) <= set(fields), f"{row.id} leaves {set(row.fields) - set(fields)} empty"
        for name in set(row.fields) & catalogue.INT_FIELDS:
            assert isinstance(fields[name], int) or not str(fields[name]).lstrip("-").isdigit()
        # The whole matcher (every row at once) reports this row for this line, on both paths.
        for cat in (CAT, PY):
            assert row.id in [r.id for r, _ in cat.match_line(line)], f"{cat.engine} misses {row.id}"
        # And wherever the line sits: behind a prefix, in a batch of other lines.
        shifted = "node-3: [rank7]: ... " + line
        assert row.id in [r.id for r, _ in CAT.match_line(shifted)]
        batch = ["unrelated line", line, "another one"]
        assert (1, row.id) in [(n, r.id) for n, r, _ in CAT.match_lines(batch)]
        assert (1, row.id) in [(n, r.id) for n, r, _ in PY.match_lines(batch)]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_row_examples_survive_the_reader(row):
    """What `hangdx analyze` does to a line before the catalogue sees it (prefixes taken off as hosts or ranks,
    markdown undone) leaves each example matching its row, and a text of that one line is never refused."""
    import io

    for line in row.examples:
        lines = clean([(1, line.encode())])
        hit = [h.row.id for h in signals.find(CAT, lines)]
        assert any(row.extract(ln.text) is not None for ln in lines) or row.id in hit, (
            f"{row.id}: the reader makes {[ln.text for ln in lines]!r} of {line!r}, which the row no longer matches"
        )
        ev = Evidence()
        read_any(io.BytesIO(line.encode() + b"\n"), Source("example.log"), ev)
        assert readable(ev), f"{row.id}: a text of its example {line!r} is refused as unreadable"


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_row_schema(row):
    assert row.category in catalogue.CATEGORIES or (row.category is None and row.strength == "context")
    assert row.strength in catalogue.STRENGTHS
    assert list(re.compile(row.pattern).groupindex) == list(row.fields)
    assert catalogue.literal_run(row.pattern) >= catalogue.MIN_LITERAL
    assert len(row.source.split()) >= 2 and "/" in row.source.split()[0]
    assert catalogue.hyperscan_compiles(row) is None


def test_bad_row_is_a_load_error_naming_file_and_id():
    bad = "- id: x.y.z\n  emitter: E\n  source: a/b c.cc\n  pattern: 'short'\n  fields: [rank]\n  event: e\n"
    bad += "  category: nonsense\n  strength: decisive\n  meaning: m\n  examples: ['short']\n"
    with pytest.raises(catalogue.CatalogueError) as err:
        catalogue.load_rows([("mine.yaml", bad)])
    text = str(err.value)
    assert "mine.yaml:x.y.z" in text and "category" in text and "fields" in text


def test_duplicate_id_across_files_is_refused():
    row = ROWS[0]
    import yaml

    raw = {
        k: getattr(row, k) for k in ("id", "emitter", "source", "pattern", "event", "category", "strength")
    }
    raw.update(fields=list(row.fields), meaning=row.meaning, examples=list(row.examples))
    text = yaml.safe_dump([raw])
    with pytest.raises(catalogue.CatalogueError, match="id also in"):
        catalogue.load_rows([("a.yaml", text), ("b.yaml", text)])


def test_raw_bytes_scan_finds_the_lines_to_keep():
    lines = [b"x" * 40] * 50 + [row.examples[0].encode() for row in ROWS] + [b"y" * 40] * 50
    buf = b"\n".join(lines) + b"\n"
    starts = {buf.count(b"\n", 0, s) for s in CAT.line_starts(buf, 0, len(buf))}
    for n in range(50, 50 + len(ROWS)):
        assert n in starts
    pstarts = {buf.count(b"\n", 0, s) for s in PY.line_starts(buf, 0, len(buf))}
    assert starts <= pstarts | starts and set(range(50, 50 + len(ROWS))) <= pstarts


@pytest.mark.parametrize(
    ("pattern", "want"),
    [
        (r"\bState: (?P<state>Down|Initializing|Armed)\b", ["State: Armed", "State: Down", "State: Initializing"]),
        (r"(?P<error>No IB devices found|Failed to get IB devices list)", ["Failed to get IB devices list", "No IB devices found"]),
        (r"(?:[:,] GPU is lost|GPU is lost\.\s{0,3}Reboot)", [", GPU is lost", ": GPU is lost", "GPU is lost."]),
        (r"Watchdog caught collective operation timeout: (?P<work>\w+)", ["Watchdog caught collective operation timeout: "]),
        (r"\[(?P<bit>[ \d]{2})\] (?P<error>RxErr|BadTLP|DLP)", []),  # `DLP` is too short to look for
        (r"(?:abc|defghijkl) opCount (?P<n>\d+)", ["abc opCount ", "defghijkl opCount "]),
    ],
)  # fmt: skip
def test_needles_are_strings_every_match_holds_one_of(pattern, want):
    assert catalogue.needles(pattern) == want


def test_every_row_but_a_few_has_needles_and_each_example_holds_one():
    """Rows without needles are tried by `re` on every kept line: they must stay rare, and a needle set that
    misses a row's own example would lose that row's lines on the Hyperscan path."""
    always = []
    for row in catalogue.load().rows:
        found = catalogue.needles(row.pattern)
        if not found:
            always.append(row.id)
            continue
        for line in row.examples:
            assert any(n.lower() in line.lower() for n in found), (row.id, found, line)
    assert len(always) <= 5, always
