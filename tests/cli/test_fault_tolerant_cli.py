"""``distoptim compare --fault-tolerant --chaos kill:S``, run as a user runs it: the console
script, torchft replica groups around a local lighthouse, one replica group SIGKILLed and
restarted; the table, ``results.json``, and nothing of torchft's own logging on the terminal."""

from __future__ import annotations

import pytest

from distoptim.cli.arguments import UsageError, build_parser
from tests.cli.helpers import command, environment, plan_of, results, run_command

pytest.importorskip("torchft")

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_compare_fault_tolerant_under_kill_chaos(tmp_path):
    out = tmp_path / "ft"
    argv = ["compare", "--fault-tolerant", "--chaos", "kill:1", "--algos", "sync"]
    # a warm spare and paced steps: the killed slot is back (and heals) while the others still
    # have most of their steps to go, however loaded the machine (a cold restart imports torch)
    argv += ["--workers", "3", "--epochs", "6", "--spares", "1", "--ft-step-ms", "120"]
    argv += ["--out", str(out)]
    env = environment()
    env.pop("RUST_LOG", None)  # what a user has: distoptim must quiet torchft itself
    proc = run_command(command(*argv), timeout=280, env=env, cwd=tmp_path)
    shown = proc.stdout + proc.stderr
    assert proc.returncode == 0, shown
    assert "torchft::" not in shown and "[INFO]" not in shown, shown  # no lighthouse chatter
    assert "sync n=3 kill:1" in proc.stdout and "vs no faults" in proc.stdout, shown
    runs = results(out)["runs"]
    free, faulty = runs
    assert free["run"] == "sync n=3" and not free["faults"] and free["recoveries"] == 0
    assert faulty["run"] == "sync n=3 kill:1"
    assert len(faulty["faults"]) >= 1 and faulty["faults"][0]["action"] == "kill"
    assert faulty["recoveries"] >= 1 and faulty["heal_s"], faulty  # the restarted one healed
    assert free["states_equal"] and faulty["states_equal"]  # every commit bitwise agreed
    assert faulty["commits"] == free["commits"] == 174  # 6 epochs of each slot's shard
    assert faulty["goodput"] > 0 and faulty["useful_samples"] < free["useful_samples"]


def test_fault_tolerant_refuses_what_it_cannot_run(tmp_path):
    def plan(*extra: str):
        return plan_of("compare", "--out", str(tmp_path / "o"), "--overwrite", *extra)

    with pytest.raises(UsageError, match="--chaos needs --fault-tolerant"):
        plan("--algos", "sync", "--chaos", "kill:5")
    with pytest.raises(UsageError, match="not agn"):
        plan("--fault-tolerant", "--algos", "sync,agn")
    with pytest.raises(UsageError, match="--workers >= 2"):
        plan("--fault-tolerant", "--algos", "sync", "--workers", "1", "--chaos", "kill:5")
    with pytest.raises(SystemExit):  # argparse: a schedule it cannot read
        build_parser().parse_args(["compare", "--fault-tolerant", "--chaos", "explode:5"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_fault_period_longer_than_the_run_still_deals_a_fault(tmp_path):
    """The README's form (``--chaos kill:30``) on runs far shorter than 30 s: the first fault
    comes at a third of the run's steps at the latest, so every algorithm meets one (the killed
    group's slot taken by a warm spare, ``--spares 1``)."""
    out = tmp_path / "ft"
    argv = ["compare", "--fault-tolerant", "--chaos", "kill:30", "--algos", "diloco"]
    argv += ["--workers", "3", "--epochs", "3", "--spares", "1", "--out", str(out)]
    proc = run_command(command(*argv), timeout=840, env=environment(), cwd=tmp_path)
    shown = proc.stdout + proc.stderr
    assert proc.returncode == 0, shown
    runs = results(out)["runs"]
    faulty = [r for r in runs if r["run"].endswith("kill:30")]
    assert len(faulty) == 1, runs
    for run in faulty:
        assert run["spec"]["spares"] == 1, run
        assert len(run["faults"]) >= 1 and run["faults"][0]["action"] == "kill", run
        assert run["states_equal"], run  # every commit's committers bitwise equal
    assert "no fault dealt" not in proc.stdout and "before its first fault" not in shown, shown


def test_a_chaos_run_without_a_fault_shows_no_ratio():
    from distoptim.cli.faulttolerant import FaultTolerantRecord
    from distoptim.cli.ftsession import _row

    def record(chaos: str | None, faults: list) -> FaultTolerantRecord:
        return FaultTolerantRecord({"chaos": chaos}, 10.0, 1000, 100.0, 50, 0, 0, faults=faults)

    free = record(None, [])
    assert _row("sync kill:30", record("kill:30:0", []), free)[8] == "no fault dealt"
    dealt = [{"action": "kill", "slot": 0, "pid": 1, "at": 0.0, "resumed_at": 1.0}]
    assert _row("sync kill:30", record("kill:30:0", dealt), free)[8] == "100.0 %"
    assert _row("sync", free, None)[8] == "-"
