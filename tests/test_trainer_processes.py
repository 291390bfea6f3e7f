"""The Trainer across processes (torchrun, gloo on localhost): equal to one
device on the same global batches, checkpoints written by rank 0 alone, an
exact resume (sharded optimizer state too), a restart by torchrun, ranks
whose data are uneven, a full disk during a checkpoint, each rank's own
random stream, and evaluation on one rank between fits."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Dict, Optional

import pytest
import torch
from full_disk import full_after_first_checkpoint
from ranks import TOL, eval_norm, max_diff, net
from spawn import out_dir, spawn, write_and_exit
from torch import nn

import pyddp

pytestmark = pytest.mark.multiprocess


def trainer(out: dict) -> None:
    """Trainer across processes: equals single-device training on the same
    global batches; checkpoints from rank 0; exact resume; a restart by
    torchrun (KILL_AT_STEP) resumes from the last checkpoint."""
    outdir = os.environ["TRAIN_DIR"]
    max_steps = int(os.environ.get("MAX_STEPS", "6"))
    kill_at = int(os.environ.get("KILL_AT_STEP", "0"))
    g = torch.Generator().manual_seed(3)
    # 47 rows: batches of 10, 10, 10, 10 and a short 7 (4 + 3 over the ranks).
    # A resume after step 4 starts at the short batch: its rows were assumed
    # (10) and the gradients rescaled in the straight run, exchanged in the
    # resumed one, 3e-8 apart; the Trainer now gives every batch's rows.
    x, y = torch.randn(47, 6, generator=g), torch.randn(47, 3, generator=g)

    class Killer(pyddp.Callback):
        def on_step_end(self, trainer, metrics):
            restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            if kill_at and not restarted and pyddp.rank() == 1 and metrics["step"] == kill_at:
                os._exit(7)

    cfg = pyddp.TrainConfig(
        batch_size=10,
        max_steps=max_steps,
        max_epochs=100,
        output_dir=outdir,
        checkpoint_every_steps=2,
        eval_every_steps=3,
        progress=False,
        resume=True,
        shuffle=True,
        seed=4,
        shard_optimizer=os.environ.get("SHARD") == "1",
    )
    model = eval_norm(net())
    with pyddp.Trainer(
        model,
        ["cpu"] * int(os.environ.get("LOCAL_REPLICAS", "1")),
        optimizer=torch.optim.Adam,
        loss_fn=nn.functional.mse_loss,
        config=cfg,
        callbacks=[Killer()],
    ) as t:
        for m in t.model.replicas:
            m.norm.eval()
        result = t.fit((x, y), (x[:20], y[:20]))
        out["steps"] = result.state.step
        out["valid"] = t.evaluate((x[:20], y[:20]))["valid_loss"]
        out["params"] = [p.detach().flatten().tolist() for p in t.model.module.parameters()]
        out["files"] = sorted(os.listdir(outdir))
    out["restart"] = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _trainer(tmp_path: Path, name: str, env: Dict[str, str], args=None, nproc=2, train_dir=None):
    out = tmp_path / name
    out.mkdir()
    train_dir = train_dir or out / "run"
    env = {"TRAIN_DIR": str(train_dir), **env}
    return spawn(trainer, nproc, env=env, out=out, torchrun_args=args or ()), out


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted 6-step Trainer run on 2 processes: (results, run folder)."""
    return _trainer(tmp_path_factory.mktemp("straight"), "straight", {"MAX_STEPS": "6"})


def test_trainer_across_processes_resumes_exactly_and_writes_from_rank_0(tmp_path, straight):
    straight, out = straight
    assert straight[0]["steps"] == 6
    assert straight[0]["params"] == straight[1]["params"], "ranks must hold the same model"
    assert straight[0]["valid"] == straight[1]["valid"]
    # Every file is rank 0's: one metrics log, checkpoints every 2 steps.
    files = sorted(os.listdir(out / "run"))
    assert "metrics.jsonl" in files and "checkpoints" in files, files
    rows = (out / "run" / "metrics.jsonl").read_text().splitlines()
    assert len([r for r in rows if '"train_loss"' in r and '"lr"' in r]) == 6

    # Same run in two fits: 4 steps, then resumed to 6 in new processes.
    _trainer(tmp_path, "split", {"MAX_STEPS": "4"})
    resumed, _ = _trainer(
        tmp_path, "split2", {"MAX_STEPS": "6"}, train_dir=tmp_path / "split" / "run"
    )
    assert resumed[0]["params"] == straight[0]["params"], "resume must be exact"


