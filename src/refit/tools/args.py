"""The command line's argument types and shared flags: numbers typed and bounded at parsing (argparse names the
flag in the error), a ``ConfigError`` raised about one flag prefixed with it, ``TransferConfig`` fields set from
flags (each validated by ``TransferConfig``), and the cap on a layout's ranks (``--max-world``)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from refit.config import TransferConfig
from refit.errors import ConfigError, SpecError


@contextmanager
def about_flag(flag: str) -> Iterator[None]:
    """A ``ConfigError`` raised inside is about ``flag``: its message is prefixed with the flag."""
    try:
        yield
    except ConfigError as e:
        raise type(e)(f"{flag}: {e}") from None


def number(text: str, kind: type, least: float, above: bool = False) -> float:
    """``text`` as a finite ``kind`` >= ``least`` (> with ``above``); argparse names the flag in the error."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value < least or (above and value == least):
        what = "an integer" if kind is int else "a finite number"
        raise argparse.ArgumentTypeError(f"must be {what} {'>' if above else '>='} {least:g}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (counts, sizes, degrees)."""
    return number(text, int, 1)


def natural_int(text: str) -> int:
    """argparse type: an integer >= 0 (warm-up rounds, seeds)."""
    return number(text, int, 0)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (MiB, GB/s, seconds); nan and infinity are refused."""
    return number(text, float, 0, above=True)


def fraction(text: str) -> float:
    """argparse type: a finite number within [0, 1] (a changed fraction)."""
    value = number(text, float, 0)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a fraction within [0, 1], got {text!r}")
    return value


class CliParser(argparse.ArgumentParser):
    """An argument parser whose errors are the CLI's one line: ``ConfigError``, not usage text and exit."""

    def error(self, message: str):
        raise ConfigError(f"{message.removeprefix('argument ')} (see {self.prog} --help)")


def transfer_config(base: TransferConfig | None = None, **flags: tuple[str, object, object]) -> TransferConfig:
    """``base`` (default ``TransferConfig()``) with fields set from flags: ``field=(flag, as given, value)``.

    ``TransferConfig`` validates each value; its error is reported as the flag's, with the value as given."""
    base = base or TransferConfig()
    for field, (flag, given, value) in flags.items():
        try:
            replace(base, **{field: value})
        except ConfigError as e:
            raise ConfigError(f"{flag} {given}: {e}") from None
    return replace(base, **{field: value for field, (_, _, value) in flags.items()})


def buffer_flags(args) -> dict[str, tuple[str, object, object]]:
    return {
        "num_buffers": ("--num-buffers", args.num_buffers, args.num_buffers),
        "buffer_bytes": ("--buffer-mb", f"{args.buffer_mb:g}", int(args.buffer_mb * (1 << 20))),
    }


MAX_WORLD = 100_000
"""``--max-world``'s default: the most ranks a trainer or engine layout may have (a typo such as
``dp=1000000`` is refused at once instead of filling memory for a minute)."""


def max_world_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-world",
        type=positive_int,
        default=MAX_WORLD,
        help=f"refuse a trainer or engine layout of more ranks than this (default {MAX_WORLD:,})",
    )


def check_world(flag: str, world: int, max_world: int) -> None:
    """``SpecError`` naming the flag, the world and the cap if ``world`` exceeds ``--max-world``."""
    if world > max_world:
        raise SpecError(f"{flag}: {world:,} ranks, over --max-world {max_world:,} (raise it to plan larger layouts)")
