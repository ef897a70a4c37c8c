"""Sets of ranks, hosts and GPUs as a person writes them: `0-776 and 778-1023 (1,023 ranks)`, `1, 3 and 7`."""

from __future__ import annotations

from collections.abc import Iterable


def _runs(numbers: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], n)
        else:
            runs.append((n, n))
    return runs


def _join(parts: list[str]) -> str:
    if len(parts) <= 1:
        return "".join(parts)
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def number_set(values: Iterable[int], noun: str = "ranks", most: int = 8) -> str:
    """Numbers joined as a person writes them; consecutive runs of three or more become ranges.

    Past `most` pieces the rest is counted, not listed, so a summary stays short at any scale.
    """
    nums = sorted(set(values))
    if not nums:
        return ""
    pieces = [f"{a}-{b}" if b - a >= 2 else (f"{a}, {b}" if b > a else str(a)) for a, b in _runs(nums)]
    flat: list[str] = []
    for p in pieces:
        flat.extend(p.split(", "))
    shown = flat[:most]
    text = _join(shown) if len(flat) <= most else ", ".join(shown) + f" and {len(flat) - most} more"
    if any("-" in p for p in shown) or len(flat) > most:
        text += f" ({len(nums):,} {noun})"
    return text


def name_set(values: Iterable[str], most: int = 6) -> str:
    """Names (hosts, GPUs) joined; past `most` the rest is counted."""
    names = list(dict.fromkeys(values))
    if len(names) <= most:
        return _join(names)
    return ", ".join(names[:most]) + f" and {len(names) - most:,} more"
