"""Issue 18's acceptance check: one pipeline run, read from the rendered MLflow and Prefect UIs
in headless Chromium (tests/ui_check.py; also runnable by hand)."""

from __future__ import annotations

import pytest
from image_support import skip_or_fail

pytestmark = pytest.mark.integration


def test_mlflow_and_prefect_pages_show_the_run(tmp_path):
    import ui_check

    if ui_check.browser_paths() is None:
        skip_or_fail("chromium and chromedriver are not installed "
                     "(apt-get install chromium chromium-driver)")
    report = ui_check.check(tmp_path, shots=tmp_path / "screenshots")
    assert not report.failed, "\n".join(report.failed)
    assert len(report.checked) >= 10, report.checked
