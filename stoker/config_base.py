"""The machinery under every Stoker config: frozen pydantic models that refuse inf, NaN and a
boolean for a number, one-line errors that name each field (``train.lr: must be > 0, got -1``),
and the loader that merges defaults, a YAML file and dotted overrides (OmegaConf).

Imports no Prefect and nothing of Stoker's: the training runtime uses it in the image.
"""

from __future__ import annotations

import difflib
import re
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator


class ConfigError(ValueError):
    """A configuration value is invalid; the message names each offending field."""


def _takes_numbers_not_bools(annotation: Any) -> bool:
    """Whether a field typed ``annotation`` takes an int or float but no bool."""
    found: set[Any] = set()
    stack = [annotation]
    while stack:
        kind = stack.pop()
        found.add(kind)
        stack.extend(typing.get_args(kind))
    return bool(found & {int, float}) and not found & {bool, Any}


class _Frozen(BaseModel):
    # No inf/NaN floats: `train.lr=inf` must be refused, not train to NaN.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info) -> Any:
        """``train.epochs=true`` is refused (pydantic would read it as 1)."""
        if isinstance(value, bool) and _takes_numbers_not_bools(
                cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, got {str(value).lower()}")
        return value


_FIELD_MESSAGE = re.compile(r"^([a-z_][a-z0-9_.]*): (.+)$", re.S)


def _field_names(model: type[BaseModel] | None, path: tuple) -> list[str]:
    """The field names of the model found at ``path`` inside ``model`` ([] when unknown)."""
    for part in path:
        field = getattr(model, "model_fields", {}).get(str(part))
        if field is None:
            return []
        options = [field.annotation, *typing.get_args(field.annotation)]
        model = next((t for t in options if isinstance(t, type) and issubclass(t, BaseModel)),
                     None)
    return list(getattr(model, "model_fields", {}))


def _unknown_field(model: type[BaseModel] | None, loc: tuple) -> str:
    close = difflib.get_close_matches(str(loc[-1]), _field_names(model, loc[:-1]), n=1)
    return f"unknown field; did you mean {close[0]!r}?" if close else "unknown field"


def format_validation_error(error: ValidationError, prefix: str = "",
                            model: type[BaseModel] | None = None) -> str:
    """Render a pydantic error as one line per field: ``train.lr: must be > 0, got -1``;
    with ``model``, an unknown field names the closest known one (``did you mean 'epochs'?``)."""
    lines = []
    for item in error.errors():
        loc = ".".join(str(part) for part in item["loc"] if part != "__root__")
        name = f"{prefix}{loc}" if loc else prefix.rstrip(".") or "config"
        message = item["msg"].removeprefix("Value error, ")
        named = _FIELD_MESSAGE.match(message) if item["type"] == "value_error" else None
        if named:  # a model validator naming its field: `train.` + `global_batch_size: ...`
            name = f"{name}.{named[1]}" if loc else f"{prefix}{named[1]}"
            message = named[2]
        elif (item["type"] not in ("missing", "extra_forbidden") and "input" in item and loc
              and "got " not in message and not isinstance(item["input"], dict | list)):
            message = f"{message}, got {item['input']!r}"
        if item["type"] == "extra_forbidden":
            message = _unknown_field(model, item["loc"])
        elif item["type"] == "string_type" and isinstance(item.get("input"), int | float | bool):
            kind = "boolean" if isinstance(item["input"], bool) else "number"
            message += f" (YAML read it as a {kind}: quote it, e.g. " \
                       f"{name}=\"'{item['input']}'\")"
        line = f"{name}: {message}"
        if line not in lines:  # a union field reports once per member
            lines.append(line)
    return "; ".join(lines)


def validate(model: type[BaseModel], values: dict[str, Any], prefix: str = ""):
    """Build ``model`` from plain values, raising ConfigError that names each bad field."""
    try:
        return model.model_validate(values)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, prefix, model)) from None


def load_config(model: type[BaseModel], config_file: Path | None = None,
                overrides: list[str] | None = None, defaults: dict | None = None):
    """Merge ``model``'s defaults, a YAML file and ``a.b=value`` overrides into a validated model.

    Args:
        model: the pydantic model to build.
        config_file: a YAML file of fields, or None.
        overrides: ``a.b=value`` items; they win over the file.
        defaults: nested values that replace ``model``'s own defaults (the file and the
            overrides win over them), e.g. from the environment.

    Raises:
        ConfigError: the file is missing or not a mapping, an override is malformed, or a value
            fails validation (the message names the field).
    """
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    layers = [OmegaConf.create(defaults)] if defaults else []
    if config_file is not None:
        if not Path(config_file).is_file():
            raise ConfigError(f"config file {config_file}: not found")
        try:
            loaded = OmegaConf.load(config_file)
        except (yaml.YAMLError, OmegaConfBaseException, UnicodeDecodeError, OSError) as e:
            raise ConfigError(f"config file {config_file}: not valid YAML: {e}") from None
        if not OmegaConf.is_dict(loaded):
            raise ConfigError(f"config file {config_file}: must hold a mapping of fields")
        layers.append(loaded)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected field=value, e.g. train.epochs=3")
    try:
        layers.append(OmegaConf.from_dotlist(list(overrides or [])))
        merged = OmegaConf.to_container(OmegaConf.merge(*layers) if layers else OmegaConf.create())
    except OmegaConfBaseException as e:
        raise ConfigError(f"config: {e}") from None
    return validate(model, merged)


