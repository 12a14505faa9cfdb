"""The end-to-end checkpoint benchmark (issue 45): it times the default configuration's saves
against the same steps without them, its saves are read back from the store, and its verdict
follows from the interval of the very ratio it shows.

(Its smoke run through ``run_all.py --quick`` is ``tests/test_benchmarks.py``'s.)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bench_checkpoint_e2e as bench  # noqa: E402
from benchmarks.common import Pairs, Run  # noqa: E402
from benchmarks.stats import Target  # noqa: E402
from stoker.config import TrainConfig  # noqa: E402
from stoker.runtime.checkpoint import MARKER, Checkpointer  # noqa: E402


def test_full_size_is_the_default_cadence_at_a_150_mb_state():
    args = bench.parse_args([])
    assert args.every_steps == TrainConfig().checkpoint_every_steps == 50
    assert args.size_mb == 150.0 and args.warmups == 1 and args.repeats >= 5


@pytest.mark.parametrize("option", ["--every-steps", "--periods", "--batch", "--size-mb"])
def test_a_size_that_is_not_positive_exits_2_naming_the_option(option, capsys):
    with pytest.raises(SystemExit) as exited:
        bench.parse_args([option, "0"])
    assert exited.value.code == 2
    assert option in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.timeout(120)
def test_quick_run_times_the_default_saves_and_reads_them_back_from_the_store(tmp_path,
                                                                              capsys):
    result = bench.main(["--quick", "--workdir", str(tmp_path), "--size-mb", "1",
                         "--every-steps", "3", "--periods", "2", "--batch", "4",
                         "--other-arm"])
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == result
    details = result["details"]
    # The default path is the measured one, whatever async_checkpoint defaults to.
    assert details["async_checkpoint"] is TrainConfig().async_checkpoint
    assert details["saves"] == 2 and details["durable_s"]["n"] == 2
    assert all(v > 0 for v in details["durable_s"]["values"])
    assert details["held_per_save_s"]["median"] > 0
    assert details["read_back"] == {"committed_steps": [1, 2], "latest_step": 2}
    cpu = details["serialization_cpu_s"]
    assert set(cpu) == {"now", "sha256_and_crc"} and all(v > 0 for v in cpu.values())
    assert any(n.startswith("serializing the state into one file costs the training thread")
               for n in result["notes"])
    # What the store holds, read by a fresh reader as a resumed attempt would.
    folders = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert folders == ["step-000000001", "step-000000002"]
    marker = json.loads((tmp_path / "checkpoints" / folders[-1] / MARKER).read_text())
    assert marker["step"] == 2 and set(marker["files"]) == {"shared.pt", "rank-00000.pt"}
    loaded = Checkpointer(str(tmp_path / "checkpoints"), rank=0, world_size=1).load_latest()
    assert loaded.step == 2 and loaded.shared["step"] == 2
    # The figure shown is the per-pair ratio of seconds per step; CPU beside wall.
    b, c = result["baseline"], result["candidate"]
    assert result["ratio"] == pytest.approx(c["median"] / b["median"], rel=1e-4)
    assert c["cpu_s"]["median"] > 0 and result["cpu_ratio"]["n"] == 1
    assert result["verdict"] == "undecided"  # one pair: no interval
    # The other setting of async_checkpoint, informative, saved to its own folder and read back.
    other = details["other_arm"]
    assert other["ratio"]["n"] == 1 and "verdict" not in other["ratio"]
    assert other["durable_s"]["n"] == 2 and other["read_back"]["latest_step"] == 2
    assert (tmp_path / "checkpoints-other" / "step-000000002" / MARKER).is_file()


def synthetic(candidate_s: list[float]) -> dict:
    """``emit_result`` on pairs of 1 s baseline steps and ``candidate_s`` steps."""
    runs = [Run(1.0, 10.0, 10.0) for _ in candidate_s]
    pairs = Pairs(tuple(runs), tuple(Run(c, 10 * c, 10 * c) for c in candidate_s))
    args = SimpleNamespace(every_steps=50, periods=3, warmups=0, quick=False, device="cpu",
                           batch=64)
    saver = SimpleNamespace(held_s=[0.1] * len(candidate_s),
                            durable_s=[0.5] * (3 * len(candidate_s)),
                            overwrote=[True] * (3 * len(candidate_s)))
    return bench.emit_result(args, pairs, saver, 151_000_000,
                             {"committed_steps": [13, 14, 15], "latest_step": 15})


@pytest.mark.parametrize(("candidate_s", "verdict"), [
    ([1.00, 1.03, 1.05, 1.07, 1.09], "undecided"),  # median 1.05: the interval straddles it
    ([1.01, 1.02, 1.02, 1.03, 1.01], "met"),
    ([1.10, 1.12, 1.11, 1.15, 1.09], "missed"),
])
def test_verdict_follows_from_the_interval_of_the_ratio_shown(candidate_s, verdict, capsys):
    result = synthetic(candidate_s)
    assert result["ratio"] == pytest.approx(statistics.median(candidate_s))
    ci = result["pairs"]["ci"]
    assert ci[0] <= result["ratio"] <= ci[1]
    assert Target("<=", 1.05).verdict(ci) == result["verdict"] == verdict
    assert f"(target <= 1.05: {verdict})" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_saves_after_the_first_purge_are_counted_as_overwriting_the_spare(tmp_path, capsys):
    """6 saves in one run (--quick: no warm-up), keep_latest_k=3: the 4th save's commit purges
    step 1 and keeps its shared.pt, which the 5th overwrites; the 5th's commit keeps step 2's
    for the 6th. The note counts them."""
    result = bench.main(["--quick", "--workdir", str(tmp_path), "--size-mb", "1",
                         "--every-steps", "2", "--periods", "6", "--batch", "4"])
    capsys.readouterr()
    assert TrainConfig().keep_latest_k == 3
    assert result["details"]["saves"] == 6
    assert result["details"]["saves_overwriting_the_spare"] == 2
    assert any(n.startswith("2 of the 6 counted saves overwrote") for n in result["notes"])
