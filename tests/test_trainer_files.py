"""The Trainer's files in a shared output directory: nothing written through a
planted symbolic link, temporaries that cannot be predicted, metrics that
match the loop state after a resume (no repeated validation, no replayed step
logged twice, a column for a metric added on resume), and a checkpoint of
another optimizer class refused at load."""

import csv
import errno
import functools
import json
import os
import random
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from full_disk import full_after_first_checkpoint
from torch import nn

import pyddp
from pyddp.train.checkpoints.identity import data_signature
from pyddp.train.checkpoints.saving import list_checkpoints, save_checkpoint
from pyddp.train.files import UnsafePathError

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def data(rows=97):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 6, generator=g)
    return x, (x[:, 0] > 0).long()


def trainer(out, optimizer=SGD, callbacks=(), metrics=None, **cfg):
    torch.manual_seed(0)
    cfg.setdefault("batch_size", 32)  # 97 rows: 4 steps per epoch
    return pyddp.Trainer(
        nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)),
        ["cpu", "cpu"],
        optimizer=optimizer,
        loss_fn=F.cross_entropy,
        metrics=metrics,
        callbacks=list(callbacks),
        config=pyddp.TrainConfig(progress=False, output_dir=str(out), **cfg),
    )


def jsonl(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ links
@pytest.mark.parametrize(
    "name", ["metrics.csv", "metrics.jsonl", "best.pt", "checkpoints/ckpt-00000004.pt"]
)
def test_a_link_at_a_file_pyddp_writes_is_refused(tmp_path, name):
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    victim.write_text("not yours")
    (out / "checkpoints").mkdir(parents=True)
    (out / name).symlink_to(victim)
    x, y = data()
    with trainer(out, max_epochs=1) as t, pytest.raises(UnsafePathError) as caught:
        t.fit((x, y), (x, y))
    assert str(out / name) in str(caught.value) and "symbolic link" in str(caught.value)
    assert victim.read_text() == "not yours"


def test_links_at_the_old_temporary_names_are_left_alone(tmp_path):
    """Temporaries get unguessable names and O_EXCL: a link planted where a
    predictable temporary would go is never written through."""
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    victim.write_text("not yours")
    (out / "checkpoints").mkdir(parents=True)
    for name in ("best.pt.tmp", "checkpoints/ckpt-00000004.pt.tmp", "metrics.csv.tmp"):
        (out / name).symlink_to(victim)
    x, y = data()
    with trainer(out, max_epochs=1) as t:
        t.fit((x, y), (x, y))
    assert victim.read_text() == "not yours"
    assert torch.load(out / "best.pt", weights_only=True).keys() == t.best_state_dict.keys()
    leftovers = [p.name for p in (out / "checkpoints").iterdir() if not p.is_symlink()]
    assert leftovers == ["ckpt-00000004.pt"]  # no temporary left behind


def test_a_linked_checkpoints_folder_is_refused(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    elsewhere.mkdir()
    out.mkdir()
    (out / "checkpoints").symlink_to(elsewhere, target_is_directory=True)
    x, y = data()
    with trainer(out, max_epochs=1) as t, pytest.raises(UnsafePathError, match="checkpoints"):
        t.fit((x, y))
    assert list(elsewhere.iterdir()) == []


def test_a_linked_checkpoint_is_refused_at_resume(tmp_path):
    out = tmp_path / "out"
    x, y = data()
    with trainer(out, max_epochs=1) as t:
        t.fit((x, y))
    planted = out / "checkpoints" / "ckpt-00000099.pt"
    planted.symlink_to(list_checkpoints(out / "checkpoints")[0])
    with trainer(out, max_epochs=2) as t, pytest.raises(UnsafePathError, match="ckpt-00000099"):
        t.fit((x, y))


# ---------------------------------------------------------------- resume
class _StopAt(pyddp.Callback):
    """Sends SIGINT (a first Ctrl-C: stop after this step) at `step`."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, trainer, metrics):
        if metrics["step"] == self.step:
            os.kill(os.getpid(), signal.SIGINT)


def test_resume_after_ctrl_c_at_the_end_of_an_epoch_validates_once(tmp_path):
    x, y = data()
    with trainer(tmp_path / "full", max_epochs=2, eval_every_steps=2) as full:
        want = full.fit((x, y), (x, 1 - y)).state.history
    cut = tmp_path / "cut"
    with trainer(cut, max_epochs=2, eval_every_steps=2, callbacks=[_StopAt(4)]) as t:
        assert t.fit((x, y), (x, 1 - y)).stop_reason == "interrupted"
    with trainer(cut, max_epochs=2, eval_every_steps=2) as t:
        got = t.fit((x, y), (x, 1 - y)).state.history
    assert [r["step"] for r in got] == [2, 4, 6, 8]
    assert got == want  # smoothed loss and the training side of the curve included
    rows = list(csv.DictReader((cut / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == [2, 4, 6, 8]


def test_validation_rows_name_the_epoch_their_step_is_in(tmp_path):
    # 4 steps an epoch, validated every 3 steps and at each epoch's end: a
    # row's epoch is its step's, as the training rows say (mid-epoch ones
    # said the epochs done before).
    x, y = data()
    with trainer(tmp_path, max_epochs=2, eval_every_steps=3, eval_every_epochs=1) as t:
        t.fit((x, y), (x, y))
    rows = jsonl(tmp_path)
    train = {r["step"]: r["epoch"] for r in rows if r["kind"] == "train"}
    valid = [(r["step"], r["epoch"]) for r in rows if r["kind"] == "valid"]
    assert train == {1: 1, 2: 1, 3: 1, 4: 1, 5: 2, 6: 2, 7: 2, 8: 2}
    assert valid == [(3, 1), (4, 1), (6, 2), (8, 2)]


def test_replayed_steps_are_logged_once(tmp_path):
    x, y = data()
    with trainer(tmp_path, max_epochs=3, checkpoint_every_steps=2, max_steps=5) as t:
        t.fit((x, y), (x, y))
    # A crash after step 5 was logged but before its checkpoint was written:
    (tmp_path / "checkpoints" / "ckpt-00000005.pt").unlink()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 6, "trunc')  # and a line cut short
    with trainer(tmp_path, max_epochs=2, checkpoint_every_steps=2) as t:
        t.fit((x, y), (x, y))
    rows = jsonl(tmp_path)
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, 9))
    assert [r["step"] for r in rows if r["kind"] == "valid"] == [4, 8]


def test_a_metric_added_on_resume_gets_its_column(tmp_path):
    x, y = data()
    with trainer(tmp_path, max_epochs=1) as t:
        t.fit((x, y), (x, y))
    accuracy = {"accuracy": lambda out, t: (out.argmax(1) == t).float().mean()}
    with trainer(tmp_path, max_epochs=2, metrics=accuracy) as t:
        t.fit((x, y), (x, y))
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [r["step"] for r in rows] == ["4", "8"]
    assert rows[0]["accuracy"] == "" and 0 <= float(rows[1]["accuracy"]) <= 1


def test_a_checkpoint_of_another_optimizer_class_is_refused_at_load(tmp_path):
    x, y = data()
    with trainer(tmp_path, max_epochs=1) as t:
        t.fit((x, y))
    adam = functools.partial(torch.optim.Adam, lr=1e-3)
    with trainer(tmp_path, max_epochs=2, optimizer=adam) as t:
        with pytest.raises(ValueError, match=r"optimizer torch\.optim\.sgd\.SGD.*adam\.Adam"):
            t.fit((x, y))
        assert t.state.step == 0  # nothing loaded


def test_unreadable_checkpoints_are_set_aside_not_weighed_against_the_runs_own(tmp_path):
    # Every checkpoint unreadable: the run restarted at step 0, and
    # max_to_keep deleted each new checkpoint right after writing it (the
    # unreadable ones had higher steps), so every restart began at 0 again.
    x, y = data()
    with trainer(tmp_path, max_epochs=3, checkpoint_every_epochs=1, max_to_keep=2) as t:
        t.fit((x, y))
    folder = tmp_path / "checkpoints"
    bad = sorted(folder.iterdir())
    assert [p.name for p in bad] == ["ckpt-00000008.pt", "ckpt-00000012.pt"]
    for p in bad:
        p.write_bytes(p.read_bytes()[:100])  # truncated by a failing disk
    restart = trainer(tmp_path, max_epochs=1, checkpoint_every_epochs=1, max_to_keep=2)
    with pytest.warns(UserWarning) as caught, restart as t:
        assert t.fit((x, y)).state.step == 4  # started afresh
    assert sorted(p.name for p in folder.glob("ckpt-*")) == ["ckpt-00000004.pt"]
    said = [str(w.message) for w in caught if "unreadable" in str(w.message)]
    assert len(said) == 2, said
    for p, text in zip(reversed(bad), said):
        assert f"{p} is unreadable" in text and str(folder / "unreadable" / p.name) in text
    assert sorted(p.name for p in (folder / "unreadable").iterdir()) == [p.name for p in bad]
    # The next restart continues from the run's own checkpoint, with no warning.
    with trainer(tmp_path, max_epochs=2, max_to_keep=2) as t:
        assert t.fit((x, y)).state.step == 8


def test_max_to_keep_never_prunes_the_checkpoint_it_just_wrote(tmp_path):
    for step in (12, 2):  # 12: not this run's past (one it resumed before)
        save_checkpoint({"loop": {"step": step}}, tmp_path, step, max_to_keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000002.pt", "ckpt-00000012.pt"]
    save_checkpoint({"loop": {"step": 4}}, tmp_path, 4, max_to_keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-00000002.pt",
        "ckpt-00000004.pt",
        "ckpt-00000012.pt",
    ]
    save_checkpoint({"loop": {"step": 6}}, tmp_path, 6, max_to_keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-00000004.pt",
        "ckpt-00000006.pt",
        "ckpt-00000012.pt",
    ]


# 10 bytes: the bare OSError; 3000: torch.save's "unexpected pos" RuntimeError.
@pytest.mark.parametrize("room", [10, 3000])
def test_a_full_disk_during_a_checkpoint_names_the_file_and_keeps_the_last_one(
    tmp_path, monkeypatch, room
):
    save, fill_after_first = full_after_first_checkpoint(room)
    monkeypatch.setattr(torch, "save", save)
    x, y = data()
    run = trainer(tmp_path, max_epochs=2, checkpoint_every_epochs=1, callbacks=[fill_after_first])
    with run as t, pytest.raises(OSError) as caught:
        t.fit((x, y))
    text = str(caught.value)
    assert "disk full" in text and str(tmp_path / "checkpoints" / "ckpt-00000008.pt") in text
    assert caught.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path / "checkpoints") == ["ckpt-00000004.pt"]  # no temporary
    monkeypatch.undo()
    with trainer(tmp_path, max_epochs=2) as t:  # the last checkpoint is intact
        assert t.fit((x, y)).state.step == 8


def _edited(payload, edit):
    if edit == "no optimizer":
        del payload["optimizer"]
    elif edit == "newer loop":
        payload["loop"]["tokens_seen"] = 0
    elif edit == "loop a list":
        payload["loop"] = [payload["loop"]]
    elif edit == "model of another net":
        payload["model"] = {k.replace("2.", "3."): v for k, v in payload["model"].items()}
    elif edit == "optimizer without groups":
        del payload["optimizer"]["param_groups"]
    elif edit == "one rng state":  # the unreleased format before each rank's was kept
        payload["rng"] = payload["rng"]["ranks"][0]
    elif edit in ("no loss_scaler", "no classes", "no run"):
        del payload[edit[3:]]
    elif edit == "step a str":  # (these were bare TypeErrors mid-fit, or taken: a probe)
        payload["loop"]["step"] = "4"
    elif edit == "epoch -1":
        payload["loop"]["epoch"] = -1
    elif edit == "history None":
        payload["loop"]["history"] = None
    elif edit == "no rank's rng":
        payload["rng"]["ranks"] = []
    elif edit == "best of another net":
        payload["best"] = {k: v[:1] for k, v in payload["model"].items()}
    return payload


@pytest.mark.parametrize(
    "edit,said",
    [
        ("no optimizer", 'no "optimizer"'),
        ("newer loop", "fields this pyddp does not know: tokens_seen"),
        ("loop a list", '"loop" is a list, not a dict'),
        ("model of another net", "its model does not fit this Trainer"),
        ("optimizer without groups", "its optimizer state does not fit this Trainer"),
        ("one rng state", '"rng" holds no "ranks"'),
        ("no loss_scaler", 'no "loss_scaler"'),
        ("no classes", 'no "classes"'),
        ("no run", 'no "run"'),
        ("step a str", "\"loop\" step is '4', not a count"),
        ("epoch -1", '"loop" epoch is -1, not a count'),
        ("history None", '"loop" history is None, not a list of validation rows'),
        ("no rank's rng", '"rng" "ranks" is not a list'),
        ("best of another net", "its best model does not fit this Trainer"),
    ],
)
def test_a_hand_edited_checkpoint_is_refused_naming_the_file_and_what_is_wrong(
    tmp_path, edit, said
):
    x, y = data()
    with trainer(tmp_path, max_epochs=1) as t:
        t.fit((x, y))
    path = list_checkpoints(tmp_path / "checkpoints")[0]
    torch.save(_edited(torch.load(path, weights_only=True), edit), path)
    with trainer(tmp_path, max_epochs=2) as t, pytest.raises(ValueError) as caught:
        t.fit((x, y))
    assert str(path) in str(caught.value) and said in str(caught.value)


# ------------------------------------------------------------ run identity
def test_resuming_a_changed_run_is_refused_naming_what_differs(tmp_path):
    # The torchrun example rerun with --replicas 2 used to "resume" the
    # 1-replica run at its last step and train nothing.
    x, y = data()
    with trainer(tmp_path, max_epochs=1) as t:
        t.fit((x, y))
    changed = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
    refused = trainer(tmp_path, optimizer=changed, max_epochs=2, batch_size=16,
                      scheduler_interval="epoch", smoothing=0.9)  # fmt: skip
    with refused as t, pytest.raises(ValueError, match="differs from this one") as info:
        t.fit((x, y))
    text = str(info.value)
    assert "batch_size: checkpoint 32, now 16" in text
    # Found accepted silently: the schedule, and the best model's judging, changed.
    assert "scheduler_interval: checkpoint 'step', now 'epoch'" in text
    assert "smoothing: checkpoint 0.6, now 0.9" in text
    assert "lr=0.1" in text and "lr=0.05" in text
    assert "max_epochs" not in text  # a longer run is how one continues
    assert "resume_if_changed=True" in text
    # Same settings with a higher limit: resumes (no refusal).
    with trainer(tmp_path, max_epochs=2) as t:
        assert t.fit((x, y)).state.step == 8
    # Explicitly: continues, with a warning naming the change.
    anyway = trainer(tmp_path, max_epochs=3, batch_size=16, resume_if_changed=True)
    with anyway as t, pytest.warns(UserWarning, match="batch_size: checkpoint 32, now 16"):
        assert t.fit((x, y)).state.step == 8 + 7


def _scheduled(out, gamma, scheduler=None, **cfg):
    torch.manual_seed(0)
    step = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=gamma)
    return pyddp.Trainer(
        nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)),
        ["cpu", "cpu"],
        optimizer=SGD,
        loss_fn=F.cross_entropy,
        scheduler=scheduler or step,
        config=pyddp.TrainConfig(progress=False, output_dir=str(out), batch_size=32, **cfg),
    )


class _Warm:
    """A LambdaLR's callable object (its __dict__ is in the state dict)."""

    def __init__(self, steps, keep=None):
        self.steps, self.keep = steps, keep

    def __call__(self, step):
        return min(1.0, (step + 1) / self.steps)


def _sequential(t_max):
    def make(opt):
        lr = torch.optim.lr_scheduler
        warm, cosine = lr.LinearLR(opt, 0.5, total_iters=2), lr.CosineAnnealingLR(opt, t_max)
        return lr.SequentialLR(opt, [warm, cosine], milestones=[2])

    return make


@pytest.mark.parametrize("kind", ["sequential", "lambda object"])
def test_resume_if_changed_keeps_a_composite_schedulers_new_arguments(tmp_path, kind):
    # Found (a review): SequentialLR's schedulers and a LambdaLR's callable
    # object were replaced by their state dicts ("'dict' object has no
    # attribute 'step'", "'dict' object is not callable").
    def make(n):
        if kind == "sequential":
            return _sequential(n)
        return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _Warm(n))

    x, y = data()
    with _scheduled(tmp_path, 0.5, make(20), max_epochs=1) as t:
        t.fit((x, y))
    with _scheduled(tmp_path, 0.5, make(40), max_epochs=2) as t, pytest.raises(ValueError) as info:
        t.fit((x, y))
    assert ": checkpoint 20, now 40" in str(info.value)
    anyway = _scheduled(tmp_path, 0.5, make(40), max_epochs=2, resume_if_changed=True)
    with anyway as t, pytest.warns(UserWarning, match="checkpoint 20, now 40"):
        t.fit((x, y))
        if kind == "sequential":
            cosine = t.scheduler._schedulers[1]
            assert cosine.T_max == 40 and t.scheduler.last_epoch == 8
        else:
            assert t.scheduler.lr_lambdas[0].steps == 40 and t.scheduler.last_epoch == 8


def _replaced(inner):
    def make(opt):
        lr = torch.optim.lr_scheduler
        second = lr.CosineAnnealingLR(opt, 20) if inner == "cosine" else lr.StepLR(opt, 3)
        return lr.SequentialLR(opt, [lr.LinearLR(opt, 0.5, total_iters=2), second], [2])

    return make


@pytest.mark.parametrize("change", ["milestones", "a scheduler replaced"])
def test_scheduler_arguments_of_another_form_are_differences(tmp_path, change):
    # Found resumed silently by a review of my first version (entries of the
    # new run alone were compared): MultiStepLR's milestones [2, 6] -> [20],
    # and SequentialLR's cosine replaced by a StepLR.
    def make(first):
        if change == "milestones":
            milestones = [2, 6] if first else [20]
            return lambda opt: torch.optim.lr_scheduler.MultiStepLR(opt, milestones, 0.1)
        return _replaced("cosine" if first else "step")

    x, y = data()
    with _scheduled(tmp_path, 0.5, make(True), max_epochs=1) as t:
        t.fit((x, y))
    with _scheduled(tmp_path, 0.5, make(False), max_epochs=2) as t, pytest.raises(ValueError) as e:
        t.fit((x, y))
    said = "milestones: checkpoint Counter" if change == "milestones" else "_schedulers.1."
    assert said in str(e.value)
    anyway = _scheduled(tmp_path, 0.5, make(False), max_epochs=2, resume_if_changed=True)
    with anyway as t, pytest.warns(UserWarning, match="resuming .* with changes"):
        assert t.fit((x, y)).state.step == 8
        if change == "milestones":
            assert dict(t.scheduler.milestones) == {20: 1}
        else:  # (the replaced scheduler starts afresh, as made)
            assert t.scheduler._schedulers[1].step_size == 3


def test_a_scheduler_holding_the_optimizer_is_not_copied(tmp_path):
    # Found (a review): the scheduler's state was deep-copied at
    # construction, refusing a LambdaLR whose callable holds the optimizer
    # ("a pyddp optimizer cannot be copied") and keeping a copy of what it holds.
    # (No output_dir: torch.save cannot write such a state, as without pyddp.)
    x, y = data()
    torch.manual_seed(0)
    with pyddp.Trainer(
        nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)), ["cpu", "cpu"],
        optimizer=SGD, loss_fn=F.cross_entropy,
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _Warm(4, keep=opt)),
        config=pyddp.TrainConfig(progress=False, batch_size=32, max_epochs=1),
    ) as t:  # fmt: skip
        assert t.fit((x, y)).state.step == 4