def refuse_option_like(value: str | None, reader: str, instead: str) -> str | None:
    """``value`` unchanged, or ValueError when it starts with ``-``: given on a command line
    (git, DVC, ssh, srun), it would be read as an option, not a value (``--upload-pack=...``).
    The runtime also passes ``--`` before such values; this names the field at config time.

    Args:
        value: the user's value (None passes).
        reader: the program that would read it (``git``).
        instead: what to write instead (``a folder named -x is written ./-x``).

    Raises:
        ValueError: one line naming the reader and what to write instead.
    """
    if value is not None and value.lstrip().startswith("-"):
        raise ValueError(f"starts with '-', which {reader} would read as an option; {instead}")
    return value


def refuse_option_like_host(url: str | None, reader: str) -> str | None:
    """``url`` unchanged, or ValueError when its host (``ssh://-oProxyCommand=x/repo``,
    ``git@-host:repo``) starts with ``-``: ssh would read it as an option.

    Raises:
        ValueError: naming the host.
    """
    if url is None:
        return url
    text = url.strip()
    if "://" in text:
        netloc = text.split("://", 1)[1].split("/", 1)[0]
    elif re.match(r"^[^/:]+@[^/:]+:", text):  # scp-like user@host:path
        netloc = text.split(":", 1)[0]
    else:
        return url
    from urllib.parse import unquote

    user, _, host = netloc.rpartition("@")
    for part, name in ((user, "user"), (host, "host")):
        # as git reads it: percent-decoded (%2D is '-'), an IPv6-style [host] unbracketed
        part = unquote(part).lstrip("[")
        if part.startswith("-"):
            raise ValueError(f"its {name} {part!r} starts with '-', which {reader} would read "
                             "as an option; no host or user name starts with '-'")
    return url


# Query parameters that carry a secret (signed URLs, tokens): never stored with the URL.
_SECRET_PARAMETERS = frozenset({
    "token", "access_token", "auth", "password", "passwd", "pwd", "secret", "api_key", "apikey",
    "key", "sig", "signature", "x-amz-signature", "x-amz-credential", "x-amz-security-token",
    "x-goog-signature", "x-goog-credential"})


def url_credentials(url: str) -> str | None:
    """What credential ``url`` carries, in words (``a password``, ``a user name (token)``,
    ``the query parameter 'token'``), or None when it carries none. An ``ssh://git@host`` or
    ``git@host:path`` user is no credential; any user of an http(s) URL is (a token given as
    the user name, GitHub's way)."""
    from urllib.parse import parse_qsl, urlsplit

    try:
        parts = urlsplit(url.strip())
        password, user = parts.password, parts.username
    except ValueError:  # an unparsable port or netloc: no credential can be read from it
        return None
    if password:
        return "a password"
    if user and parts.scheme.lower() in ("http", "https"):
        return "a user name (a token)"
    for name, _value in parse_qsl(parts.query, keep_blank_values=True):
        if name.lower() in _SECRET_PARAMETERS:
            return f"the query parameter {name!r}"
    return None


def refuse_url_credentials(url: str | None, where: str) -> str | None:
    """``url`` unchanged, or ValueError when it carries a credential (:func:`url_credentials`):
    a URL is recorded (Prefect parameters, MLflow tags, the job's records, logs), so its
    credentials belong in the environment; ``where`` says which variables take them."""
    if url is not None and (found := url_credentials(url)) is not None:
        raise ValueError(f"holds {found}, and this URL is recorded (Prefect parameters, MLflow "
                         f"tags, the job's records, logs): give the URL without it and the "
                         f"credential {where}; got {masked_url(url)}")
    return url


def masked_url(url: str) -> str:
    """``url`` with its credentials as ``***`` (user and password, secret query values), for a
    message that quotes it."""
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    try:
        parts = urlsplit(url.strip())
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<a URL that cannot be parsed>"
    netloc = f"***@{host}{port}" if parts.username or parts.password else parts.netloc
    query = urlencode([(k, "***" if k.lower() in _SECRET_PARAMETERS else v)
                       for k, v in parse_qsl(parts.query, keep_blank_values=True)], safe="*")
    fragment = "***" if parts.fragment else ""  # never sent to a server; may hold a token
    return urlunsplit((parts.scheme, netloc, parts.path, query, fragment))