def test_trainer_with_sharded_optimizer_state_checkpoints_and_resumes_exactly(tmp_path, straight):
    # shard_optimizer=True across 2 processes: checkpoints gather the state
    # from every rank (a collective every rank joins, though rank 0 alone
    # writes), a resume loads it on every rank, and the run is the unsharded
    # one bit for bit.
    straight, _ = straight
    _trainer(tmp_path, "shard", {"MAX_STEPS": "4", "SHARD": "1"})
    resumed, _ = _trainer(
        tmp_path, "shard2", {"MAX_STEPS": "6", "SHARD": "1"}, train_dir=tmp_path / "shard" / "run"
    )
    assert resumed[0]["params"] == resumed[1]["params"] == straight[0]["params"]


def test_single_device_reference_matches_the_trainer(tmp_path):
    got, _ = _trainer(tmp_path, "two", {"MAX_STEPS": "3", "LOCAL_REPLICAS": "2"})
    one, _ = _trainer(tmp_path, "one", {"MAX_STEPS": "3"}, nproc=1)
    for a, b in zip(got[0]["params"], one[0]["params"]):
        assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5  # Adam: 3 steps of 1e-6 noise


def test_torchrun_restart_resumes_from_the_last_checkpoint(tmp_path, straight):
    straight, _ = straight
    restarted, _ = _trainer(
        tmp_path, "restarted", {"MAX_STEPS": "6", "KILL_AT_STEP": "3"}, ["--max-restarts=1"]
    )
    assert restarted[0]["restart"] == 1, "rank 1 was killed once and the group restarted"
    assert restarted[0]["params"] == straight[0]["params"]


def sgd_trainer(cfg: pyddp.TrainConfig, model: Optional[nn.Module] = None) -> pyddp.Trainer:
    """The Trainer the scenarios below share: one CPU replica of `model`
    (eval_norm(net()) by default), SGD at lr 0.1, mean squared error."""
    return pyddp.Trainer(
        eval_norm(net()) if model is None else model,
        ["cpu"],
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=nn.functional.mse_loss,
        config=cfg,
    )


def trainer_uneven(out: dict) -> None:
    """The Trainer with a DataLoader whose DistributedSampler gives the
    ranks different numbers of batches (rank r: 2 + r): every rank trains
    the smallest number per epoch, said in a warning, and the run equals one
    device on the global batches the ranks then form."""
    import warnings

    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    world = pyddp.world()
    g = torch.Generator().manual_seed(8)
    x, y = torch.randn(64, 6, generator=g), torch.randn(64, 3, generator=g)
    batch = 4

    class Uneven(DistributedSampler):
        def __iter__(self):
            return iter(range(16 * self.rank, 16 * self.rank + len(self)))

        def __len__(self):
            return batch * (2 + self.rank)

    data = TensorDataset(x, y)
    loader = DataLoader(data, batch_size=batch, sampler=Uneven(data))
    cfg = pyddp.TrainConfig(batch_size=batch, max_epochs=2, progress=False, shuffle=False)
    model = eval_norm(net())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sgd_trainer(cfg, model) as t:
            t.model.module.norm.eval()
            result = t.fit(loader)
            trained = t.model.module
    out["steps"] = result.state.step
    out["warnings"] = [str(w.message) for w in caught if "batches per epoch" in str(w.message)]
    ref = eval_norm(net())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        for k in range(2):
            rows = torch.cat([torch.arange(16 * r + batch * k, 16 * r + batch * (k + 1))
                              for r in range(world)])  # fmt: skip
            opt.zero_grad()
            nn.functional.mse_loss(ref(x[rows]), y[rows]).backward()
            opt.step()
    out["diff"] = max_diff(trained, ref)


