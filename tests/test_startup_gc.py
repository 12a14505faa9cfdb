"""No full cyclic collection while a Stoker process imports its libraries
(``stoker.runtime.startup_gc``): the standby launcher, an exec'd rank and ``stoker run``
itself pause the collector until their imports are done, freeze what they made, and collect
as usual from then on. Each full collection during the imports walked every object made so
far: about 1 s per process on 2 cores, on the way to the first step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).parent / "gc_probe"
REPO = Path(__file__).resolve().parents[1]


def probed_env(out: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROBE), str(REPO),
                                                    env.get("PYTHONPATH", "")) if p)
    return env | {"GC_PROBE_DIR": str(out)}


def records(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def imports_then_settled(record: dict) -> bool:
    """Frozen before any full collection, collecting again at the end, with the imports'
    objects (hundreds of thousands) in the permanent generation."""
    events = record["events"]
    return ("freeze" in events and "full collection" not in events[:events.index("freeze")]
            and record["enabled"] and record["frozen"] > 100_000)


def test_the_standby_launcher_imports_torch_without_a_full_collection(tmp_path):
    done = subprocess.run([sys.executable, "-m", "stoker.runtime.launch", "--standby"],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          env=probed_env(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]  # end of input: nothing run
    [record] = records(tmp_path)
    assert imports_then_settled(record), record | {"frozen": record["frozen"]}


def test_an_execd_rank_imports_without_a_full_collection(tmp_path):
    """A rank started by torchrun in a container or a Slurm step (not forked): its imports
    are done before it reads its spec (missing here: exit 2)."""
    done = subprocess.run([sys.executable, "-m", "stoker.runtime", str(tmp_path / "no.yaml")],
                          capture_output=True, text=True, env=probed_env(tmp_path), timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    [record] = records(tmp_path)
    assert imports_then_settled(record), record
