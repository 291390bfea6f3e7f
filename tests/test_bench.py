"""pyddp-bench: every subcommand end to end in quick mode with its options
after the subcommand (and before it), the help text, the folded all-reduce
columns, the overlap lower bound's warm-up, and overlap across processes
(torchrun, 2 workers). No timing assertions: only structure, arithmetic, and
fake clocks."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List

import pytest

from pyddp.bench import allreduce, cli, overlap
from pyddp.bench.simulator import simulate


def test_every_subcommand_quick_with_options_after_it(tmp_path):
    for command in (
        ["allreduce", "--devices", "cpu", "cpu", "cpu", "--replicas", "2", "3"],
        ["overlap"],
        ["simulate", "--model", "resnet50", "--hardware", "a100-dgx", "--gpus", "2,8,16"],
    ):
        out = subprocess.run(
            [sys.executable, "-m", "pyddp.bench", *command, "--quick", "--no-progress"]
            + ["--out", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=str(tmp_path),
        )
        assert out.returncode == 0, out.stderr
    ar = json.loads((tmp_path / "allreduce-quick.json").read_text())
    assert ar["args"]["quick"] is True and ar["args"]["replicas"] == [2, 3]
    assert {r["replicas"] for r in ar["rows"]} == {2, 3}
    assert all(r["algbw_GBps"] > 0 and r["np_copy_GBps"] > 0 for r in ar["rows"])
    # the per-call floor: a torch add_ of the same buffers on the first device
    assert all(
        r["time_over_add"] == pytest.approx(r["time_s"]["median"] / r["add_time_s"]["median"])
        for r in ar["rows"]
    )
    results = json.loads((tmp_path / "overlap-quick.json").read_text())["results"]
    variants = [r["variant"] for r in results]
    assert variants[:3] == ["no reduction", "after backward", "per-parameter"]
    assert "torch DDP" in variants
    # Its samples are means of --steps steps, as the others' (found: single
    # steps, a p10-p90 ten times wider, and an odd batch's last row dropped).
    assert all(r["step_s"]["n"] == results[0]["step_s"]["n"] for r in results)
    assert all(isinstance(r["within_bound_spread"], bool) for r in results)
    assert (tmp_path / "overlap-quick.png").is_file()
    sim = json.loads((tmp_path / "simulate-quick.json").read_text())
    assert {(r["policy"], r["gpus"]) for r in sim["rows"]} == {
        (p, n) for p in simulate.POLICIES for n in (2, 8, 16)
    }
    assert (tmp_path / "simulate-quick.png").is_file()


@pytest.mark.parametrize(
    "argv",
    [
        ["overlap", "--quick", "--no-progress", "--out", "o"],
        ["--quick", "--no-progress", "--out", "o", "overlap"],
        ["--out", "elsewhere", "overlap", "--quick", "--out", "o", "--no-progress"],
    ],
)
def test_common_options_before_or_after_the_subcommand(argv):
    args = cli._parser().parse_args(argv)
    assert (args.command, args.quick, args.no_progress, args.out) == ("overlap", True, True, "o")


def test_defaults_when_common_options_are_left_out():
    args = cli._parser().parse_args(["simulate"])
    assert (args.quick, args.no_progress, args.out) == (False, False, "pyddp-runs/bench")


@pytest.mark.parametrize("command", ["allreduce", "overlap", "simulate"])
def test_subcommand_help_describes_it_and_shows_defaults(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps help to the terminal's width
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert f"`pyddp-bench {command}`:" in text  # the module's docstring as description
    assert "--quick" in text and "(default: pyddp-runs/bench)" in text
    want = {
        "allreduce": "(default: 256M)",
        "overlap": "(default: 1024)",
        "simulate": "(default: h100-nvlink)",
    }
    assert want[command] in text


def test_allreduce_replicas_beyond_devices_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["allreduce", "--devices", "cpu", "cpu", "--replicas", "3"])
    assert exit_.value.code == 2
    assert "--replicas [3]: each must be 1..2" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, said",
    [
        # --factor 1 looped forever growing a list; --max-bytes 0 and a max
        # below the min raised TypeError; --reps 0 and --rounds 0 wrote NaN
        # results; --steps 0 raised ZeroDivisionError; --width 0 and
        # --depth -1 measured a meaningless model; --batch 0 and --caps -1
        # raised from the model or the engine; an --out that cannot be made
        # raised after the work was done.
        (["allreduce", "--factor", "1"], "--factor: must be >= 2, got 1"),
        (["allreduce", "--max-bytes", "0"], "--max-bytes: must be 1 byte to this machine's memory"),
        (["allreduce", "--min-bytes", "1M", "--max-bytes", "1K"], "below --min-bytes"),
        (["allreduce", "--reps", "0"], "--reps: must be >= 1, got 0"),
        (["overlap", "--rounds", "0"], "--rounds: must be >= 1"),
        (["overlap", "--steps", "0"], "--steps: must be >= 1"),
        (["overlap", "--width", "0"], "--width: must be >= 1"),
        (["overlap", "--depth", "-1"], "--depth: must be >= 1"),
        (["overlap", "--batch", "1"], "--batch 1: at least one row per replica (2 --devices)"),
        (["overlap", "--caps", "1,-1"], "--caps 1,-1: bucket caps in MiB, each > 0"),
        (["overlap", "--caps", "inf"], "--caps inf: bucket caps in MiB, each > 0"),
        (["overlap", "--out", "{file}/sub"], "cannot make the folder"),
        # Found by a probe: these raised tracebacks, or (the options of the
        # multi-process mode given without it) were recorded unused.
        (["allreduce", "--min-bytes", "1M"], "--quick's 64K is below --min-bytes 1048576"),
        # The limit that applied is named (a probe: "--quick's 64K is below 65536").
        (
            ["allreduce", "--max-bytes", "1K", "--min-bytes", "64K"],
            "--max-bytes 1024 is below --min-bytes 65536",
        ),
        (["allreduce", "--max-bytes", "1e400G"], "a size in bytes (e.g. 4096, 64K, 1M)"),
        (["allreduce", "--max-bytes", "1000000000G"], "must be 1 byte to this machine's memory"),
        (["overlap", "--comm-hook", "fp16"], "--comm-hook: only with --processes N"),
        (["overlap", "--processes", "2", "--power-sgd-rank", "0"], "--power-sgd-rank 0: give 1"),
        (["simulate", "--out", "{squat}"], "simulate-quick.json is a folder there"),
        # Found by a third probe: repeated caps pooled their samples in one
        # row; BatchNorm on one row per replica raised from the replicas.
        (["overlap", "--caps", "1,1.0"], "--caps 1,1.0: give each cap once"),
        (["overlap", "--devices", "cpu"], "one replica reduces nothing"),  # (a fourth probe)
        (["overlap", "--model", "mlp_bn", "--batch", "3"], "at least two rows per replica for"),
        # Found by a later probe: a rank with no rows ran and printed a table.
        (
            ["overlap", "--processes", "3", "--batch", "2"],
            "--batch 2: at least one row per replica (3 --processes)",
        ),  # fmt: skip
    ],
)
def test_arguments_that_cannot_make_a_measurement_are_usage_errors(argv, said, capsys, tmp_path):
    (tmp_path / "file").write_text("")
    (tmp_path / "squat" / "simulate-quick.json").mkdir(parents=True)  # (found: after the work)
    argv = [a.replace("{squat}", str(tmp_path / "squat")) for a in argv]
    argv = [a.replace("{file}", str(tmp_path / "file")) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--quick", "--no-progress"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err


def test_a_read_only_result_file_is_refused_before_the_work(capsys, tmp_path, monkeypatch):
    # A probe (not root): the run went through, wrote its chart, then raised
    # PermissionError on the JSON. As root every file is writable, so the
    # test makes os.access say no for that file.
    taken = tmp_path / "simulate-quick.json"
    taken.write_text("{}")
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, m, **k: Path(p) != taken and access(p, m, **k))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["simulate", "--quick", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert "simulate-quick.json is read-only there" in capsys.readouterr().err
    assert not (tmp_path / "simulate-quick.png").exists() and taken.read_text() == "{}"


def test_the_transformer_model_takes_any_width():
    # A probe: --model transformer --width 129 (or 200, 1000) failed in torch
    # ("embed_dim must be divisible by num_heads").
    from pyddp.bench._util import make_input, make_model

    for width in (16, 129, 200, 1000):
        x, _ = make_input("transformer", width, 2)
        assert make_model("transformer", width, 1)(x).shape == (2, 10)


@pytest.mark.parametrize("command", ["allreduce", "overlap"])
@pytest.mark.parametrize("device", ["bogus", "cuda:99"])
def test_a_device_this_machine_lacks_is_a_usage_error(command, device, capsys):
    # Before the check, overlap raised a traceback from wrap and allreduce
    # one from torch's CUDA initialisation ("Torch not compiled with CUDA").
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--quick", "--devices", "cpu", device])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"{command} --devices: devices: " in err and "Traceback" not in err


def test_allreduce_rows_hold_the_copy_references_and_consistent_ratios():
    rows = allreduce.run(["cpu"] * 3, [2, 3], [1024, 4096], "float32", "sum", 2, progress=False)
    assert [(r["bytes"], r["replicas"]) for r in rows] == [
        (1024, 2),
        (1024, 3),
        (4096, 2),
        (4096, 3),
    ]
    for r in rows:
        n, t = r["replicas"], r["time_s"]["median"]
        assert r["time_s"]["n"] == r["copy_time_s"]["n"] == r["np_copy_time_s"]["n"] == 2
        assert r["traffic_GBps"] == pytest.approx(2 * n * r["algbw_GBps"])
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (n - 1) / n)
        assert r["algbw_over_copy"] == pytest.approx(r["copy_time_s"]["median"] / t)
        assert r["algbw_over_np_copy"] == pytest.approx(r["np_copy_time_s"]["median"] / t)
    # Both N of a size share the copies measured with them.
    assert rows[0]["copy_time_s"] == rows[1]["copy_time_s"]


def test_overlap_lower_bound_is_not_charged_the_cold_start(monkeypatch):
    # A fake clock where the first steps of the process are slow (thread pools,
    # allocator): whichever variant is timed first must not carry them. Before
    # the warm-up round, "no reduction" was always timed first and every other
    # variant came out below the lower bound.
    clock = {"now": 0.0, "steps": 0}

    def fake_step(dm, x, y, ctx):
        def step():
            clock["steps"] += 1
            clock["now"] += 5.0 if clock["steps"] <= 4 else 1.0

        return step

    monkeypatch.setattr(overlap, "_step", fake_step)
    monkeypatch.setattr(overlap.time, "perf_counter", lambda: clock["now"])
    result = overlap.run("mlp", 8, 1, 4, ["cpu", "cpu"], [1], 2, 1, ddp=False, progress=False)
    for r in result["results"]:
        assert r["samples_s"] == [1.0, 1.0], r["variant"]
        assert r["over_lower_bound"] == 1.0 and r["within_bound_spread"]


def test_a_ctrl_c_during_the_cpu_sample_is_one_line(monkeypatch, capsys, tmp_path):
    # A probe: a Ctrl-C in the first half second (the CPU load sample)
    # raised a traceback; later ones said one line.
    def interrupted(seconds=0.5):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cpu_busy", interrupted)
    assert cli.main(["overlap", "--quick", "--no-progress", "--out", str(tmp_path)]) == 130
    assert "overlap: interrupted, no results written" in capsys.readouterr().err


def test_overlap_means_leave_the_warm_up_round_out(monkeypatch):
    # A probe: pyddp's means (overlap, communication) took in the warm-up
    # round the step times leave out. Each wrapped model's means are reset
    # once, after its warm-up round.
    from pyddp.replicas.model import DistributedModel

    resets, reset = [], DistributedModel.reset_stats
    observed = lambda dm: dm._reducer._observer.count  # noqa: E731 - backwards in its means
    monkeypatch.setattr(
        DistributedModel, "reset_stats", lambda dm: (resets.append(observed(dm)), reset(dm))
    )
    overlap.run("mlp", 8, 1, 4, ["cpu", "cpu"], [1], 2, 3, ddp=False, progress=False)
    assert len(resets) == 4  # one per variant (no reduction, after backward, per parameter, 1 MiB)
    assert sorted(resets)[-1] == 1 + 3  # (a reducing variant: its warm-up round's backwards)


@pytest.mark.multiprocess
@pytest.mark.parametrize("hook", [None, "fp16", "power_sgd"])
def test_overlap_across_processes_quick_writes_consistent_results(tmp_path, hook):
    # torchrun, 2 workers, a tiny model: checks the command and the arithmetic
    # of its results, never the timings.
    out = subprocess.run(
        [sys.executable, "-m", "pyddp.bench", "overlap", "--processes", "2", "--quick"]
        + ["--threads", "1", "--width", "16", "--depth", "1", "--batch", "6"]
        + (["--comm-hook", hook] if hook else [])
        + ["--no-progress", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    assert "1 intra-op thread per process (--threads" in out.stdout
    data = json.loads((tmp_path / "overlap-2proc-quick.json").read_text())
    cfg = data["config"]
    assert (cfg["processes"], cfg["threads"], cfg["width"], cfg["batch"]) == (2, 1, 16, 6)
    rounds = cfg["rounds"]
    pyddp_r, ddp_r = data["results"]
    assert (pyddp_r["variant"], ddp_r["variant"]) == ("pyddp", "torch DDP")
    for r in (pyddp_r, ddp_r):
        assert r["step_s"]["n"] == len(r["samples_s"]) == rounds
        assert [len(s) for s in r["per_rank_samples_s"]] == [rounds, rounds]
        # A sample is the slowest rank's.
        assert r["samples_s"] == [max(a, b) for a, b in zip(*r["per_rank_samples_s"])]
        assert 0.0 <= r["overlap_fraction"] <= 1.0
        assert r["exposed_comm_s"] == pytest.approx(r["comm_s"] - r["overlap_s"])
        assert r["comm_s"] > 0  # both engines reduced something in every sample
    ratio = data["ratio"]
    medians = pyddp_r["step_s"]["median"] / ddp_r["step_s"]["median"]
    assert ratio["pyddp_over_ddp"] == pytest.approx(medians)
    assert ratio["paired"]["n"] == rounds
    assert ratio["paired"]["p10"] <= ratio["paired"]["median"] <= ratio["paired"]["p90"]
    agree = data["agreement"]
    assert agree["mean_us"] == pytest.approx(agree["mean_s"] * 1e6)
    assert agree["fraction_of_step"] == pytest.approx(agree["mean_s"] / pyddp_r["step_s"]["median"])
    assert (tmp_path / "overlap-2proc-quick.png").is_file()
    # float32 buckets; a 16-bit hook puts half their bytes on the wire, and
    # PowerSGD at most all of them (this model's matrices are too small to
    # compress twice over: torch's rule sends them whole).
    if hook == "power_sgd":
        assert 0 < data["wire_bytes_per_step"] <= data["bucket_bytes_per_step"]
    else:
        assert data["wire_bytes_per_step"] == data["bucket_bytes_per_step"] / (2 if hook else 1)
    assert cfg["comm_hook"] == hook


@pytest.mark.multiprocess
def test_a_ctrl_c_during_overlap_across_processes_leaves_no_worker_running(tmp_path):
    # A probe: the workers (torchrun starts each in a session of its own)
    # ran on after the prompt came back, then printed a traceback. A SIGINT
    # to pyddp-bench alone (not its process group): torchrun is asked too.
    bench = subprocess.Popen(
        [sys.executable, "-m", "pyddp.bench", "overlap", "--processes", "2", "--threads", "1"]
        + ["--width", "16", "--depth", "1", "--batch", "6", "--rounds", "99991", "--steps", "2"]
        + ["--no-progress", "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=str(tmp_path),
    )
    marker = '"rounds": 99991'  # (in torchrun's and each worker's command line: the config)
    try:
        deadline = time.monotonic() + 120
        while len(_processes_with(marker)) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)  # until torchrun and both workers run (a condition, not a race)
        assert len(_processes_with(marker)) == 3
        bench.send_signal(signal.SIGINT)
        out, _ = bench.communicate(timeout=180)
        assert bench.returncode == 130, out
        assert _processes_with(marker) == [], out
    finally:  # (none left to the next test, whatever failed)
        for pid in [bench.pid, *_processes_with(marker)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_worker_interrupted_by_torchrun_exits_quietly(monkeypatch, tmp_path):
    # A terminal Ctrl-C reaches torchrun, which passes it on to the workers:
    # each printed a KeyboardInterrupt traceback (a review: 110 lines and 3
    # tracebacks before the one-line message; 34 lines and torchrun's own
    # traceback after, measured by hand). A worker interrupted in its loop
    # exits 130 without one.
    from pyddp.bench import multiproc

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(multiproc, "worker", interrupted)
    monkeypatch.setattr(sys, "argv", ["multiproc", "{}", str(tmp_path / "result.json")])
    with pytest.raises(SystemExit) as exit_:
        multiproc._main()
    assert exit_.value.code == 130 and not (tmp_path / "result.json").exists()


_FAKE_TORCHRUN = """
import signal, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                          start_new_session=True)  # (as torchrun starts its workers)
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, lambda *_: open(sys.argv[1] + ".term", "w").close())
open(sys.argv[1], "w").write(str(worker.pid))
while True:
    time.sleep(1)
