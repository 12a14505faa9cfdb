"""Headless-browser check: what a user sees of one pipeline run in the MLflow and Prefect UIs.

Runs one small pipeline (``stoker run``) against a real ``mlflow server`` and a real Prefect
server with its UI, then opens in headless Chromium (Selenium, the Debian ``chromium`` and
``chromium-driver`` packages) the MLflow run page and the Prefect flow-run page and reads the
rendered pages: the readable run name, the dataset, the system metrics, and the Prefect report
with its links to the MLflow run and model version.

    python tests/ui_check.py [--keep DIR] [--screenshots DIR]

Exit 0 when every check holds, 1 otherwise (each failed check on one line), 2 when Chromium
or its driver is missing. tests/test_ui_check.py runs it in the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the test helpers, run as a script

from mlflow_server import MlflowServer  # noqa: E402
from prefect_server import PrefectServer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = ("chromium", "chromium-browser", "google-chrome")


def browser_paths() -> tuple[str, str] | None:
    """(chromium, chromedriver) executables on PATH, or None when either is missing."""
    chromium = next((p for p in map(shutil.which, CHROMIUM) if p), None)
    driver = shutil.which("chromedriver")
    return (chromium, driver) if chromium and driver else None


@dataclass
class Report:
    """What was checked, and each check that failed (one line each)."""

    checked: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def check(self, ok: bool, what: str, detail: str = "") -> None:
        (self.checked if ok else self.failed).append(what if ok else f"{what}: {detail}")


def run_pipeline(root: Path, mlflow_uri: str, prefect: PrefectServer) -> dict:
    """One small ``stoker run`` (CPU, one process, 1 s system-metric interval); its summary."""
    args = [sys.executable, "-m", "stoker.cli", "run", f"work_dir={root / 'work'}",
            "train.epochs=3", "train.nproc_per_node=1", f"tracking.tracking_uri={mlflow_uri}",
            "tracking.system_metrics_interval_s=1"]
    env = {**prefect.env, "PYTHONPATH": str(REPO)}
    done = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"stoker run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout[done.stdout.index("{\n"):])


def open_browser(paths: tuple[str, str]):
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1600,2400"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(paths[1]))


def page_text(driver, url: str | None, expect: list[str], timeout_s: float = 60) -> str:
    """The rendered text of ``url`` (None: the open page) once every string in ``expect`` shows
    (or at the timeout)."""
    if url is not None:
        driver.get(url)
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        text = driver.execute_script("return document.body ? document.body.innerText : ''")
        if all(s in text for s in expect):
            break
        time.sleep(0.5)
    return text


def _click_text(driver, label: str) -> None:
    """Click the first element whose own text is ``label`` (a tab), if there is one."""
    driver.execute_script(
        "const el = Array.from(document.querySelectorAll('button, a, [role=tab], li, span'))"
        ".find(e => e.innerText && e.innerText.trim() === arguments[0]);"
        "if (el) el.click();", label)


def _wait_for(driver, script: str, at_least: int, timeout_s: float = 60) -> int:
    """The value of ``script`` once it reaches ``at_least`` (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    value = 0
    while time.monotonic() < deadline:
        value = driver.execute_script(script)
        if value >= at_least:
            break
        time.sleep(0.5)
    return value


def links(driver) -> list[str]:
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('a[href]')).map(a => a.href)")


def check_mlflow(driver, mlflow_uri: str, summary: dict, report: Report, shots: Path | None):
    from mlflow import MlflowClient

    run = MlflowClient(mlflow_uri).get_run(summary["run_id"])
    name, experiment = run.info.run_name, run.info.experiment_id
    datasets = [d.dataset.name for d in run.inputs.dataset_inputs]
    system = sorted(k for k in run.data.metrics if k.startswith("system/"))
    report.check(bool(system), "MLflow store holds system metrics", "none logged")
    base = f"{mlflow_uri}/#/experiments/{experiment}/runs/{summary['run_id']}"
    text = page_text(driver, base, [name, *datasets[:1]])
    _shot(driver, shots, "mlflow-run")
    report.check(name in text, f"MLflow run page shows the run name {name!r}", text[:300])
    report.check("-" in name and not name.startswith(summary["run_id"][:6]),
                 "the run name is readable (dataset, model, job)", name)
    report.check(bool(datasets) and all(d in text for d in datasets),
                 f"MLflow run page shows the dataset {datasets}", text[:600])
    metric = system[0].removeprefix("system/") if system else "cpu_utilization_percentage"
    text = page_text(driver, f"{base}/system-metrics", [metric])
    plots = _wait_for(driver, "return document.querySelectorAll('.js-plotly-plot').length",
                      len(system))
    _shot(driver, shots, "mlflow-system-metrics")
    shown = [m for m in system if m.removeprefix("system/") in text or m in text]
    report.check(bool(shown) and len(shown) == len(system),
                 f"MLflow system metrics tab names every system metric ({len(shown)})",
                 text[:600])
    report.check(plots >= len(system) > 0, f"and draws a chart of each ({plots} drawn)",
                 f"{plots} of {len(system)}")
    return run


