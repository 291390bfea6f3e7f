"""pyddp.Trainer: equals single-device training for the same data and seed,
accumulation, exact resume, corrupt-checkpoint fallback, Ctrl-C, early
stopping and the best model, uneven data, a raising replica, config checks."""

import functools
import os
import signal
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pyddp
from pyddp.checkpoint import list_checkpoints, load_latest

ATOL, RTOL = 1e-6, 1e-5  # float32 reassociation across shards, see test_equivalence.py


def data(rows=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 6, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return x, y


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.01)


def trainer(devices=("cpu", "cpu", "cpu"), **cfg):
    cfg.setdefault("batch_size", 32)
    cfg.setdefault("progress", False)
    return pyddp.Trainer(
        model(),
        list(devices),
        optimizer=SGD,
        loss_fn=F.cross_entropy,
        config=pyddp.TrainConfig(**cfg),
    )


def reference(x, y, batch, epochs, accum=1, seed=0):
    """Single-device training on the same batches in the same order."""
    ref = model()
    opt = SGD(ref.parameters())
    rows = len(x)
    for epoch in range(epochs):
        order = torch.randperm(
            rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        )
        batches = [order[i : i + batch] for i in range(0, rows, batch)]
        for start in range(0, len(batches), accum):
            window = batches[start : start + accum]
            for idx in window:
                (F.cross_entropy(ref(x[idx]), y[idx]) / len(window)).backward()
            opt.step()
            opt.zero_grad()
    return ref


def assert_params_close(a, b):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL)


def test_fit_equals_single_device_training_with_uneven_last_batch():
    x, y = data(97)  # batches of 32, 32, 32, 1: the last one runs on one replica only
    t = trainer(max_epochs=3)
    result = t.fit((x, y))
    assert result.stop_reason == "max_epochs" and result.state.step == 12
    assert_params_close(t.model.module, reference(x, y, 32, 3))
    for rep in t.model.replicas[1:]:
        for p, p0 in zip(rep.parameters(), t.model.module.parameters()):
            assert torch.equal(p, p0)


def test_gradient_accumulation_equals_single_device():
    x, y = data(90)  # 6 micro-batches of 16 (the last 10): windows of 4 then 2
    t = trainer(batch_size=16, max_epochs=2, grad_accum_steps=4)
    t.fit((x, y))
    assert t.state.step == 4
    assert_params_close(t.model.module, reference(x, y, 16, 2, accum=4))


def test_dataset_and_dataloader_inputs():
    x, y = data(64)
    t = trainer(max_epochs=1, shuffle=False)
    t.fit(TensorDataset(x, y))
    t2 = trainer(max_epochs=1)
    t2.fit(DataLoader(TensorDataset(x, y), batch_size=32, shuffle=False))
    assert_params_close(t.model.module, t2.model.module)


def test_exact_resume_is_bitwise(tmp_path):
    x, y = data(97)
    full = trainer(max_epochs=3, output_dir=str(tmp_path / "full"))
    full.fit((x, y))
    first = trainer(max_epochs=3, max_steps=5, output_dir=str(tmp_path / "resumed"))
    assert first.fit((x, y)).stop_reason == "max_steps"  # stops mid-epoch 2, checkpoints
    second = trainer(max_epochs=3, output_dir=str(tmp_path / "resumed"))
    second.fit((x, y))
    assert second.state.step == full.state.step == 12
    for p, q in zip(second.model.module.parameters(), full.model.module.parameters()):
        assert torch.equal(p, q)


def test_corrupt_checkpoint_falls_back_to_the_previous_one(tmp_path):
    x, y = data(97)
    t = trainer(max_epochs=2, output_dir=str(tmp_path))
    t.fit((x, y))
    newest, previous = list_checkpoints(tmp_path / "checkpoints")[:2]
    newest.write_bytes(newest.read_bytes()[:100])  # truncated mid-write by a "crash"
    with pytest.warns(UserWarning, match=f"{newest.name} is unreadable"):
        path, payload = load_latest(tmp_path / "checkpoints")
    assert path == previous and payload["loop"]["step"] == 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = trainer(max_epochs=2, output_dir=str(tmp_path))
        resumed.fit((x, y))
    assert resumed.state.step == 8  # redid epoch 2 from the step-4 checkpoint


class _Interrupt(pyddp.Callback):
    def on_step_end(self, trainer, metrics):
        if metrics["step"] == 3:
            os.kill(os.getpid(), signal.SIGINT)


def interrupted_trainer(**cfg):
    """A 2-replica trainer whose callback sends SIGINT after step 3."""
    return pyddp.Trainer(
        model(),
        ["cpu", "cpu"],
        optimizer=SGD,
        loss_fn=F.cross_entropy,
        callbacks=[_Interrupt()],
        config=pyddp.TrainConfig(batch_size=32, progress=False, **cfg),
    )


def test_ctrl_c_stops_at_a_step_boundary_and_checkpoints(tmp_path):
    x, y = data(97)
    t = interrupted_trainer(max_epochs=5, output_dir=str(tmp_path))
    result = t.fit((x, y))
    assert result.stop_reason == "interrupted" and result.state.step == 3
    assert list_checkpoints(tmp_path / "checkpoints")[0].name == "ckpt-00000003.pt"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_early_stopping_and_best_model(tmp_path):
    x, y = data(97)
    t = trainer(max_epochs=20, early_stopping_patience=2, smoothing=0.0, output_dir=str(tmp_path))
    # Validating against inverted labels: the better the model, the worse this loss.
    result = t.fit((x, y), (x, 1 - y))
    assert result.stop_reason == "early_stopping"
    assert result.state.best_step == 4  # the first evaluation was the best
    assert len(result.state.history) == 3
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    assert best.keys() == result.best_state_dict.keys()
    assert not torch.equal(best["0.weight"], t.model.module[0].weight)