def test_resuming_with_other_scheduler_arguments_is_refused_naming_them(tmp_path):
    # Found resumed silently with the checkpoint's arguments: a cosine
    # schedule made for the new max_steps (T_max=20) went on with T_max=10,
    # its learning rate climbing back up (a probe).
    x, y = data()
    with _scheduled(tmp_path, 0.5, max_epochs=1) as t:
        t.fit((x, y))
    with _scheduled(tmp_path, 0.1, max_epochs=2) as t, pytest.raises(ValueError) as info:
        t.fit((x, y))
    assert "scheduler gamma: checkpoint 0.5, now 0.1" in str(info.value)
    assert "step_size" not in str(info.value) and "last_epoch" not in str(info.value)
    with _scheduled(tmp_path, 0.5, max_epochs=2) as t:  # the same arguments: resumes
        assert t.fit((x, y)).state.step == 8
    anyway = _scheduled(tmp_path, 0.1, max_epochs=3, resume_if_changed=True)
    with anyway as t, pytest.warns(UserWarning, match="scheduler gamma"):
        t.fit((x, y))
        # The new argument, on the checkpoint's progress (StepLR: 0.1 * 0.5**4 * 0.1**2).
        assert t.scheduler.gamma == 0.1 and t.scheduler.last_epoch == 12
        assert t.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4 * 0.1**2)


