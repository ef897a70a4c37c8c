"""The `hangdx` command line."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    print("hangdx: not yet")
    return 0
