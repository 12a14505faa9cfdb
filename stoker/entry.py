"""The ``stoker`` command's entry point (``[project.scripts]``): the Typer app of
:mod:`stoker.cli`, run so that

* a Ctrl-C while it is imported or while Typer builds its commands (its first ~0.4 s, before
  any handler of Stoker's is installed) ends the command with one line and exit 130 (as a
  Ctrl-C does later) instead of Python's ``KeyboardInterrupt`` traceback: nothing has started
  then;
* a command line click cannot parse (an unknown option, ``--debug=maybe``, a missing value)
  is one line naming the command and what is wrong, exit 2, as Stoker's own checks of bad
  input are (``stoker run: Option '--debug' does not take a value. (see `stoker run
  --help`)``), instead of Typer's boxed panel and usage lines.

Everything else is Typer's own handling (``standalone_mode=False`` hands the errors back).
Tests that call the app through ``typer.testing.CliRunner`` get Typer's handling as it is."""

from __future__ import annotations

import sys

from stoker.terminal import after_echo

STARTING_LINE = "stoker: interrupted while starting (Ctrl-C); nothing was started"


def _interrupted_while_starting() -> None:
    """Say that a Ctrl-C came before any command started, and exit 130."""
    print(f"{after_echo()}{STARTING_LINE}", file=sys.stderr)
    raise SystemExit(130) from None


def command_path(app, argv: list[str]) -> str:
    """The command ``argv`` names (``stoker server start``): its leading words that are
    sub-commands of ``app``'s command tree."""
    import typer.main

    command, words = typer.main.get_command(app), ["stoker"]
    for word in argv:
        sub = getattr(command, "commands", {}).get(word)
        if sub is None:
            break
        command = sub
        words.append(word)
    return " ".join(words)


def usage_line(error, app, argv: list[str]) -> str:
    """One line for a usage error: the command, the parser's message, where help is. (Not
    every parser error knows its command: ``Option '--debug' does not take a value`` has no
    context, so the command comes from ``argv``.)"""
    ctx = getattr(error, "ctx", None)
    command = ctx.command_path if ctx is not None and ctx.parent is not None \
        else command_path(app, argv)
    message = " ".join(error.format_message().split())
    return f"{command}: {message} (see `{command} --help`)"


def main() -> None:
    """Import the CLI and run it; exits with the command's code."""
    try:
        from stoker.cli import app
    except KeyboardInterrupt:
        _interrupted_while_starting()
    import typer

    try:  # Typer >= 0.23 parses with its own copy of click; older ones with click itself
        from typer._click import exceptions as errors
    except ImportError:  # pragma: no cover - the lock pins a Typer with its own
        import click.exceptions as errors

    try:
        code = app(prog_name="stoker", standalone_mode=False)
    except KeyboardInterrupt:
        # Typer turns one while a command runs into exit 130 itself (and Stoker's commands
        # handle their own): this one came while it built the command tree (trial)
        _interrupted_while_starting()
    except errors.NoArgsIsHelpError as e:  # `stoker` alone: its help, as before
        if e.format_message():  # Typer's rich help printed itself when it was built
            e.show()
        raise SystemExit(e.exit_code) from None
    except errors.UsageError as e:
        print(usage_line(e, app, sys.argv[1:]), file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    except errors.ClickException as e:
        e.show()
        raise SystemExit(e.exit_code) from None
    except typer.Abort:
        print("Aborted!", file=sys.stderr)
        raise SystemExit(1) from None
    raise SystemExit(code if isinstance(code, int) else 0)
