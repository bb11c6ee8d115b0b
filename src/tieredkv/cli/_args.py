"""What every command shares: the parser whose errors are one line, the exception a failed
check raises, and the checks of numbers, names and folders."""

from __future__ import annotations

import argparse
import math
import re
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NoReturn

from ..errors import UnknownPolicyError

__all__ = [
    "Invalid",
    "Parser",
    "at_least",
    "glue_negative_values",
    "policy",
    "positive",
    "preset",
    "writable_folder",
]


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block) with exit status 2."""

    def error(self, message: str) -> NoReturn:
        flag = re.fullmatch(r"argument (--[\w-]+): expected one argument", message)
        if flag is not None:  # its value is missing, or starts with "-" (taken for an option)
            message = (
                f"argument {flag[1]}: expected a value after it (write a value that starts "
                f"with '-' as {flag[1]}=VALUE)"
            )
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class Invalid(Exception):
    """An argument that fails validation; the message says which one and what to fix."""


_NEGATIVE = re.compile(r"-\.?\d")


def glue_negative_values(words: list[str], parsers: Iterable[argparse.ArgumentParser]) -> list[str]:
    """``--rates -5,10`` as ``--rates=-5,10``: argparse takes a value that starts with a
    minus sign and is not one number for an option, and would say only "expected one
    argument"; glued, the value reaches the checks, which say what is wrong with it."""
    valued = {
        flag
        for p in parsers
        for action in p._actions
        if action.nargs != 0
        for flag in action.option_strings
    }
    out: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word in valued and i + 1 < len(words) and _NEGATIVE.match(words[i + 1]):
            out.append(f"{word}={words[i + 1]}")
            i += 2
            continue
        out.append(word)
        i += 1
    return out


def positive(value: float, flag: str) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise Invalid(f"{flag} must be a positive number (got {value:g})")


def at_least(value: int, low: int, flag: str) -> None:
    if value < low:
        raise Invalid(f"{flag} must be at least {low} (got {value})")


def preset(get: Callable[[str], object], name: str, flag: str) -> None:
    try:
        get(name)
    except ValueError as exc:
        raise Invalid(f"{flag}: {exc}") from None


def policy(make: Callable[[str], object], name: str | None, flag: str) -> None:
    if name is not None:
        try:
            make(name)
        except UnknownPolicyError as exc:
            raise Invalid(f"{flag}: {exc}") from None


def writable_folder(folder: str, flag: str, what: str, *, empty: bool = False) -> None:
    """``folder`` is a folder (created if missing) in which a file can be written, and
    with ``empty``, holds nothing yet."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise Invalid(f"{flag} {folder}: exists and is not a folder; choose a folder")
    if empty and path.is_dir() and any(path.iterdir()):
        raise Invalid(
            f"{flag} {folder}: is not empty (a demo's tier starts afresh); choose a new or "
            "empty folder"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise Invalid(
            f"{flag} {folder}: cannot write {what} there ({exc.strerror or exc}); "
            "choose a writable folder"
        ) from None