def test_resuming_on_a_dataloader_cut_otherwise_is_refused(tmp_path):
    # Found resumed silently: batch_size 100 then 101 over 1000 rows (10
    # batches per epoch either way), and 5 rows of the epoch never trained.
    x, y = data(100)
    loader = functools.partial(torch.utils.data.DataLoader, torch.utils.data.TensorDataset(x, y))
    limits = dict(max_epochs=None, batch_size=10)  # (TrainConfig's batch_size is the loader's)
    with trainer(tmp_path, max_steps=3, **limits) as t:
        t.fit(loader(batch_size=10, shuffle=True))
    cut = trainer(tmp_path, max_steps=6, max_epochs=None, batch_size=11)
    with cut as t, pytest.raises(ValueError) as info:
        t.fit(loader(batch_size=11, shuffle=True))
    text = str(info.value)
    assert "training DataLoader: checkpoint batch_size=10" in text and "now batch_size=11" in text
    assert "training batches per epoch" not in text  # (10 either way)
    with trainer(tmp_path, max_steps=6, **limits) as t, pytest.raises(ValueError) as info:
        t.fit(loader(batch_size=10, shuffle=False))
    assert "RandomSampler" in str(info.value) and "SequentialSampler" in str(info.value)
    with trainer(tmp_path, max_steps=6, **limits) as t:
        assert t.fit(loader(batch_size=10, shuffle=True)).state.step == 6
    # A batch_sampler's own sampler (found unrecorded by a review).
    dataset = torch.utils.data.TensorDataset(x, y)
    batches = functools.partial(torch.utils.data.BatchSampler, batch_size=10, drop_last=False)
    by = {k: torch.utils.data.DataLoader(dataset, batch_sampler=batches(s(dataset)))
          for k, s in (("random", torch.utils.data.RandomSampler),
                        ("in order", torch.utils.data.SequentialSampler))}  # fmt: skip
    with trainer(tmp_path / "b", max_steps=3, **limits) as t:
        t.fit(by["random"])
    with trainer(tmp_path / "b", max_steps=6, **limits) as t, pytest.raises(ValueError) as info:
        t.fit(by["in order"])
    assert "BatchSampler(drop_last=False, batch_size=10, RandomSampler(" in str(info.value)


