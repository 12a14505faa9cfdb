"""The documentation site: it builds strictly, and its generated reference covers the code.

The site is built once per session with the real ``mkdocs build --strict`` (the same command CI
runs); the checks read the built HTML. Field and command names are collected here by walking the
pydantic models and the Typer app directly, not through the generator, so a generator that drops
a field fails these tests.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from stoker.config import PipelineConfig
from stoker.costguard.config import CostGuardConfig
from stoker.images.spec import ImageRequest
from stoker.launch.kubeflow import KubernetesLaunchConfig

ROOT = Path(__file__).resolve().parents[1]
MODELS = [PipelineConfig, CostGuardConfig, ImageRequest, KubernetesLaunchConfig]


def _mkdocs() -> list[str]:
    script = Path(sys.executable).parent / "mkdocs"
    return [str(script)] if script.exists() else [sys.executable, "-m", "mkdocs"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([*_mkdocs(), "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def _page(site: Path, path: str) -> str:
    return html.unescape((site / path / "index.html").read_text())


def _code_spans(text: str) -> set[str]:
    return set(re.findall(r"<code>([^<]+)</code>", text))


def _models_in(annotation) -> list[tuple[type, str]]:
    """Pydantic models inside a field annotation, with "[]" for those inside a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, "")]
    found = []
    for arg in typing.get_args(annotation):
        inner = _models_in(arg)
        is_list = typing.get_origin(annotation) is list
        found += [(m, "[]" if is_list else suffix) for m, suffix in inner]
    return found


def _dotted_fields(model: type, prefix: str = "") -> list[str]:
    names = []
    for name, info in model.model_fields.items():
        names.append(prefix + name)
        for inner, suffix in _models_in(info.annotation):
            names += _dotted_fields(inner, f"{prefix}{name}{suffix}.")
    return names


def test_walker_sees_nested_fields():
    """Guard for the guard: the independent walk reaches nested and list-of-model fields."""
    names = set(_dotted_fields(PipelineConfig))
    assert {"train.lr", "launcher.docker.image", "cost.prices.usd_per_gpu_hour"} <= names
    assert "volume_claims[].claim_name" in _dotted_fields(KubernetesLaunchConfig)
    assert "policy.window_s" in _dotted_fields(CostGuardConfig)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_config_reference_lists_every_field(site, model):
    page = _page(site, "reference/configuration")
    documented = _code_spans(page)
    missing = [name for name in _dotted_fields(model) if name not in documented]
    assert not missing, f"{model.__name__} fields missing from the config reference: {missing}"
    assert f'id="{model.__name__.lower()}"' in page


def test_config_reference_rows_carry_type_default_constraints(site):
    page = _page(site, "reference/configuration")
    row = re.search(r"<td><code>train\.lr</code></td>(.*?)</tr>", page, re.S).group(1)
    assert "<code>float</code>" in row and "<code>0.003</code>" in row and "> 0" in row
    row = re.search(r"<td><code>train\.precision</code></td>(.*?)</tr>", page, re.S).group(1)
    assert "one of" in row and "'bf16'" in row
    row = re.search(r"<td><code>image</code></td>(.*?)</tr>", page, re.S).group(1)
    assert "required" in row


def test_cli_reference_lists_every_command_and_option(site):
    import typer

    from stoker.cli import app

    page = _page(site, "reference/cli")
    documented = _code_spans(page)
    root = typer.main.get_command(app)
    ctx = root.context_class(root, info_name="stoker")
    commands = root.list_commands(ctx)
    assert {"run", "cost-guard", "show-config", "predict"} <= set(commands)
    for name in commands:
        assert f"stoker {name}" in documented, f"command {name} missing from the CLI reference"
        for param in root.get_command(ctx, name).params:
            for opt in param.opts if param.param_type_name == "option" else []:
                assert opt in documented, f"{name} {opt} missing from the CLI reference"


def test_mlflow_reference_names_every_lineage_tag():
    """Every tag the train task sets on a run is documented (and named as documented)."""
    from stoker.data.pull import DatasetRef
    from stoker.images.build import ImageResult
    from stoker.launch.supervisor import lineage_tags

    dataset = DatasetRef(repo_url="r", rev="v1", commit="c", path="p", md5="m", nfiles=1,
                         size_bytes=1, local_path="/d")
    image = ImageResult(ref="h/r:t", digest="sha256:0", content_hash="0" * 64, built=False,
                        size_bytes=None, duration_s=0.0)
    tags = lineage_tags(PipelineConfig(), dataset, 2, image=image, flow_run_id="f",
                        flow_run_url="http://127.0.0.1:4200/runs/flow-run/f")
    documented = (ROOT / "docs" / "reference" / "mlflow.md").read_text()
    missing = [tag for tag in tags if f"`{tag}`" not in documented]
    assert not missing, f"tags missing from docs/reference/mlflow.md: {missing}"
    assert tags["stoker.launcher"] == "local"


def test_readme_is_a_front_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert "```bash\nmake run\nmake test\n```" in readme
    for target in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", readme):
        assert (ROOT / target).is_file(), f"README links to missing {target}"


def test_generator_is_importable_and_agrees_with_the_models(monkeypatch):
    """The hook module works without MkDocs: a plain import, same field list as the models."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_reference",
                                                  ROOT / "docs" / "hooks" / "reference.py")
    reference = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, reference)  # dataclasses look their module up
    spec.loader.exec_module(reference)
    for model in MODELS:
        assert sorted(reference.all_field_names(model)) == sorted(_dotted_fields(model))
    assert "## `stoker predict`" in reference.cli_reference()


def test_a_run_names_its_owner(monkeypatch):
    """On a shared tracking server a run shows who ran it (trial: user "unknown"): the server's
    user when given, else the login name."""
    from stoker.launch.supervisor import run_owner

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    assert run_owner() == "alice"
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME")
    import getpass

    assert run_owner() == getpass.getuser()