"""


def test_a_second_ctrl_c_while_torchrun_stops_kills_its_workers_too(tmp_path):
    # A review: the second Ctrl-C killed torchrun alone, and its workers (in
    # sessions of their own) ran on. A stand-in for torchrun that ignores
    # SIGTERM; the second Ctrl-C comes once it was asked (a condition).
    from pyddp.bench.multiproc import _stop

    marker = tmp_path / "worker"
    torchrun = subprocess.Popen([sys.executable, "-c", _FAKE_TORCHRUN, str(marker)])
    try:
        deadline = time.monotonic() + 60
        while (not marker.exists() or not marker.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        worker = int(marker.read_text())

        def second_ctrl_c():
            while not (tmp_path / "worker.term").exists():
                time.sleep(0.1)
            signal.raise_signal(signal.SIGINT)

        threading.Thread(target=second_ctrl_c, daemon=True).start()
        _stop(torchrun)  # (its first wait runs out: the Ctrl-C did not reach it)
        assert torchrun.wait(timeout=60) == -signal.SIGKILL
        deadline = time.monotonic() + 60
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)  # (init reaps it once killed)
        assert not _alive(worker)
    finally:
        torchrun.kill()
        with contextlib.suppress(Exception):
            os.kill(int(marker.read_text()), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _processes_with(text: str) -> List[int]:
    """The pids of this machine's processes whose command line holds `text`, but this one."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and "pyddp.bench.multiproc" in cmdline:
                found.append(int(entry))
    return found