@pytest.mark.parametrize(
    "field, value",
    [("shard_optimizer", True), ("precision", "bf16"), ("output_dir", "elsewhere"),
     ("progress", True)],
)  # fmt: skip
def test_config_fields_the_trainer_took_at_construction_are_not_reassigned(tmp_path, field, value):
    # Found ignored or half applied: shard_optimizer=True assigned after
    # construction kept an unsharded optimizer, precision="fp16" trained on
    # CPU under autocast without loss scaling (a probe).
    x, y = data()
    with trainer(tmp_path, max_epochs=1) as t:
        setattr(t.config, field, value)
        with pytest.raises(ValueError, match=f"{field}: .* at construction, now {value!r}"):
            t.fit((x, y))
    assert not (tmp_path / "checkpoints").exists()


def test_fields_assigned_after_construction_are_the_ones_recorded(tmp_path):
    # Found: batch_size and grad_accum_steps assigned after construction
    # trained with the new values and recorded the old, so resuming with the
    # values the run used was refused ("checkpoint 16, now 64").
    x, y = data()
    with trainer(tmp_path, max_epochs=1, batch_size=16) as t:
        t.config.batch_size, t.config.grad_accum_steps = 32, 2
        t.fit((x, y))
    with trainer(tmp_path, max_epochs=2, batch_size=32, grad_accum_steps=2) as t:
        assert t.fit((x, y)).state.step == 4


