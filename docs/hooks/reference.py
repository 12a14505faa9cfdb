"""Generated reference pages: configuration (from the pydantic models) and CLI (from Typer).

Two roles in one plain module:

* functions that return the Markdown of each page (``config_reference()``, ``cli_reference()``),
  importable without MkDocs so that tests can call them;
* an MkDocs hook (declared under ``hooks:`` in ``mkdocs.yml``) whose ``on_files`` adds the two
  pages to the site at build time as ``reference/configuration.md`` and ``reference/cli.md``.

Nothing here is written into ``docs/``: the pages exist only in the built site, so they can never
drift from the code.
"""

from __future__ import annotations

import enum
import json
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_PAGE = "reference/configuration.md"
CLI_PAGE = "reference/cli.md"
MAX_DEFAULT_CHARS = 60


def _ensure_importable() -> None:
    """Let ``import stoker`` find this checkout even without an installed package."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))


def documented_models() -> list[tuple[str, type, str]]:
    """The models the configuration reference covers: (title, model, where it is used)."""
    _ensure_importable()
    from stoker.config import PipelineConfig
    from stoker.costguard.config import CostGuardConfig
    from stoker.images.spec import ImageRequest
    from stoker.launch.kubeflow import KubernetesLaunchConfig

    return [
        ("PipelineConfig", PipelineConfig,
         "`stoker run`, `stoker show-config`, the `pipeline` and `train` flows "
         "(`stoker/config.py`)."),
        ("CostGuardConfig", CostGuardConfig,
         "`stoker cost-guard` and the `cost-guard` flow (`stoker/costguard/config.py`)."),
        ("ImageRequest", ImageRequest,
         "the `build-image` flow and the `prefect.yaml` build step (`stoker/images/spec.py`)."),
        ("KubernetesLaunchConfig", KubernetesLaunchConfig,
         "`launcher.kubernetes` of PipelineConfig when `launcher.kind: kubernetes` "
         "(`stoker/launch/kubeflow.py`)."),
    ]


# ---------------------------------------------------------------- walking the models


@dataclass(frozen=True)
class FieldDoc:
    """One documented field: its dotted name and the cells of its table row."""

    name: str
    type: str
    default: str
    constraints: str
    description: str


def _is_model(tp: Any) -> bool:
    from pydantic import BaseModel

    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _nested_model(annotation: Any) -> tuple[type | None, str]:
    """The model inside ``annotation`` (``M``, ``M | None``, ``list[M]``) and the name suffix."""
    if _is_model(annotation):
        return annotation, ""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            model, suffix = _nested_model(arg)
            if model is not None:
                return model, suffix
    if origin is list and args and _is_model(args[0]):
        return args[0], "[]"
    return None, ""


def format_type(annotation: Any) -> str:
    """A readable type: ``int | None``, ``list[str]``, ``'fp32' | 'bf16'``, ``VolumeClaim``."""
    if annotation is type(None):
        return "None"
    if annotation is Any:
        return "any"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(format_type(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(format_type(a) for a in args)}]"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation)


def _literals(annotation: Any) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return list(typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [m.value for m in annotation]
    if origin in (typing.Union, types.UnionType):
        return [v for a in typing.get_args(annotation) for v in _literals(a)]
    return []


_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="), ("multiple_of", "multiple of"),
           ("min_length", "min length"), ("max_length", "max length"))


def format_constraints(info) -> str:
    """Constraints of a pydantic ``FieldInfo``: bounds, lengths, allowed values, required."""
    parts = []
    for item in info.metadata:
        for attr, symbol in _BOUNDS:
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{symbol} {value}")
    literals = _literals(info.annotation)
    if literals:
        only = typing.get_origin(info.annotation) is typing.Literal
        parts.append(("one of " if only else "or ") + ", ".join(f"`{v!r}`" for v in literals))
    if info.is_required():
        parts.append("required")
    return "; ".join(parts)


def format_default(info) -> str:
    """The default as JSON (``null`` for empty); long values are cut with an ellipsis."""
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    if info.is_required():
        return "required"
    value = info.default_factory() if info.default is PydanticUndefined else info.default
    if isinstance(value, BaseModel):
        return "see below"
    text = json.dumps(value, default=str)
    if len(text) > MAX_DEFAULT_CHARS:
        text = text[:MAX_DEFAULT_CHARS - 1] + "…"
    return text


def walk(model: type, prefix: str = "") -> Iterator[tuple[str, type, list[FieldDoc]]]:
    """Yield ``(dotted prefix, model, field rows)`` for ``model`` and every model nested in it.

    Nested models (``train``, ``launcher.docker``, ``volume_claims[]``) get their own table, after
    the table that holds them; each field is named by its full dotted path.
    """
    rows, nested = [], []
    for name, info in model.model_fields.items():
        dotted = f"{prefix}{name}"
        inner, suffix = _nested_model(info.annotation)
        description = info.description or (_summary(inner) if inner is not None else "")
        rows.append(FieldDoc(dotted, format_type(info.annotation), format_default(info),
                             format_constraints(info), description))
        if inner is not None:
            nested.append((f"{dotted}{suffix}.", inner))
    yield prefix, model, rows
    for inner_prefix, inner in nested:
        yield from walk(inner, inner_prefix)


def all_field_names(model: type) -> list[str]:
    """Every dotted field name of ``model``, nested ones included."""
    return [row.name for _, _, rows in walk(model) for row in rows]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _text(text: str) -> str:
    """Prose for a table cell: one line, and ``<work_dir>`` shown as text, not taken for HTML."""
    return " ".join(text.split()).replace("<", "&lt;").replace(">", "&gt;")


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def _summary(model: type) -> str:
    return " ".join((model.__doc__ or "").strip().split("\n\n")[0].split())


def config_reference() -> str:
    """The Markdown of the configuration reference page."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from the pydantic models when the site is built; every field of every model "
        "is listed by its dotted name, the name used in YAML files and in `field=value` "
        "overrides (`stoker run train.epochs=3`). Every model is frozen and rejects unknown "
        "fields; invalid values stop before anything runs, naming the field "
        "(`train.lr: Input should be greater than 0, got -1`). An empty value (`null`) means "
        "the behaviour the description names.",
        "",
    ]
    for title, model, used_by in documented_models():
        lines += [f"## {title}", "", f"{_text(_summary(model))} Used by {used_by}", ""]
        for prefix, inner, rows in walk(model):
            if prefix:
                lines += [f"### `{prefix.rstrip('.')}`", "", f"{_text(_summary(inner))} "
                          f"(`{inner.__name__}`)", ""]
            lines += ["| field | type | default | constraints | description |",
                      "|---|---|---|---|---|"]
            for row in rows:
                lines.append("| " + " | ".join(_cell(c) for c in (
                    _code(row.name), _code(row.type), _code(row.default), row.constraints,
                    _text(row.description))) + " |")
            lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- the CLI