def check_prefect(driver, prefect: PrefectServer, run, summary: dict, mlflow_uri: str,
                  report: Report, shots: Path | None) -> None:
    ui = prefect.api_url.removesuffix("/api")
    flow_run_id = run.data.tags.get("prefect.flow_run_id", "")
    report.check(bool(flow_run_id), "MLflow run is tagged with its Prefect flow run", "no tag")
    flow_run_name = _flow_run_name(prefect, flow_run_id)
    link = run.data.tags.get("prefect.flow_run_url", "")
    report.check(link.startswith(ui), f"MLflow run links its Prefect flow run under {ui}", link)
    text = page_text(driver, link, [flow_run_name]) if link.startswith(ui) else ""
    _shot(driver, shots, "prefect-flow-run-link")
    report.check(flow_run_name in text, f"the link opens the flow run page ({flow_run_name!r})",
                 text[:300])
    page_text(driver, f"{ui}/runs/flow-run/{flow_run_id}", [flow_run_name, "Artifacts"])
    _click_text(driver, "Artifacts")
    text = page_text(driver, None, ["stoker-pipeline"])
    _shot(driver, shots, "prefect-flow-run")
    report.check("stoker-pipeline" in text, "Prefect flow-run page lists the report artifact",
                 text[:600])
    artifact = _artifact_id(prefect, flow_run_id)
    text = page_text(driver, f"{ui}/artifacts/artifact/{artifact}",
                     ["Stoker pipeline run", summary["run_id"]])
    _shot(driver, shots, "prefect-report")
    hrefs = links(driver)
    texts = driver.execute_script("return Array.from(document.querySelectorAll('a[href]'))"
                                  ".filter(a => a.href.startsWith(arguments[0]))"
                                  ".map(a => a.innerText)", mlflow_uri)
    report.check(bool(texts) and not any(c in t for t in texts for c in "*`[]"),
                 "Prefect report's MLflow links read as plain text", str(texts))
    run_url = f"{mlflow_uri}/#/experiments/{run.info.experiment_id}/runs/{summary['run_id']}"
    report.check("Stoker pipeline run" in text and summary["dataset"]["md5"] in text,
                 "Prefect report shows the dataset and its DVC hash", text[:600])
    report.check(run_url in hrefs, "Prefect report links the MLflow run", str(hrefs))
    registration = summary["registration"]
    model_url = f"{mlflow_uri}/#/models/{registration['name']}/versions/{registration['version']}"
    report.check(model_url in hrefs, "Prefect report links the model version", str(hrefs))


def _flow_run_name(prefect: PrefectServer, flow_run_id: str) -> str:
    import httpx

    return httpx.get(f"{prefect.api_url}/flow_runs/{flow_run_id}", timeout=30).json()["name"]


def _artifact_id(prefect: PrefectServer, flow_run_id: str) -> str:
    import httpx

    found = httpx.post(f"{prefect.api_url}/artifacts/filter", json={
        "artifacts": {"flow_run_id": {"any_": [flow_run_id]}, "key": {"any_": ["stoker-pipeline"]}},
    }, timeout=30).json()
    return found[0]["id"] if found else "missing"


def _shot(driver, shots: Path | None, name: str) -> None:
    if shots is not None:
        shots.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(shots / f"{name}.png"))


def check(root: Path, shots: Path | None = None) -> Report:
    """Run the pipeline and check both UIs; servers and the browser stop before returning.

    Raises:
        FileNotFoundError: Chromium or chromedriver is not installed.
    """
    paths = browser_paths()
    if paths is None:
        raise FileNotFoundError("chromium and chromedriver are needed "
                                "(Debian: apt-get install chromium chromium-driver)")
    report = Report()
    prefect = PrefectServer(root / "prefect")
    # The UI reads the API from these (the server's --port alone leaves them at port 4200).
    prefect.env.update({"PREFECT_UI_ENABLED": "true", "PREFECT_SERVER_API_PORT": str(prefect.port),
                        "PREFECT_UI_API_URL": prefect.api_url,
                        "PREFECT_UI_URL": prefect.api_url.removesuffix("/api")})
    with MlflowServer(root / "mlflow") as mlflow_server, prefect:
        summary = run_pipeline(root, mlflow_server.uri, prefect)
        driver = open_browser(paths)
        try:
            run = check_mlflow(driver, mlflow_server.uri, summary, report, shots)
            check_prefect(driver, prefect, run, summary, mlflow_server.uri, report, shots)
        finally:
            driver.quit()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="work here and keep it (default: a temp dir)")
    parser.add_argument("--screenshots", type=Path, help="save a PNG of each page here")
    args = parser.parse_args(argv)
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    root = args.keep or Path(tempfile.mkdtemp(prefix="stoker-ui-check-"))
    try:
        report = check(root.resolve(), args.screenshots)
    except FileNotFoundError as e:
        print(f"ui_check: {e}", file=sys.stderr)
        return 2
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    for line in report.checked:
        print(f"ok    {line}")
    for line in report.failed:
        print(f"FAIL  {line}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
