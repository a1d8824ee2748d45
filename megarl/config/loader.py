"""YAML + dotted command-line overrides -> a validated MegarlConfig (OmegaConf structured configs)."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from megarl.config import device_defaults
from megarl.config.schema import POLICY_DEFAULTED, ConfigFieldError, MegarlConfig


class ConfigError(ValueError):
    """A config could not be loaded; the message names the key and the fix."""


def load_config(yaml_path: str | None = None, overrides: list[str] = (), *, cuda: bool | None = None) -> MegarlConfig:
    """Merge the YAML file and ``a.b=value`` overrides onto the schema and return the typed config, its 'auto'
    settings resolved for ``cuda`` (default: this machine; ``megarl.config.device_defaults``).

    Unknown keys, wrong types and field-local checks fail here with a ConfigError naming the key.
    """
    return load_config_and_defaults(yaml_path, overrides, cuda=cuda)[0]


def load_config_and_defaults(
    yaml_path: str | None = None, overrides: list[str] = (), *, cuda: bool | None = None
) -> tuple[MegarlConfig, list[str]]:
    """``load_config``, and one line per setting the device chose (``model.dtype=bfloat16``): what was left 'auto'."""
    cfg = _build(MegarlConfig, _merge_raw(yaml_path, overrides), "")
    return cfg, device_defaults.resolve(cfg, device_defaults.on_cuda() if cuda is None else cuda)


def _merge_raw(yaml_path, overrides) -> dict:
    schema = OmegaConf.structured(MegarlConfig)
    for name in POLICY_DEFAULTED:  # the default instance filled them for ppo: unset again, so a recipe's loss decides
        schema.actor[name] = None
    layers = [OmegaConf.create(_keyword_keys(data)) for data in _yaml_layers(yaml_path)] if yaml_path else []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value (e.g. actor.parallel.tp=2)")
        key, _, value = item.partition("=")
        key = KEYWORD_KEYS.get(key.strip(), key.strip())
        if value.strip().lower() in YAML11_BOOL_WORDS:  # a word, as in a recipe (a bool field still reads it)
            value = f"'{value.strip()}'"
        layers.append(OmegaConf.from_dotlist([f"{key}={value}"]))
    try:
        merged = OmegaConf.merge(schema, *layers)
    except ConfigKeyError as e:
        raise ConfigError(_unknown_key_message(e)) from None
    except (ValidationError, OmegaConfBaseException) as e:
        raise ConfigError(f"{e.full_key}: {e.msg.splitlines()[0]}") from None
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        key = missing[0]
        raise ConfigError(f"{key}: required but not set (set it in the YAML or as {key}.<field>=...)")
    return OmegaConf.to_container(merged, resolve=True)


YAML11_BOOL_WORDS = ("yes", "no", "on", "off", "y", "n")
"""Words YAML 1.1 reads as booleans; a recipe (and an override) keeps them as words, as YAML 1.2 does: the modes
named ``off`` (``algorithm.rollout_is``, ``actor.moe_routing_replay``) stay themselves, and a bool field still takes
them (OmegaConf converts ``off``, ``yes``, ... for it). Only ``true`` and ``false`` are booleans."""


class RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans (``YAML11_BOOL_WORDS`` stay strings)."""


RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


KEYWORD_KEYS = {"env.class": "env.class_"}
"""Recipe keys that are Python keywords -> their schema field."""


def _keyword_keys(data: dict) -> dict:
    """A recipe's mapping with ``KEYWORD_KEYS`` renamed to their fields."""
    for dotted, field_name in KEYWORD_KEYS.items():
        section, key = dotted.split(".")
        node = data.get(section)
        if isinstance(node, dict) and key in node:
            node[field_name.split(".")[1]] = node.pop(key)
    return data


BASE_KEY = "base"
"""A recipe may start from another: ``base: quickstart.yaml`` (relative to the recipe) is merged first."""


def _yaml_layers(path: str, seen: tuple[str, ...] = ()) -> list[dict]:
    """The recipe's YAML mappings, its ``base`` chain first."""
    if not os.path.isfile(path):
        raise ConfigError(f"recipe not found: {path}")
    if os.path.abspath(path) in seen:
        raise ConfigError(f"{path}: 'base' chain loops back to itself")
    with open(path) as f:
        try:
            data = yaml.load(f, Loader=RecipeLoader) or {}
        except yaml.YAMLError as e:
            raise ConfigError(_yaml_error(path, e)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections (model, actor, trainer)")
    base = data.pop(BASE_KEY, None)
    if base is None:
        return [data]
    base_path = os.path.join(os.path.dirname(path), base)
    return _yaml_layers(base_path, (*seen, os.path.abspath(path))) + [data]


def _yaml_error(path: str, e: yaml.YAMLError) -> str:
    """'FILE:LINE:COL: problem' (1-based, as editors count) for a YAML syntax error."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
    hint = "; indent with spaces (YAML forbids tabs)" if "'\\t'" in problem else ""
    return f"{where}: {problem}{hint}"


def _unknown_key_message(e: ConfigKeyError) -> str:
    key = e.full_key or e.key
    parent_type = e.object_type
    hint = ""
    if parent_type is not None and dataclasses.is_dataclass(parent_type):
        names = [f.name for f in dataclasses.fields(parent_type)]
        close = difflib.get_close_matches(str(e.key), names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else f" Valid keys: {', '.join(names)}."
    return f"{key}: unknown key.{hint}"


def _optional_dataclass(hint):
    """``X`` for a ``X | None`` hint whose X is a dataclass, else None."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(args) == 1 and type(None) in typing.get_args(hint) and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _dict_of_dataclass(hint):
    """``X`` for a ``dict[str, X]`` hint whose X is a dataclass, else None."""
    if typing.get_origin(hint) is dict and dataclasses.is_dataclass(typing.get_args(hint)[1]):
        return typing.get_args(hint)[1]
    return None


def _build(cls, data: dict, prefix: str):
    """Instantiate the dataclass tree bottom-up, so each __post_init__ sees final values; errors get their path.
    Every float must be finite (inf and nan parse as floats)."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        sub = hints[f.name]
        value = data[f.name]
        if isinstance(value, float) and not math.isfinite(value):  # no setting means anything at inf or NaN
            raise ConfigError(f"{prefix}{f.name}: must be a finite number, got {value}")
        sub = _optional_dataclass(sub) or sub
        is_node = dataclasses.is_dataclass(sub) and value is not None
        kwargs[f.name] = _build(sub, value, f"{prefix}{f.name}.") if is_node else value
        item = _dict_of_dataclass(sub)
        if item is not None:  # e.g. placement.pools: name -> PoolConfig
            kwargs[f.name] = {k: _build(item, v, f"{prefix}{f.name}.{k}.") for k, v in value.items()}
    try:
        return cls(**kwargs)
    except ConfigFieldError as e:
        raise ConfigError(f"{prefix}{e.field_name}: {e.message}") from None


def to_yaml(cfg: MegarlConfig) -> str:
    """The effective config, for logs and checkpoint metadata."""
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
