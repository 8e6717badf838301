"""Argument types for the commands' parsers: a value out of range is a one-line usage error
naming the option, not a traceback from deep inside the run (`--batch-size 0` used to end in
"range() arg 3 must not be zero", `--temperature nan` in a sampling error)."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, got {text}")
    return value
