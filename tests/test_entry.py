"""The ``stoker`` command's entry point: a Ctrl-C while the CLI is still being imported (its
first ~0.4 s) ends in one line and exit 130, never a ``KeyboardInterrupt`` traceback (trial)."""

from __future__ import annotations

import importlib.abc
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from stoker import entry

ROOT = Path(__file__).resolve().parents[1]


class _InterruptedImport(importlib.abc.MetaPathFinder):
    """Raises KeyboardInterrupt when ``stoker.cli`` is imported: a Ctrl-C that lands there."""

    def find_spec(self, name, path=None, target=None):
        if name == "stoker.cli":
            raise KeyboardInterrupt
        return None


def test_the_installed_command_is_the_entry_point():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["stoker"] == "stoker.entry:main"


def test_a_ctrl_c_while_the_cli_imports_is_one_line_and_exit_130(monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, "stoker.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_InterruptedImport(), *sys.meta_path])
    with pytest.raises(SystemExit) as exited:
        entry.main()
    assert exited.value.code == 130
    assert capsys.readouterr().err.strip() == entry.STARTING_LINE


def test_a_ctrl_c_while_typer_builds_the_commands_is_the_same_line(monkeypatch, capsys):
    """Trial: at 0.2 s one Ctrl-C landed in Typer's building of the command tree (inside
    ``app(...)``, before any command ran): a 50-line traceback."""
    import typer.main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(typer.main, "get_command", interrupted)
    monkeypatch.setattr(sys, "argv", ["stoker", "jobs"])
    with pytest.raises(SystemExit) as exited:
        entry.main()
    assert exited.value.code == 130
    assert capsys.readouterr().err.strip() == entry.STARTING_LINE


def test_a_real_sigint_during_the_start_of_the_command_prints_no_traceback(tmp_path):
    """A real process, interrupted as soon as it runs: whatever it was doing then (importing
    the CLI, or already in Typer, which maps Ctrl-C to 130 itself), no traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # Signalled once the entry point runs (as the console script calls it, after importing its
    # few-line module), not at a fixed 0.1 s: on a loaded machine (CI) that landed in Python's
    # own start ("Fatal Python error: init_import_site"), before any of Stoker's code.
    process = subprocess.Popen(
        [sys.executable, "-c", "import sys; from stoker.entry import main; "
         "print('started', file=sys.stderr, flush=True); main()", "jobs", "--work-dir",
         str(tmp_path)], stderr=subprocess.PIPE, text=True, env=env)
    assert process.stderr.readline() == "started\n"
    time.sleep(0.1)  # into main()'s import of the CLI (~0.4 s, longer under load), where the
    process.send_signal(signal.SIGINT)  # old entry (``from stoker.cli import app``) printed
    err = process.communicate(timeout=60)[1]  # a traceback
    # 0: it had already listed (no jobs); -2: the signal came before Python's own handler
    assert process.returncode in (130, 0, -signal.SIGINT), err
    assert "Traceback" not in err, err


@pytest.mark.parametrize("argv, line", [
    # trial: `--debug=maybe` got Typer's boxed panel and usage lines
    (["run", "--debug=maybe"],
     "stoker run: Option '--debug' does not take a value. (see `stoker run --help`)"),
    (["run", "--nope"], "stoker run: No such option: --nope (see `stoker run --help`)"),
    (["jobs", "--work-dir"],
     "stoker jobs: Option '--work-dir' requires an argument. (see `stoker jobs --help`)"),
    (["stop"], "stoker stop: Missing argument 'job'. (see `stoker stop --help`)"),
    (["server", "nope"], "stoker server: No such command 'nope'. (see `stoker server --help`)"),
])
def test_a_command_line_that_does_not_parse_is_one_line_and_exit_2(argv, line):
    done = subprocess.run([sys.executable, "-c", "from stoker.entry import main; main()",
                           *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [line] and done.stdout == ""


def test_help_and_a_bare_command_still_print_their_help():
    for argv, code in ((["run", "--help"], 0), ([], 2), (["server"], 2)):
        done = subprocess.run([sys.executable, "-c", "from stoker.entry import main; main()",
                               *argv], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"})
        assert done.returncode == code, (argv, done.stderr)
        assert "Usage: stoker" in done.stdout and done.stderr == "", argv  # trial: a blank
