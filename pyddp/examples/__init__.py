"""Runnable examples: `python -m pyddp.examples.<name>`."""