def test_the_seed_is_taken_at_the_first_fit(tmp_path):
    # Found seeded at construction: a torch.randn between construction and
    # fit(), or another Trainer made meanwhile, changed the run's dropout
    # masks (0.074 apart after 12 steps).
    x, y = data()

    def run(between):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 2))
        config = pyddp.TrainConfig(progress=False, batch_size=32, max_epochs=2, seed=3)
        with pyddp.Trainer(model, ["cpu"], optimizer=SGD, loss_fn=F.cross_entropy,
                           config=config) as t:  # fmt: skip
            between()
            t.fit((x, y))
            with pytest.raises(ValueError, match="seed: 3 at the first fit .* now 4"):
                t.config.seed = 4
                t.fit((x, y))
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    alone = run(lambda: None)
    assert torch.equal(alone, run(lambda: torch.randn(1)))
    assert torch.equal(alone, run(lambda: torch.manual_seed(7)))


def test_best_pt_is_the_resumed_runs_best(tmp_path):
    # Found: a run that crashed after writing best.pt at step 6, resumed from
    # its step-4 checkpoint with another validation cadence, kept the crashed
    # run's best.pt (best_step 3 in the loop state).
    x, y = data(97)

    class Crash(pyddp.Callback):
        def on_step_end(self, trainer, metrics):
            if trainer.state.step == 7:
                raise RuntimeError("crash")

    every = dict(eval_every_steps=3, checkpoint_every_steps=4, checkpoint_every_epochs=None)
    crashing = trainer(tmp_path, callbacks=[Crash()], max_epochs=3, eval_every_epochs=None, **every)
    with crashing as t, pytest.raises(RuntimeError, match="crash"):
        t.fit((x, y), (x, y))
    assert t.state.best_step == 6
    with trainer(tmp_path, max_epochs=3, eval_every_epochs=None, eval_every_steps=100) as t:
        result = t.fit((x, y), (x, y))
    assert result.state.best_step == 3
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    assert best.keys() == result.best_state_dict.keys()
    assert all(torch.equal(best[k], v) for k, v in result.best_state_dict.items())


