"""Runnable examples: `python -m pyddp.examples.<name>`."""

import argparse


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
