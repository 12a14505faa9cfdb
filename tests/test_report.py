"""The pipeline report's Markdown: one-line items, device-hours, links or how to open the UI."""

from __future__ import annotations

from stoker.data.pull import DatasetRef
from stoker.launch.supervisor import TrainResult
from stoker.tracking.registry import Registration
from stoker.tracking.report import SPARK_BARS, render, sparkline


def _inputs():
    dataset = DatasetRef(repo_url="/data/repo", rev="v1", commit="a" * 40, path="data/x",
                         md5="abc.dir", nfiles=10, size_bytes=100,
                         local_path="/w/datasets/abc")
    trained = TrainResult(job_dir="/w/jobs/j", run_id="r1", metrics={"val_accuracy": 0.9},
                          result={"gpu_model": "cpu"}, attempts=[{"number": 1,
                                                                  "outcome": "completed"}],
                          cost={"gpu_hours": 0.01, "cost_usd": 0.0, "goodput": 0.5})
    registration = Registration(name="m", version="2", metric="val_accuracy", value=0.9,
                                promoted=True, previous_champion="1", previous_value=0.8,
                                model_uri="models:/m/2")
    return dataset, trained, registration


def test_sparkline_keeps_the_shape_and_the_extremes():
    assert sparkline([3.0, 2.0, 1.0]) == "█▅▁"
    assert sparkline([]) == "" and sparkline([float("nan")]) == ""
    long = sparkline([float(100 - i) for i in range(1000)], width=40)
    assert len(long) == 40 and long[0] == SPARK_BARS[-1] and long[-1] == SPARK_BARS[0]
    assert sparkline([1.0, 1.0]) == "▁▁"  # flat: no division by zero


def test_report_without_ui_says_how_to_open_it_and_keeps_the_cost_on_one_line():
    markdown = render(*_inputs(), tracking_uri="sqlite:////w/mlflow.db", ui_url=None,
                      experiment_id="3", loss_curve=[2.0, 1.0, 0.5])
    cost = [line for line in markdown.splitlines() if line.startswith("- Cost:")]
    assert cost == ["- Cost: 0.0100 device-hours on cpu, $0.0000, goodput 0.50, 0 "
                    "preemption(s), 0 step(s) lost"]
    # `stoker ui`, as the docs say: a plain `mlflow ui` could die silently (trial).
    assert "open it with `stoker ui --tracking-uri sqlite:////w/mlflow.db`" in markdown
    # Logged points, not steps: 27 of them for a 264-step run read "27 steps" (trial).
    assert "- Training loss: `█▃▁` (3 logged points, 2 → 0.5" in markdown
    assert "GPU-hours" not in markdown and "None" not in markdown


def test_report_points_to_the_curves_the_run_has():
    """By default the run has no curves PNG (``tracking.plot_curves`` is off): the report
    points to the MLflow UI's own charts, and to the PNG only when it was logged."""
    default = render(*_inputs(), tracking_uri="sqlite:////w/mlflow.db", loss_curve=[2.0, 1.0])
    assert "charted in the MLflow run's *Model metrics* tab" in default
    assert "curves.png" not in default
    plotted = render(*_inputs(), tracking_uri="sqlite:////w/mlflow.db", loss_curve=[2.0, 1.0],
                     curves_plot=True)
    assert "plot in the MLflow run's `plots/curves.png`" in plotted


def test_report_with_ui_links_run_and_version():
    markdown = render(*_inputs(), tracking_uri="http://127.0.0.1:5000",
                      ui_url="http://127.0.0.1:5000", experiment_id="3")
    assert "[r1](http://127.0.0.1:5000/#/experiments/3/runs/r1)" in markdown
    # Plain link text: Prefect's UI showed `m` version **2** literally inside the link.
    assert "[m version 2](http://127.0.0.1:5000/#/models/m/versions/2)" in markdown
    assert "Training loss" not in markdown  # no curve given: no empty item


def test_a_champion_kept_shows_its_value_as_the_metrics_table_does():
    """Trial: `not promoted (champion stays version 1, val_accuracy=0.6666666666666666)`."""
    dataset, trained, registration = _inputs()
    kept = Registration(name="m", version="2", metric="val_accuracy", value=0.5,
                        promoted=False, previous_champion="1", previous_value=2 / 3,
                        model_uri="models:/m/2")
    markdown = render(dataset, trained, kept, tracking_uri="sqlite:////w/mlflow.db")
    assert "not promoted (champion stays version 1, val_accuracy=0.6667)" in markdown


def test_the_champion_line_says_why_the_champion_stayed():
    """Trial: three versions at val_accuracy 1.0 kept the 3-epoch one champion, and the line
    said only `champion stays at version 1`."""
    from stoker.tracking.registry import champion_outcome

    def registered(value, previous_value, promoted=False):
        return Registration(name="digits", version="3", metric="val_accuracy", value=value,
                            promoted=promoted, previous_champion="1",
                            previous_value=previous_value, model_uri="models:/digits/3")

    assert champion_outcome(registered(1.0, 1.0)) == (
        "stays at version 1 (val_accuracy=1.0000 too: a tie keeps the champion, a new version "
        "must beat it)")
    assert champion_outcome(registered(0.9, 0.95)) == (
        "stays at version 1 (val_accuracy=0.9500, better)")
    assert champion_outcome(registered(0.99, 0.95, promoted=True)) == "moved to it"
    assert champion_outcome(registered(0.9, None)) == "stays at version 1"
