"""Runnable examples: `python -m pyddp.examples.<name>`."""

import argparse
from typing import Any

from ..runtime.devices import parse_devices


def count(text: str) -> int:
    """An argparse type for the examples' counts (epochs, batch, ...): a
    positive int, or a usage error naming it (0 trained nothing and exited 0;
    a negative batch trained nothing; -1 epochs raised a traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def device(text: str) -> str:
    """An argparse type for the examples' --devices: a device pyddp takes on
    this machine, or a usage error naming it (a probe: `--devices gpu` and
    `cuda:0` without a GPU raised a traceback from wrap)."""
    try:
        parse_devices([text])
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def check_devices(parser: argparse.ArgumentParser, devices: Any) -> None:
    """--devices as a whole (a mix such as `cpu cuda:0`: a review saw a
    traceback), a usage error as pyddp-bench gives."""
    if devices:
        try:
            parse_devices(devices)
        except (TypeError, ValueError) as e:
            parser.error(f"argument --devices: {e}")
