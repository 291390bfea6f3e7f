"""The README's main examples run end to end and learn, say what they are
(--help) and what a re-run of a finished one did."""

import importlib
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from pyddp.examples import classifier, digits

EXAMPLES = [
    "digits",
    "classifier",
    "torchrun",
    "lightning_digits",
    "fabric_digits",
    "accelerate_digits",
    "hf_trainer",
    "ray_digits",
]


def test_classifier_example_learns(capsys):
    classifier.main(["--epochs", "2"])
    out = capsys.readouterr().out
    losses = [float(v) for v in re.findall(r"train loss ([0-9.]+)", out)]
    accuracy = [float(v) for v in re.findall(r"valid accuracy ([0-9.]+)", out)]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert accuracy[-1] > 0.9  # 8 classes: chance is 0.125


def _words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_help_says_the_whole_first_paragraph(name, capsys):
    # Issue 30, item 19: --help ended mid-sentence ("... bundled digits (no").
    module = importlib.import_module(f"pyddp.examples.{name}")
    with pytest.raises(SystemExit) as info:
        module.main(["--help"])
    assert info.value.code == 0
    first = _words(module.__doc__.split("\n\n")[0])
    assert first in _words(capsys.readouterr().out)


@pytest.mark.parametrize("name", ["classifier", "digits"])
def test_a_device_this_machine_lacks_is_a_usage_error(name, capsys):
    # A probe: `--devices gpu` (and cuda:0 without a GPU) raised a traceback from wrap.
    module = importlib.import_module(f"pyddp.examples.{name}")
    with pytest.raises(SystemExit) as info:
        module.main(["--devices", "gpu"])
    assert info.value.code == 2
    assert "argument --devices: devices: 'gpu' is not a device" in capsys.readouterr().err


def test_devices_that_mix_kinds_are_a_usage_error(capsys, monkeypatch):
    # A review: each device passed alone, and the mix raised from wrap.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (as on a GPU machine)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit) as info:
        classifier.main(["--devices", "cpu", "cuda:0"])
    assert info.value.code == 2 and "argument --devices: devices mixes" in capsys.readouterr().err


def test_rerunning_finished_digits_says_so_and_how_to_start_fresh(tmp_path, capsys):
    args = ["--output", str(tmp_path), "--epochs", "1", "--no-progress"]
    digits.main(args)
    assert "already finished" not in capsys.readouterr().out
    again = digits.main(args)  # resumes from the checkpoint: nothing left to train
    out = capsys.readouterr().out
    assert again["stop_reason"] == "max_epochs"
    line = next(x for x in out.splitlines() if "this run had already finished" in x)
    assert f"remove {tmp_path}/" in line and "--output" in line and "--epochs" in line
    # More epochs in the same folder: its cosine schedule spans the run's
    # epochs, so the resume is refused naming it (it advised "--epochs
    # above 1 to go on", which then went on with the old schedule's T_max).
    with pytest.raises(ValueError, match="scheduler T_max: checkpoint 1, now 2"):
        digits.main(["--output", str(tmp_path), "--epochs", "2", "--no-progress"])


def test_digits_stopped_by_ctrl_c_exits_130(tmp_path):
    # Found exiting 0 (success) after a Ctrl-C had stopped it (a probe).
    command = [sys.executable, "-m", "pyddp.examples.digits", "--output", str(tmp_path),
               "--epochs", "400", "--batch", "2", "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not list((tmp_path / "checkpoints").glob("ckpt-*.pt")) and proc.poll() is None:
            time.sleep(0.2)  # (until it trains: a file, not a deadline)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "stopped: interrupted" in out


@pytest.mark.parametrize("module", [classifier, digits])
@pytest.mark.parametrize(
    "argv, said",
    [
        (["--epochs", "0"], "--epochs: must be at least 1, got 0"),
        (["--batch", "-1"], "--batch: must be at least 1, got -1"),
    ],
)
def test_examples_refuse_counts_that_train_nothing(module, argv, said, capsys):
    # Found by a probe: classifier --batch -1 printed a loss of 0 and exited
    # 0, --epochs 0 trained nothing and exited 0, digits raised tracebacks.
    with pytest.raises(SystemExit) as info:
        module.main(argv)
    assert info.value.code == 2 and said in capsys.readouterr().err