def cli_commands() -> list[tuple[str, Any]]:
    """Every command of the ``stoker`` CLI as ``(full name, click command)``, in order."""
    _ensure_importable()
    import typer

    from stoker.cli import app

    root = typer.main.get_command(app)
    found = []

    # Duck-typed: Typer ships its own copy of click, so isinstance(..., click.Group) is False.
    def visit(command, path: str) -> None:
        found.append((path, command))
        if hasattr(command, "list_commands"):
            ctx = command.context_class(command, info_name=path)
            for name in command.list_commands(ctx):
                visit(command.get_command(ctx, name), f"{path} {name}")

    visit(root, "stoker")
    return found


def _param_type(param) -> str:
    # Typer 0.2x keeps the annotation on the parameter; plain click keeps a ParamType.
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is not None:
        return format_type(descriptor.annotation)
    return param.type.name


def _param_row(param) -> str:
    if param.param_type_name == "argument":
        name = f"`{(param.metavar or param.name).upper()}`"
        kind = "argument" + (", repeatable" if param.nargs == -1 else "")
    else:
        name = ", ".join(f"`{o}`" for o in [*param.opts, *param.secondary_opts])
        kind = "option"
    default = "" if param.default in (None, ()) or param.required else _code(str(param.default))
    help_text = _text(getattr(param, "help", None) or "")
    required = "yes" if param.required else "no"
    return "| " + " | ".join(_cell(c) for c in (
        name, kind, _code(_param_type(param)), required, default, help_text)) + " |"


def cli_reference() -> str:
    """The Markdown of the CLI reference page."""
    lines = ["# CLI reference", "",
             "Generated from the Typer app (`stoker.cli:app`) when the site is built. The "
             "`stoker` command is installed into `.venv/bin/` by `make install`; every command "
             "prints `--help`.", ""]
    for path, command in cli_commands():
        ctx = command.context_class(command, info_name=path)
        lines += [f"## `{path}`", "", _text(command.help or ""), "",
                  "```text", command.get_usage(ctx), "```", ""]
        params = [p for p in command.params if p.name != "help"]
        if params:
            lines += ["| parameter | kind | type | required | default | help |",
                      "|---|---|---|---|---|---|"]
            lines += [_param_row(p) for p in params]
            lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- the MkDocs hook


def on_files(files, config):
    """MkDocs hook: add the generated reference pages to the site."""
    from mkdocs.structure.files import File

    for uri, render in ((CONFIG_PAGE, config_reference), (CLI_PAGE, cli_reference)):
        files.append(File.generated(config, uri, content=render()))
    return files