def test_trainer_trains_the_smallest_number_of_batches_when_ranks_data_are_uneven(tmp_path):
    # A DistributedSampler giving rank r 2 + r batches: 2 per epoch everywhere,
    # said once, equal to one device on the global batches the ranks form.
    for r in spawn(trainer_uneven, env={"PYDDP_TIMEOUT_S": "20"}, out=tmp_path):
        assert r["steps"] == 4 and r["diff"] <= TOL, r
        assert len(r["warnings"]) == 1 and "rank 0: 2, rank 1: 3" in r["warnings"][0], r


def trainer_loader_forms(out: dict) -> None:
    """DataLoaders whose last batch len(dataset) does not tell, and
    validation data as a Dataset whose last batch has fewer rows than
    processes (found by a hostile-user probe: a lost batch and two crashes)."""
    from torch.utils.data import (
        BatchSampler,
        DataLoader,
        DistributedSampler,
        SequentialSampler,
        SubsetRandomSampler,
        TensorDataset,
    )

    g = torch.Generator().manual_seed(9)
    x, y = torch.randn(49, 6, generator=g), torch.randn(49, 3, generator=g)
    data = TensorDataset(x, y)

    def fit(train, valid=None):
        cfg = pyddp.TrainConfig(batch_size=8, eval_batch_size=4, max_epochs=1, progress=False)
        torch.manual_seed(0)
        with sgd_trainer(cfg) as t:
            t.model.module.norm.eval()
            result = t.fit(train, valid)
            return result.state.step, result.state.history

    # A sampler over 44 of the 49 rows: 6 batches, the last of 4 rows (49 % 8
    # is 1, under 2 processes: the batch was dropped, 5 steps).
    subset = DataLoader(data, batch_size=8, sampler=SubsetRandomSampler(range(44)))
    out["subset_steps"] = fit(subset)[0]
    # A batch_sampler's last batch of 1 row (batch_size None: not foreseen):
    # dropped on every rank (it crashed: "got 0 shards for 1 replicas").
    batches = BatchSampler(SequentialSampler(data), batch_size=8, drop_last=False)
    out["batch_sampler_steps"] = fit(DataLoader(data, batch_sampler=batches))[0]
    # Validation of 13 rows in batches of 4 (the last of 1 row): as tensors and
    # as a Dataset, the same figures (the Dataset crashed in default_collate).
    as_tensors = fit((x, y), (x[:13], y[:13]))[1][-1]["valid_loss"]
    as_dataset = fit((x, y), TensorDataset(x[:13], y[:13]))[1][-1]["valid_loss"]
    # And as a DataLoader with torch's DistributedSampler, which pads 13 rows
    # to 14 by repeating row 0: it was counted twice (docs: each row once).
    sampler = DistributedSampler(TensorDataset(x[:13], y[:13]), shuffle=False)
    padded = DataLoader(TensorDataset(x[:13], y[:13]), batch_size=2, sampler=sampler)
    as_padded = fit((x, y), padded)[1][-1]["valid_loss"]
    # (in review: a BatchSampler of one, given as batch_sampler, still counted it)
    batches = BatchSampler(DistributedSampler(TensorDataset(x[:13], y[:13])), 3, False)
    in_batches = DataLoader(TensorDataset(x[:13], y[:13]), batch_sampler=batches)
    as_batches = fit((x, y), in_batches)[1][-1]["valid_loss"]
    out["valid"] = (as_tensors, as_dataset, as_padded, as_batches)
    # One row over 2 ranks: rank 1's share is padding alone. Trainer.evaluate()
    # (no exchange) crashed there dividing None (found in review): named now.
    one = DataLoader(TensorDataset(x[:1], y[:1]), batch_size=2,
                     sampler=DistributedSampler(TensorDataset(x[:1], y[:1])))  # fmt: skip
    with sgd_trainer(pyddp.TrainConfig(progress=False)) as t:
        try:
            out["one_row"] = t.evaluate(one)["valid_loss"]
        except ValueError as e:
            out["one_row"] = str(e)
    # Each rank its own data (a DDP habit): each rank trained on its slice of
    # its own rows, half of each unseen, silently. Refused on every rank.
    mine = torch.Generator().manual_seed(100 + pyddp.rank())
    try:
        fit((torch.randn(49, 6, generator=mine), torch.randn(49, 3, generator=mine)))
        out["per_rank_data"] = None
    except ValueError as e:
        out["per_rank_data"] = str(e)


