"""Every ``stoker`` command's ``--help`` shows what its help texts say.

The CLI renders help as Markdown (``rich_markup_mode="markdown"``), where a bare ``<word>`` reads
as an HTML tag and vanishes (trial: ``stoker stop --help`` showed ``[default: stoker stop by ]``;
``stoker ui --help`` showed ``sqlite:////mlflow.db``).
"""

from __future__ import annotations

import re

import click
import typer
from typer.testing import CliRunner

from stoker.cli import app

PLACEHOLDER = re.compile(r"<[A-Za-z][\w-]*>")


def commands(group: click.Command, path: tuple[str, ...] = ()):
    yield path, group
    for name, command in getattr(group, "commands", {}).items():
        yield from commands(command, (*path, name))


def test_every_placeholder_in_a_help_text_is_shown():
    root = typer.main.get_command(app)
    checked = 0
    for path, command in commands(root):
        texts = [command.help or ""] + [getattr(p, "help", None) or "" for p in command.params]
        wanted = {m for text in texts for m in PLACEHOLDER.findall(text)}
        if not wanted:
            continue
        shown = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "400"}).output
        missing = sorted(w for w in wanted if w not in shown)
        assert not missing, f"stoker {' '.join(path)} --help drops {missing}"
        checked += 1
    assert checked >= 3  # stop, ui, predict at least