def test_an_output_dir_that_is_a_file_is_refused_by_name(tmp_path):
    (tmp_path / "afile").write_text("mine")
    x, y = data()
    with trainer(tmp_path / "afile", max_epochs=1) as t, pytest.raises(UnsafePathError) as info:
        t.fit((x, y))
    assert "afile as a folder: it is not a directory" in str(info.value)
    assert (tmp_path / "afile").read_text() == "mine"
    # Where no folder can be made (found: "'NoneType' object does not support
    # the context manager protocol", a probe).
    with trainer("/proc/pyddp-nowhere", max_epochs=1) as t, pytest.raises(OSError) as info:
        t.fit((x, y))
    assert "cannot create the folder /proc/pyddp-nowhere" in str(info.value)


def test_resuming_on_changed_training_data_is_refused_naming_what_differs(tmp_path):
    # A finished run "resumed" on new data trained 0 steps on it and
    # returned the old model.
    x, y = data()
    with trainer(tmp_path, max_epochs=1) as t:
        t.fit((x, y))
    other = torch.randn(97, 6, generator=torch.Generator().manual_seed(1))
    with trainer(tmp_path, max_epochs=1) as t, pytest.raises(ValueError) as info:
        t.fit((other, y))
    text = str(info.value)
    assert "differs from this one" in text and "training samples (hash of 4)" in text
    assert "training rows" not in text  # the same length: only the samples differ
    with trainer(tmp_path, max_epochs=2) as t, pytest.raises(ValueError) as info:
        t.fit((x[:40], y[:40]))
    text = str(info.value)
    assert "training rows: checkpoint 97, now 40" in text
    assert "training batches per epoch: checkpoint 4, now 2" in text
    with trainer(tmp_path / "same", max_epochs=1) as t:  # one Trainer, a second fit
        t.fit((x, y))
        t.config.max_epochs = 2
        with pytest.raises(ValueError, match="training samples"):
            t.fit((other, y))  # resume=True: it resumes its own checkpoint