def test_dataloader_forms_and_a_short_validation_batch(tmp_path):
    r0, r1 = spawn(trainer_loader_forms, env={"PYDDP_TIMEOUT_S": "20"}, out=tmp_path)
    for r in (r0, r1):
        assert r["subset_steps"] == 6, r
        assert r["batch_sampler_steps"] == 6, r  # 7 batches, the 1-row one dropped
        assert r["valid"][0] == r["valid"][1], r
        # (sums over other slices: float32 rounding apart, not bitwise)
        for padded in r["valid"][2:]:
            assert abs(padded - r["valid"][0]) <= 1e-6 * abs(r["valid"][0]), r
        assert "ranks passed different training data" in (r["per_rank_data"] or ""), r
    assert isinstance(r0["one_row"], float), r0
    assert "this rank's share of the data holds no rows" in r1["one_row"], r1


def trainer_settings(out: dict) -> None:
    """Each rank fits with its own TrainConfig (SCENARIO: field=rank0/rank1),
    then (a fit is refused before it trains) fixes it and fits again."""
    field, values = os.environ["SCENARIO"].split("=")
    value = int(values.split("/")[pyddp.rank()])
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(32, 6, generator=g), torch.randn(32, 3, generator=g)
    cfg = pyddp.TrainConfig(**{"batch_size": 8, "max_epochs": 2, "progress": False, field: value})
    with sgd_trainer(cfg) as t:
        try:
            t.fit((x, y))
            out["error"] = None
        except ValueError as e:
            out["error"] = str(e)
        setattr(t.config, field, int(values.split("/")[0]))
        out["steps"] = t.fit((x, y)).state.step


@pytest.mark.parametrize(
    "scenario, shown",
    [
        ("max_epochs=2/3", "max_epochs: rank 0 2, rank 1 3"),
        ("batch_size=8/16", "batch_size: rank 0 8, rank 1 16"),
        ("eval_every_steps=2/3", "eval_every_steps: rank 0 2, rank 1 3"),
        ("prefetch=1/3", None),  # a rank's own
    ],
)
def test_ranks_that_fit_with_different_settings_are_named(tmp_path, scenario, shown):
    # Found: max_epochs=2 on rank 0 and 3 on rank 1 ended rank 0 normally
    # and failed rank 1 at epoch 3 blaming rank 0 as missing; a different
    # batch_size only warned that the ranks' data differ, and trained on.
    got = spawn(trainer_settings, env={"SCENARIO": scenario, "PYDDP_TIMEOUT_S": "30"}, out=tmp_path)
    for r in got:
        if shown is None:
            assert r["error"] is None, r
        else:
            assert "the ranks fit with different settings" in (r["error"] or ""), r
            assert shown in r["error"], r
        assert r["steps"] == 8, r  # the same settings: 2 epochs of 4 steps


