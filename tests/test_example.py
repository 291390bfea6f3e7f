"""The README's main example runs end to end and learns."""

import re

from pyddp.examples import classifier


def test_classifier_example_learns(capsys):
    classifier.main(["--epochs", "2"])
    out = capsys.readouterr().out
    losses = [float(v) for v in re.findall(r"train loss ([0-9.]+)", out)]
    accuracy = [float(v) for v in re.findall(r"valid accuracy ([0-9.]+)", out)]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert accuracy[-1] > 0.9  # 8 classes: chance is 0.125