class _Noisy(torch.utils.data.Dataset):
    """A Dataset with a random transform (noise drawn at each item)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.01 * torch.randn(6), self.y[i]


@pytest.mark.parametrize("loader", [False, True])
def test_the_same_data_with_random_transforms_resumes(tmp_path, loader):
    # Its samples are hashed with the random generators seeded alike (and
    # restored after): the same data reads as the same in every run.
    x, y = data()

    def noisy():
        d = _Noisy(x, y)
        return torch.utils.data.DataLoader(d, batch_size=32, shuffle=True) if loader else d

    before = torch.get_rng_state(), random.getstate(), np.random.get_state()[1]
    first = data_signature(noisy(), 4)
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert (np.random.get_state()[1] == before[2]).all()  # the training's streams untouched
    assert data_signature(noisy(), 4) == first
    with trainer(tmp_path, max_epochs=2, max_steps=5) as t:
        t.fit(noisy())
    with trainer(tmp_path, max_epochs=2) as t:
        assert t.fit(noisy()).state.step == 8


def test_a_resumed_position_past_the_end_of_shorter_data_restarts_the_epoch(tmp_path):
    # With resume_if_changed, 3 batches into an epoch of 4 and resumed on an
    # epoch of 2: it used to skip the rest of the epoch (5 steps, not 7).
    x, y = data()
    with trainer(tmp_path, max_epochs=2, max_steps=3) as t:
        t.fit((x, y))
    resumed = trainer(tmp_path, max_epochs=2, resume_if_changed=True)
    with resumed as t, pytest.warns(UserWarning) as caught:
        assert t.fit((x[:40], y[:40])).state.step == 3 + 2 + 2
    said = " ".join(str(w.message) for w in caught)
    assert "training rows: checkpoint 97, now 40" in said
    assert "training rows 97, now 40" in said and "epoch 1 restarts at its first batch" in said


class _FailingOnReplica1(torch.optim.SGD):
    """SGD whose 5th step off the main thread (replica 1's shard) raises."""

    steps = 0

    def step(self, closure=None):
        if threading.current_thread() is not threading.main_thread():
            type(self).steps += 1
            if type(self).steps == 5:
                raise RuntimeError("out of memory (test)")
        return super().step(closure)


def test_a_failed_sharded_step_needs_a_new_trainer_and_it_resumes(tmp_path):
    # A review: the next fit() resumed as the last error advised, and failed
    # naming the checkpoint ("its best model does not fit this Trainer"):
    # the broken sharded step cannot be repaired in the same wrapped model.
    x, y = data(64)
    _FailingOnReplica1.steps = 0  # (its 5th shard step fails: the later runs step on)
    failing = functools.partial(_FailingOnReplica1, lr=0.1)
    cfg = dict(max_epochs=1, batch_size=8, checkpoint_every_steps=2, shard_optimizer=True)
    cfg["optimizer"] = failing
    t = trainer(tmp_path, **cfg)
    with pytest.raises(pyddp.TrainingError, match="out of memory"):
        t.fit((x, y))
    with pytest.raises(RuntimeError, match="failed inside a sharded optimizer step.*new Trainer"):
        t.fit((x, y))
    t.close()
    with trainer(tmp_path, **cfg) as resumed:
        assert resumed.fit((x, y)).state.step == 8  # from the checkpoint of step 4
    with trainer(tmp_path / "whole", **cfg) as whole:
        whole.fit((x, y))
    for p, q in zip(resumed.model.module.parameters(), whole.model.module.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_resume_with_another_seed_restarts_a_shuffled_epoch(tmp_path, shuffle):
    # A review: with resume_if_changed, another seed shuffles the epoch
    # otherwise, and its position kept trained 9 rows twice and skipped 9.
    # Unshuffled, the seed cuts nothing: the epoch goes on (a second review).
    x, y = data(53)
    cfg = dict(max_epochs=1, batch_size=8, shuffle=shuffle)
    with trainer(tmp_path, max_steps=3, **cfg) as t:
        t.fit((x, y))
    resumed = trainer(tmp_path, seed=1, resume_if_changed=True, **cfg)
    with resumed as t, pytest.warns(UserWarning) as caught:
        assert t.fit((x, y)).state.step == (3 + 7 if shuffle else 7)
    said = " ".join(str(w.message) for w in caught)
    assert ("cut otherwise now (seed 0, now 1)" in said) == shuffle


def test_an_epoch_checkpointed_at_its_last_step_stays_done_when_resumed_cut_otherwise(tmp_path):
    # Its last step checkpointed, the run failed in the epoch's validation:
    # resumed with another batch_size, the epoch is over in either cut (not
    # restarted: 2 + 4 steps; nor continued at batch 2 of 4 of the new cut).
    x, y = data(64)

    def failing(out, target):
        raise RuntimeError("metric (test)")

    first = trainer(tmp_path, max_epochs=2, checkpoint_every_steps=1, metrics={"m": failing})
    with first as t, pytest.raises(RuntimeError, match="metric"):
        t.fit((x, y), (x, y))
    assert t.state.step == 2
    resumed = trainer(tmp_path, max_epochs=2, batch_size=16, resume_if_changed=True)
    with resumed as t, pytest.warns(UserWarning, match="batch_size: checkpoint 32, now 16"):
        assert t.fit((x, y)).state.step == 2 + 4


def test_a_fresh_run_never_prunes_another_runs_checkpoints(tmp_path):
    x, y = data()
    with trainer(tmp_path, max_epochs=6, checkpoint_every_epochs=1, max_to_keep=2) as t:
        t.fit((x, y))
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert before == ["ckpt-00000020.pt", "ckpt-00000024.pt"]
    fresh_run = trainer(tmp_path, max_epochs=3, resume=False, max_to_keep=2)
    with fresh_run as t, pytest.raises(ValueError, match="another run's checkpoints") as info:
        t.fit((x, y))
    assert "ckpt-00000020.pt, ckpt-00000024.pt" in str(info.value)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before
    # One Trainer's own checkpoints are its run's: a second fit() is fine.
    fresh = tmp_path / "fresh"
    with trainer(fresh, max_epochs=1, resume=False) as t:
        t.fit((x, y))
        t.config.max_epochs = 2
        assert t.fit((x, y)).state.step == 8  # the same run goes on (4 steps per epoch)


def test_pyddp_temporaries_left_by_a_kill_are_removed_at_start(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    ours = [
        "checkpoints/.ckpt-00000004.pt.0123456789abcdef.tmp",
        ".best.pt.fedcba9876543210.tmp",
        ".metrics.csv.00112233445566ff.tmp",
    ]
    theirs = ["checkpoints/.notes.0123456789abcdef.tmp", "mine.tmp", ".ckpt-1.pt.zz.tmp"]
    for name in ours + theirs:
        (tmp_path / name).write_bytes(b"x" * 100)
    x, y = data()
    with trainer(tmp_path, max_epochs=1) as t:
        t.fit((x, y))
    for name in ours:
        assert not (tmp_path / name).exists(), name
    for name in theirs:
        assert (tmp_path / name).exists(), name


# ------------------------------------------------------- one run at a time
def test_a_second_run_in_the_same_output_dir_is_refused_while_the_first_fits(tmp_path):
    # Two runs on one output_dir wrote the same checkpoint names, and each
    # removed the other's live temporaries as stale (the first crashed with
    # FileNotFoundError at its next save). The folder is locked per fit.
    out = tmp_path / "out"
    refused = []

    class StartsAnother(pyddp.Callback):
        def on_train_start(self, view):
            with pytest.raises(RuntimeError, match="another run is writing to .* now") as e:
                trainer(out, max_epochs=1).fit(data())
            refused.append(str(e.value))

    trainer(out, callbacks=[StartsAnother()], max_epochs=1).fit(data())
    assert refused and f"process {os.getpid()} on " in refused[0]
    # Free again once the first fit ended (returned or raised).
    assert trainer(out, max_epochs=2, resume=True).fit(data()).state.epoch == 2


def test_the_output_dir_lock_holds_across_processes_and_dies_with_its_holder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout.readline().strip() == b"locked"
        with pytest.raises(RuntimeError, match=f"process {holder.pid} on "):
            trainer(out, max_epochs=1).fit(data())
    finally:
        holder.kill()  # not a clean exit: the OS drops the lock
        holder.wait()
    assert trainer(out, max_epochs=1).fit(data()).state.epoch == 1


HOLD_LOCK = """
import sys
from pyddp.train.checkpoints.run_files import LOCK_FILE
from pyddp.train.files import SafeDir
with SafeDir.open(sys.argv[1]) as folder:
    fd, _ = folder.lock(LOCK_FILE)
print("locked", flush=True)
sys.stdin.read()
"""
