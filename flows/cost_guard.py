"""The cost guard: find idle GPUs and stalled jobs, stop Stoker-owned resources that waste them.

Deploy it on each GPU host on a schedule (every 5 minutes, on its own work pool; see
docs/explanation/cost-guard.md) or run it by hand with ``stoker cost-guard``. It is a dry run
unless ``dry_run`` is false.
"""

from __future__ import annotations

from prefect import flow

from stoker.costguard.config import CostGuardConfig
from stoker.costguard.summary import summary
from stoker.forms import CostGuardForm
from tasks.cost_guard import report, sweep
from tasks.stopping import untagged_task_runs

DEFAULT_CONFIG = CostGuardConfig()


@flow(name="cost-guard", log_prints=True)
def cost_guard(config: CostGuardConfig = DEFAULT_CONFIG) -> dict:
    """Sample GPUs over a window, judge each Stoker-owned resource, act (unless dry-run), report."""
    return run_sweep(config)


@flow(name="cost-guard", log_prints=True)
def cost_guard_form(config: CostGuardForm = CostGuardForm()) -> dict:  # noqa: B008 - frozen
    """The ``cost-guard`` deployment: one sweep of this host."""
    return run_sweep(config.to_config())


def run_sweep(config: CostGuardConfig) -> dict:
    """Sweep, report, and summarize inside a flow run."""
    with untagged_task_runs():  # the sweep samples for a minute: see untagged_task_runs
        result = sweep(config)
        report(result)
    return summary(result)