def trainer_disk_full(out: dict) -> None:
    """Rank 0's disk fills during the Trainer's second checkpoint: every
    rank raises naming the file and the full disk (rank 0 used to get
    torch's "unexpected pos" and rank 1 to blame rank 0 for dying); the
    first checkpoint stays, with no temporary beside it."""
    outdir = os.path.join(out_dir(), "run")
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(40, 6, generator=g), torch.randn(40, 3, generator=g)
    real_save = torch.save
    save, fill_after_first = full_after_first_checkpoint(3000)
    if pyddp.rank() == 0:
        torch.save = save
    cfg = pyddp.TrainConfig(
        batch_size=10, max_steps=4, max_epochs=100, checkpoint_every_steps=2,
        output_dir=outdir, progress=False,
    )  # fmt: skip
    try:
        with pyddp.Trainer(
            net(), ["cpu"], optimizer=functools.partial(torch.optim.SGD, lr=0.1),
            loss_fn=nn.functional.mse_loss, config=cfg, callbacks=[fill_after_first],
        ) as t:  # fmt: skip
            t.fit((x, y))
        out["error"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        torch.save = real_save
    out["files"] = sorted(os.listdir(os.path.join(outdir, "checkpoints")))


def test_a_full_disk_during_a_checkpoint_is_named_on_every_rank(tmp_path):
    ranks = spawn(trainer_disk_full, env={"PYDDP_TIMEOUT_S": "30"}, out=tmp_path)
    path = str(tmp_path / "run" / "checkpoints" / "ckpt-00000004.pt")
    for r in ranks:
        assert r["error"] is not None and "disk full" in r["error"] and path in r["error"], r
    assert ranks[0]["files"] == ["ckpt-00000002.pt"]  # intact, no temporary left


def rng(out: dict) -> None:
    """Dropout across processes: every rank draws from its own stream, and a
    resumed run restores each rank's own state (bitwise equal to a straight
    run: one CPU replica per process); from a checkpoint holding one state,
    the ranks other than 0 derive theirs from the seed, with a warning."""

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(40, 6, generator=g), torch.randn(40, 3, generator=g)

    def run(name: str, max_steps: int, probe: bool = False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 32), nn.Dropout(0.5), nn.Linear(32, 3))
        cfg = pyddp.TrainConfig(
            batch_size=10, max_steps=max_steps, max_epochs=100, checkpoint_every_steps=2,
            output_dir=os.path.join(out_dir(), name), progress=False, seed=5,
        )  # fmt: skip
        with pyddp.Trainer(
            model, ["cpu"], optimizer=functools.partial(torch.optim.SGD, lr=0.1),
            loss_fn=nn.functional.mse_loss, config=cfg,
        ) as t:  # fmt: skip
            t.fit((x, y))
            if probe:  # (the streams are seeded at the first fit)
                return torch.rand(4).tolist()
            return [p.detach().flatten().tolist() for p in t.model.module.parameters()]

    out["draws"] = run("probe", 1, probe=True)
    straight = run("straight", 6)
    run("split", 3)
    out["resumed_equal"] = run("split", 6) == straight


def test_ranks_draw_their_own_random_streams_and_resume_them(tmp_path):
    # Dropout masks were the same on every rank (every rank seeded alike, and
    # resume copied rank 0's state to all).
    ranks = spawn(rng, out=tmp_path)
    assert ranks[0]["draws"] != ranks[1]["draws"]
    assert all(r["resumed_equal"] for r in ranks)