def test_power_sgd_bytes_follow_torchs_rule():
    import torch

    from pyddp.bench.multiproc import _power_sgd_bytes

    # A 32 x 64 weight at rank 4: (32 + 64) x 4 values, 2048 / 384 > 2, so
    # compressed; the bias goes whole; an 8 x 8 weight (8 + 8) x 4 = 64 is
    # not compressed twice over, so whole too.
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(8, 8, bias=False))
    assert _power_sgd_bytes(model, 4) == (96 * 4 + 32 + 64) * 4


def test_overlap_processes_refuses_no_ddp_and_bad_counts(capsys):
    for argv, message in (
        (["--processes", "2", "--no-ddp"], "this mode measures pyddp against DDP"),
        (["--processes", "0"], "--processes 0: give 1"),
        (["--processes", "2", "--threads", "0"], "--threads 0: give 1 or more"),
    ):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["overlap", *argv])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


def test_the_one_command_gpu_check_runs_dry_on_the_cpu(tmp_path):
    # bench/gpu_check.sh --dry-run: the same stages as on a GPU (doctor, then
    # bench/gpu_step.py's table and equivalence check) at toy sizes on the CPU,
    # so the script a GPU session runs in one call does not rot.
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "check"
    run = subprocess.run(
        ["bash", str(root / "bench" / "gpu_check.sh"), "--dry-run", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(root),
        env=dict(os.environ, PYTHON=sys.executable),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    summary = (out / "summary.txt").read_text()
    assert "doctor     rc=0" in summary and "timing     rc=0" in summary, summary
    for model in ("mlp", "transformer"):
        for variant in ("plain", "wrap x1", "wrap x2"):
            assert f"{model}  eager  {variant}".replace("  ", " ") in " ".join(summary.split())
        assert f"{model}: 2 replicas vs plain after 5 float32 AdamW steps" in summary
    results = json.loads((out / "gpu_step.json").read_text())["results"]
    for model in ("mlp", "transformer"):
        rows = results[f"{model} eager"]
        assert rows["plain"]["vs_plain"] == 1.0
        assert all(r["gpu_busy_ms"] is None and r["step_ms"]["n"] == 2 for r in rows.values())
        assert rows["wrap x2"]["run_replicas"]  # what the wrapped model chose, recorded
        # float32 sums of two halves against one whole; Adam divides by the
        # gradient's scale, so rounding moves parameters by up to lr (seen: 5e-6)
        assert results[f"{model} equivalence"] < 1e-4
        # The hand-written 2 replicas and pyddp's share over them; the phases.
        assert rows["2 copies"]["step_ms"]["n"] == 2 and "pyddp_share" in rows["wrap x2"]
        assert set(rows["wrap x2"]["phase_host_ms"]) == {"forward", "backward", "optimizer"}
        # The captured comparison's machinery, uncaptured here (no GPU):
        # eager runs of the same steps agree to the bit on a CPU, in both modes.
        got = results[f"{model} captured equivalence"]
        assert got["captured"] is False and got["captured_vs_eager"] == 0.0, got
        assert got["deterministic"]["eager_vs_eager"] == 0.0, got


def test_overlap_names_a_host_bound_gpu_step(capsys):
    # What `pyddp-bench overlap` prints from each variant's dm.stats()["gpu"]
    # (GPU replicas only; the figures here are made up).
    gpu = {"cuda:0": {"backwards": 4, "host_ms": 3.0, "gpu_ms": 1.25,
                      "gpu_waited_for_host": 1.0, "bound": "host"}}  # fmt: skip
    cli._print_gpu_bound(
        [
            {"variant": "bucketed cap 25", "gpu": gpu, "gpu_advice": "one process per GPU"},
            {"variant": "torch DDP"},
        ]  # fmt: skip
    )
    out = capsys.readouterr().out
    assert "bucketed cap 25, cuda:0: host 3.00 ms, GPU 1.25 ms per backward" in out
    assert "at 100% of forwards: host-bound" in out
    assert out.strip().endswith("host-bound: one process per GPU")
    cli._print_gpu_bound([{"variant": "bucketed cap 25", "gpu": None}])  # CPU replicas
    assert capsys.readouterr().out == ""


def test_the_gpu_check_stops_at_a_ctrl_c_in_a_stage(tmp_path):
    # A Ctrl-C reaches the running stage (timeout --foreground keeps it in
    # the script's process group); the stage dies of SIGINT and the check
    # stops there, saying so, instead of going on to the next stage. Here
    # the "timing" stage interrupts itself, at a known point (no race).
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/bash\n"
        'case "$*" in *gpu_step.py*) kill -INT $$; sleep 5;; esac\n'
        f'exec {sys.executable} "$@"\n'
    )
    fake.chmod(0o755)
    run = subprocess.run(
        ["bash", str(root / "bench" / "gpu_check.sh"), "--dry-run", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
        env=dict(os.environ, PYTHON=str(fake)),
    )
    assert run.returncode == 130, run.stdout + run.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert summary.startswith("interrupted in stage timing"), summary
    assert "doctor     rc=0" in summary  # the stages before it, as they ended


def test_an_interrupted_run_says_so_in_a_line_and_writes_nothing(monkeypatch, capsys, tmp_path):
    # Found by a probe: Ctrl-C printed a KeyboardInterrupt traceback.
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_simulate", interrupted)
    assert cli.main(["simulate", "--quick", "--no-progress", "--out", str(tmp_path)]) == 130
    assert "simulate: interrupted, no results written" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