def test_validation_is_sharded_and_reduced_like_one_device():
    x, y = data(61)
    t = pyddp.Trainer(
        model(),
        ["cpu"] * 3,
        optimizer=SGD,
        loss_fn=F.cross_entropy,
        metrics={"accuracy": lambda o, t: (o.argmax(1) == t).float().mean()},
        config=pyddp.TrainConfig(batch_size=16, progress=False),
    )
    got = t.evaluate((x, y))
    ref = model()
    with torch.no_grad():
        out = ref(x)
    assert got["valid_loss"] == pytest.approx(F.cross_entropy(out, y).item(), rel=1e-5)
    assert got["accuracy"] == pytest.approx((out.argmax(1) == y).float().mean().item())


class Faulty(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, x):
        if bool((x == 99).any()):
            raise RuntimeError("poisoned row")
        return self.lin(x)


def test_a_raising_replica_names_replica_and_step_and_keeps_the_checkpoint(tmp_path):
    x, y = data(96)
    x[70] = 99  # epoch 2 is not shuffled: batch 3 (rows 64..95), shard of replica 0
    t = pyddp.Trainer(
        Faulty(),
        ["cpu", "cpu"],
        optimizer=SGD,
        loss_fn=F.cross_entropy,
        config=pyddp.TrainConfig(
            batch_size=32, max_epochs=2, shuffle=False, progress=False, output_dir=str(tmp_path)
        ),
    )
    x_ok = x.clone()
    x_ok[70] = 0
    with pytest.raises(pyddp.TrainingError, match="epoch 1, step 3 \\(replica 0\\).*poisoned"):
        t.fit((x, y))
    assert list_checkpoints(tmp_path / "checkpoints") == []  # none written mid-epoch
    t.evaluate((x_ok, y))  # workers are free: the next call runs


@pytest.mark.parametrize(
    "field, value",
    [
        ("batch_size", 0),
        ("grad_accum_steps", -1),
        ("max_epochs", 0),
        ("scheduler_interval", "batch"),
        ("precision", "fp8"),
        ("clip_grad_norm", 0.0),
        ("smoothing", 1.0),
        ("early_stopping_patience", 0),
        ("checkpoint_every_steps", 0),
    ],
)
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        pyddp.TrainConfig(**{field: value})


def test_config_needs_a_limit_and_fp16_needs_a_gpu():
    with pytest.raises(ValueError, match="max_epochs and max_steps"):
        pyddp.TrainConfig(max_epochs=None)
    with pytest.raises(ValueError, match="fp16"):
        trainer(precision="fp16")


def test_bf16_autocast_and_clipping_train():
    x, y = data(97)
    t = trainer(max_epochs=2, precision="bf16", clip_grad_norm=0.5)
    before = t.evaluate((x, y))["valid_loss"]
    t.fit((x, y))
    after = t.evaluate((x, y))["valid_loss"]
    assert after < before


def test_digits_main_job(tmp_path):
    from pyddp.examples import digits

    out = digits.main(["--output", str(tmp_path), "--no-progress"])
    assert out["best"]["accuracy"] >= 0.95
    for name in ("best.pt", "metrics.csv", "metrics.jsonl", "learning_curve.png"):
        assert (tmp_path / name).is_file(), name
    assert list_checkpoints(tmp_path / "checkpoints")


def test_rerunning_a_finished_run_does_not_train_further(tmp_path):
    x, y = data(97)
    first = trainer(max_epochs=2, output_dir=str(tmp_path))
    first.fit((x, y))
    again = trainer(max_epochs=2, output_dir=str(tmp_path))
    result = again.fit((x, y))
    assert result.stop_reason == "max_epochs" and result.state.step == first.state.step == 8
    for p, q in zip(again.model.module.parameters(), first.model.module.parameters()):
        assert torch.equal(p, q)


def test_second_fit_after_ctrl_c_continues(tmp_path):
    x, y = data(97)
    t = interrupted_trainer(max_epochs=3)
    assert t.fit((x, y)).stop_reason == "interrupted"
    t.callbacks = []
    result = t.fit((x, y))
    assert result.stop_reason == "max_epochs" and result.state.step == 12


def test_evaluate_uses_replica_zero_batchnorm_statistics():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Linear(16, 2))
    x, y = data(96)
    t = pyddp.Trainer(
        net,
        ["cpu", "cpu"],
        optimizer=SGD,
        loss_fn=F.cross_entropy,
        config=pyddp.TrainConfig(batch_size=32, max_epochs=1, progress=False),
    )
    t.fit((x, y))  # replica 1's statistics now come from its own shards
    got = t.evaluate((x, y))["valid_loss"]
    ref = t.model.module.eval()
    with torch.no_grad():
        want = F.cross_entropy(ref(x), y).item()
    assert got == pytest.approx(want, rel=1e-5)


def test_shuffled_dataloader_resume_is_exact(tmp_path):
    x, y = data(97)

    def loader():
        return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)

    full = trainer(max_epochs=3, output_dir=str(tmp_path / "full"))
    full.fit(loader())
    cut = trainer(max_epochs=3, max_steps=5, output_dir=str(tmp_path / "cut"))
    cut.fit(loader())
    rest = trainer(max_epochs=3, output_dir=str(tmp_path / "cut"))
    rest.fit(loader())
    for p, q in zip(rest.model.module.parameters(), full.model.module.parameters()):
        assert torch.equal(p, q)