def exchanges(out: dict) -> None:
    """fit, an evaluation on rank 0 alone, fit again: the evaluation used to
    pair its exchange with the other rank's next training step (wrong
    figures on both, then a gloo abort). Then two ranks at different
    exchanges on purpose: both must raise, naming both."""
    from pyddp._link.control import LOSS_WEIGHTS
    from pyddp.train.evaluation import _VALID_SUMS

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(40, 6, generator=g), torch.randn(40, 3, generator=g)
    cfg = pyddp.TrainConfig(batch_size=10, max_epochs=1, progress=False, seed=4)
    model = eval_norm(net())
    with pyddp.Trainer(
        model, ["cpu"], optimizer=functools.partial(torch.optim.SGD, lr=0.05),
        loss_fn=nn.functional.mse_loss, config=cfg,
    ) as t:  # fmt: skip
        t.fit((x, y), (x[:20], y[:20]))
        if pyddp.is_main():
            out["alone"] = t.evaluate((x[:20], y[:20]))["valid_loss"]
            with torch.no_grad():
                out["alone_true"] = nn.functional.mse_loss(model.eval()(x[:20]), y[:20]).item()
            model.train()
            eval_norm(model)
        t.config.max_epochs = 2
        t.fit((x, y), (x[:20], y[:20]))
        out["steps"] = t.state.step
        out["params"] = [p.detach().flatten().tolist() for p in t.model.module.parameters()]
    dm = pyddp.wrap(nn.Linear(2, 2), ["cpu"])
    name = LOSS_WEIGHTS if pyddp.rank() == 0 else _VALID_SUMS
    try:
        dm.ranks.sum([1.0, 2.0], name)
        out["mismatch"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["mismatch"] = str(e)
    write_and_exit(out)  # the group is broken after the mismatch


def test_evaluating_on_one_rank_and_exchanges_that_do_not_pair(tmp_path):
    r0, r1 = spawn(exchanges, out=tmp_path)
    assert abs(r0["alone"] - r0["alone_true"]) < 1e-6, r0  # no exchange: the true figure
    assert r0["steps"] == r1["steps"] == 8 and r0["params"] == r1["params"]
    for r in (r0, r1):
        error = r["mismatch"]
        assert error is not None and "not at the same exchange" in error, error
        assert "rank 0 at exchange" in error and "the loss weighting of a training step" in error
        assert "rank 1 at exchange" in error and "the sums of a validation during fit()" in error


class _Unrepeated(torch.utils.data.DistributedSampler):
    """Rank r's rows r, r + world, ... without padding (Lightning's
    UnrepeatedDistributedSampler): the ranks hold different numbers of rows."""

    def __iter__(self):
        return iter(range(self.rank, len(self.dataset), self.num_replicas))

    def __len__(self):
        return len(range(self.rank, len(self.dataset), self.num_replicas))


def trainer_agreement(out: dict) -> None:
    """Found by a probe of the Trainer across processes: (a) accumulation over
    a window whose ranks hold different rows (11 rows, batches 2/2/2 and
    2/2/1) weighed each micro-batch by this rank's rows: 0.048 from one
    device's step; (b) ranks with other metrics summed validation sums of
    different lengths (rank 1's valid_loss 4.0 for 0.589) and (c) other
    validation data were accepted; (d) a stop a callback set on rank 0 only
    ended rank 0 and failed rank 1 at the timeout, blaming rank 0."""
    from torch.utils.data import DataLoader, TensorDataset

    rank = pyddp.rank()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(11, 6, generator=g), torch.randn(11, 3, generator=g)
    ds = TensorDataset(x, y)
    loader = DataLoader(ds, batch_size=2, sampler=_Unrepeated(ds, shuffle=False))
    cfg = pyddp.TrainConfig(batch_size=2, max_epochs=1, grad_accum_steps=3, progress=False)
    model, ref = eval_norm(net()), eval_norm(net())
    with sgd_trainer(cfg, model) as t:
        t.fit(loader)
    nn.functional.mse_loss(ref(x), y).backward()  # one step on the mean over the 11 rows
    with torch.no_grad():
        for p in ref.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    out["diff"] = max_diff(model, ref)
    for case in ("metrics", "valid_data"):
        metrics = {"mae": lambda o, t: (o - t).abs().mean()} if case == "metrics" and rank else {}
        valid = (x[: 8 - rank], y[: 8 - rank]) if case == "valid_data" else (x[:8], y[:8])
        t = sgd_trainer(pyddp.TrainConfig(batch_size=4, max_epochs=1, progress=False))
        t.metrics = metrics
        with t:
            try:
                t.fit((x, y), valid)
                out[case] = None
            except ValueError as e:
                out[case] = str(e)

    class StopOnRank0(pyddp.Callback):
        def __init__(self, at):
            self.at = at

        def on_step_end(self, trainer, metrics):
            if rank == 0 and self.at == trainer.state.step == 1:
                trainer.state.stop_reason = "enough"

        def on_validation_end(self, trainer, metrics):  # (at an epoch's end: found in review)
            if rank == 0 and self.at == trainer.state.step == 3:
                trainer.state.stop_reason = "plateau"

    for at in (1, 3):
        t = sgd_trainer(pyddp.TrainConfig(batch_size=4, max_epochs=2, progress=False))
        t.callbacks.append(StopOnRank0(at))
        with t:
            if at == 3:
                t.fit((x, y), (x[:8], y[:8]))  # 3 steps per epoch
            else:
                t.fit((x, y))
            out[f"stopped at {at}"] = (t.state.step, t.state.stop_reason)


def test_ranks_agree_on_windows_metrics_validation_data_and_stops(tmp_path):
    got = spawn(trainer_agreement, env={"PYDDP_TIMEOUT_S": "30"}, out=tmp_path)
    for r in got:
        assert r["diff"] < TOL, r
        assert "metrics: rank 0 [], rank 1 ['mae']" in (r["metrics"] or ""), r
        assert "valid_data: rank 0 tuple of 8 rows, rank 1 tuple of 7" in (r["valid_data"] or ""), r
    assert got[0]["stopped at 1"] == [1, "enough"]
    assert got[1]["stopped at 1"] == [1, "stopped on another rank"]
    assert got[0]["stopped at 3"] == [3, "plateau"]
    assert got[1]["stopped at 3"] == [3, "stopped on another rank"]


def trainer_raising(out: dict) -> None:
    """A callback, or a metric, raising on rank 0 alone, caught there (rank 0
    carries on, as a notebook would): rank 1 timed out at its next exchange
    blaming rank 0 as "died, stalled" (found by a probe); it now names what
    rank 0 reported. And a callback raising on every rank, caught: the next
    fit() finishes the run (found in review: an abandon there had ended it)."""
    import time

    case = os.environ["CASE"]
    raised = []

    class Boom(pyddp.Callback):
        def on_step_end(self, trainer, metrics):
            everyone = case == "every rank" and not raised
            if metrics["step"] == 2 and (everyone or case == "callback" and pyddp.rank() == 0):
                raised.append(True)
                raise ValueError(f"boom on rank {pyddp.rank()}")

    def metric(pred, target):
        if pyddp.rank() == 0:
            raise ValueError("metric boom on rank 0")
        return nn.functional.l1_loss(pred, target)

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(40, 6, generator=g), torch.randn(40, 3, generator=g)
    cfg = pyddp.TrainConfig(batch_size=10, max_steps=6, max_epochs=10, eval_every_steps=3,
                            progress=False)  # fmt: skip
    t = pyddp.Trainer(
        eval_norm(net()), ["cpu"], optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=nn.functional.mse_loss, config=cfg, callbacks=[Boom()],
        metrics={"l1": metric} if case == "metric" else {},
    )  # fmt: skip
    try:
        t.fit((x, y), (x[:20], y[:20]))
        out["error"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(e).__name__}: {e}"
    if case == "every rank":
        t.fit((x, y), (x[:20], y[:20]))
        out["steps"] = t.state.step
        write_and_exit(out)
    if pyddp.rank() == 0:  # alive, elsewhere, until rank 1 has timed out and said why
        for _ in range(600):
            if any(Path(out_dir()).glob("*.rank1.json")):
                break
            time.sleep(0.1)
    write_and_exit(out)


@pytest.mark.parametrize(
    "case, said",
    [("callback", "fit(): its callback Boom.on_step_end raised ValueError('boom on rank 0')"),
     ("metric", "fit(): its validation raised ReplicaError("),
     ("every rank", None)],
)  # fmt: skip
def test_a_callback_or_metric_raising_on_one_rank_is_named_on_the_others(tmp_path, case, said):
    r0, r1 = spawn(trainer_raising, env={"CASE": case, "PYDDP_TIMEOUT_S": "20"}, out=tmp_path)
    if said is None:  # every rank raised, caught it, and fit again: the run ends as planned
        assert "boom on rank 0" in r0["error"] and "boom on rank 1" in r1["error"], (r0, r1)
        assert r0["steps"] == r1["steps"] == 6, (r0, r1)
        return
    assert "boom on rank 0" in r0["error"], r0
    assert "missing: rank 0" in (r1["error"] or "") and "rank 0 left: it reported" in r1["error"]
    assert said in r1["error"], r1
