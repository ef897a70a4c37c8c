"""Entry point of the `hangdx` console script; the command line itself lives in bot/."""

from hangdx.bot.cli import main

__all__ = ["main"]
