"""Loading a config: YAML files with ``_base_`` inheritance, dotted overrides, type coercion.

Precedence, lowest first: dataclass defaults; each YAML file's ``_base_`` files (recursively, in
list order); the file itself; further ``--config`` files in order; the command-line overrides in
order. Then unset keys take their source's value (``FOLLOWS``) and ``${...}`` references are
resolved. Every problem found on the way is raised as one ``ConfigError``.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import types
from functools import cache, lru_cache
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from megarl.config.errors import ConfigError, close_matches, did_you_mean
from megarl.config.interpolation import Reference, get_key, is_whole_reference, resolve_references
from megarl.config.keys import resolve_follows
from megarl.config.schema import MegarlConfig
from megarl.config.spellings import ECHOES, check_echoes, pop_echoes, resolve_spellings
from megarl.config.verl_defaults import default_problem, is_verl_key, verl_defaults
from megarl.config.verl_keys import unsupported_reason

BASE_KEY = "_base_"
"""Top-level YAML key naming the file(s) a config inherits from (relative to that file)."""

_NULL_WORDS = {"null", "none", "~"}
_TRUE_WORDS = {"true", "yes", "on", "1"}
_FALSE_WORDS = {"false", "no", "off", "0"}
_INVALID = object()  # conversion failed; the caller records the generic type error
_REPORTED = object()  # conversion failed and the error is already recorded
_OVERRIDE = re.compile(r"(\+\+|\+|~)?([\w\-]+(?:\.[\w\-]+)*)(?:=(.*))?", re.DOTALL)

# Keys verl users may bring along that megarl names or handles differently (matched by last
# segment); the message replaces the generic "did you mean".
_KEY_HINTS = {
    "defaults": "Hydra defaults lists are not supported; inherit from a file with "
    "'_base_: file.yaml'",
    "fsdp_config": "megarl trains with Megatron only; set the layout in the section's "
    "'megatron' keys",
    "megatron_config": "this section is called 'megatron' (as in current verl)",
    "ppo_micro_batch_size": "global micro-batch sizes (deprecated in verl) are not supported; use "
    "ppo_micro_batch_size_per_gpu",
    "log_prob_micro_batch_size": "global micro-batch sizes (deprecated in verl) are not "
    "supported; use log_prob_micro_batch_size_per_gpu",
    "grad_clip": "gradient clipping is '<actor or critic>.optim.clip_grad' (verl's current name)",
    "warmup_steps": "use 'optim.lr_warmup_steps' (or optim.lr_warmup_steps_ratio)",
    "logprob_mode": "use 'algorithm.rollout_correction.bypass_mode' (true: vLLM's log-probs) "
    "and 'algorithm.rollout_correction.rollout_is' for importance weights",
    "is_threshold": "use 'algorithm.rollout_correction.rollout_is_threshold'",
    "seed": "the global seed is trainer.seed",
    "dtype": "the training and rollout dtype is trainer.dtype (bf16 or fp32)",
    "gradient_checkpointing": "activation recompute is "
    "'<actor or critic>.megatron.recompute_granularity' (full or selective)",
    "hybrid_engine": "megarl always colocates rollout and training",
}


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------


def load_config(
    paths: list[str | os.PathLike] | str | os.PathLike, overrides: list[str] | tuple = ()
) -> MegarlConfig:
    """Read YAML file(s) (merged in order), apply dotted ``overrides``, coerce and check types.

    Raises ``ConfigError`` naming every unknown key, badly typed value or malformed override.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    raw: dict = {}
    for path in paths:
        raw = merge(raw, read_yaml(path))
    errors: list[str] = []
    for text in overrides:
        apply_override(raw, text, errors)
    cfg = _from_raw(raw, errors)
    if errors:
        raise ConfigError(errors)
    return cfg


def from_dict(data: dict) -> MegarlConfig:
    """Build a config from a plain nested dict (as ``to_dict`` returns or a YAML file holds)."""
    errors: list[str] = []
    cfg = _from_raw(copy.deepcopy(data), errors)
    if errors:
        raise ConfigError(errors)
    return cfg


def resolve_config(cfg: MegarlConfig) -> MegarlConfig:
    """Complete a config built in code (``MegarlConfig()``, edited fields) as loading does: unset
    keys follow their sources, ``${...}`` references are substituted. In place; returns ``cfg``.

    ``resolve_config(MegarlConfig())`` equals ``load_config`` of an empty file.
    """
    errors: list[str] = []
    _resolve(cfg, errors)
    if errors:
        raise ConfigError(errors)
    return cfg


def to_dict(cfg: Any) -> dict:
    """The config as plain nested dicts and lists."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML; ``load_config`` of it gives an equal config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True)


def read_yaml(path: str | os.PathLike, _chain: tuple[Path, ...] = ()) -> dict:
    """One YAML file with its ``_base_`` files merged underneath it."""
    path = Path(path).expanduser()
    resolved = path.resolve()
    if resolved in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, resolved))
        raise ConfigError(f"{BASE_KEY} inheritance cycle: {cycle}")
    if not path.is_file():
        where = f" (named in {BASE_KEY} of {_chain[-1]})" if _chain else ""
        if path.is_dir():
            inside = sorted(p.name for p in path.glob("*.y*ml"))
            more = ", ..." if len(inside) > 3 else ""
            hint = f" (it holds {', '.join(inside[:3])}{more})" if inside else ""
            raise ConfigError(f"{path} is a directory, not a config file{where}{hint}")
        raise ConfigError(f"config file not found: {path}{where}")
    try:
        stat = path.stat()
        data = copy.deepcopy(_parse_yaml(resolved, stat.st_mtime_ns, stat.st_size))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {_show(data)}")
    bases = data.pop(BASE_KEY, None) or []
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path}: {BASE_KEY} must be a file name or a list of file names")
    merged: dict = {}
    for base in bases:
        merged = merge(
            merged, read_yaml(path.parent / Path(base).expanduser(), (*_chain, resolved))
        )
    return merge(merged, data)


@lru_cache(maxsize=64)
def _parse_yaml(path: Path, mtime_ns: int, size: int) -> Any:
    """One file's YAML, parsed once per version (mtime, size); callers get a deep copy."""
    return yaml.safe_load(path.read_text())


def merge(base: dict, top: dict) -> dict:
    """Deep merge: mappings merge key by key, anything else in ``top`` replaces ``base``."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def apply_override(raw: dict, text: str, errors: list[str]) -> None:
    """Apply one ``key=value`` / ``+key=value`` / ``~key`` override to the raw dict."""
    match = _OVERRIDE.fullmatch(text.strip())
    if not match:
        errors.append(
            f"override {text!r} is not of the form key=value (e.g. data.train_batch_size=64)"
        )
        return
    prefix, key, value = match.groups()
    prefix = prefix or ""
    if value is None and prefix != "~":
        errors.append(f"override {text!r} has no '=value' (e.g. {key}=1; '~{key}' removes it)")
        return
    parts = key.split(".")
    if key in ECHOES and prefix != "~":  # checked against trainer.* once built, then dropped
        _set_path(raw, parts, parse_override_value(value, Any))
        return
    kind, tp, index = _lookup(parts)
    if kind == "unknown":
        if prefix != "~" and is_verl_key(key):  # accepted at verl's default, changing nothing
            problem = verl_key_problem(key, parse_override_value(value, Any))
            if problem is not None:
                errors.append(problem)
            return
        errors.append(unknown_key_message(".".join(parts[: index + 1]), f" in override {text!r}"))
        return
    if prefix == "~":
        _delete_path(raw, parts)
        return
    if (
        kind == "free"
        and not prefix
        and not _has_path(raw, parts)
        and not _in_default(parts, index)
        and key not in verl_defaults()
    ):
        section = ".".join(parts[:index])
        errors.append(
            f"override {text!r}: '{key}' is not in the free-form section '{section}'; "
            f"add it with '+{key}={value}'"
        )
        return
    parsed = parse_override_value(value, tp if kind == "field" else Any)
    current = _get_path(raw, parts)
    if isinstance(parsed, dict) and isinstance(current, dict):
        parsed = merge(current, parsed)  # section={a: 1} updates the section, as a file would
    _set_path(raw, parts, parsed)


def parse_override_value(text: str, tp: Any) -> Any:
    """Parse a command-line value: strings stay verbatim for string keys, else YAML syntax."""
    stripped = text.strip()
    inner, optional = _strip_optional(tp)
    if _is_string_type(inner):
        if optional and stripped.lower() in _NULL_WORDS:
            return None
        if len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\"":
            return stripped[1:-1]
        return stripped
    try:
        return yaml.safe_load(stripped) if stripped else ""
    except yaml.YAMLError:
        return stripped


def verl_key_problem(key: str, value: Any) -> str | None:
    """A key of verl's config that megarl's schema lacks: None at verl's default (it changes
    nothing), else one line naming the key, why megarl lacks it and the value that works."""
    reason = unsupported_reason(key) or "not a key megarl has"
    return default_problem(key, value, reason)


def unknown_key_message(key: str, where: str = "") -> str:
    """``unsupported: a.b.c (reason)`` for a verl key megarl lacks (:mod:`megarl.config.verl_keys`),
    else ``unknown key 'a.b.c'`` with a hint, a "did you mean", or the valid keys of the section."""
    parts = key.split(".")
    leaf, parent = parts[-1], ".".join(parts[:-1])
    msg = f"unknown key '{key}'{where}"
    kind, tp, _ = _lookup(parts[:-1])
    if kind == "field" and not dataclasses.is_dataclass(tp):
        return f"'{parent}' is a value, not a section, so '{key}'{where} does not exist"
    reason = unsupported_reason(key)
    if reason is not None:
        return f"unsupported: {key}{where} ({reason})"
    if leaf in _KEY_HINTS:
        return f"{msg}: {_KEY_HINTS[leaf]}"
    siblings = [f.name for f in dataclasses.fields(tp)] if dataclasses.is_dataclass(tp) else []
    hint = did_you_mean(leaf, siblings, prefix=f"{parent}." if parent else "")
    if hint:
        return msg + hint
    same_leaf = [k for k in all_keys() if k.rsplit(".", 1)[-1] == leaf]
    if not same_leaf:
        leaves = {k.rsplit(".", 1)[-1] for k in all_keys()}
        same_leaf = [k for k in all_keys() if k.rsplit(".", 1)[-1] in close_matches(leaf, leaves)]
    if same_leaf:
        return f"{msg} (did you mean {' or '.join(repr(k) for k in same_leaf[:3])}?)"
    if siblings:
        return f"{msg}; the keys of '{parent or 'the top level'}' are: {', '.join(siblings)}"
    return msg


@cache
def all_keys() -> tuple[str, ...]:
    """Every dotted key of the schema, sections included."""
    keys: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, tp in _hints(cls).items():
            keys.append(prefix + name)
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{name}.")

    walk(MegarlConfig, "")
    return tuple(keys)


def set_key(cfg: Any, key: str, value: Any) -> None:
    """Set the value at dotted ``key`` of a built config."""
    parent, _, leaf = key.rpartition(".")
    obj = get_key(cfg, parent) if parent else cfg
    if isinstance(obj, dict):
        obj[leaf] = value
    else:
        setattr(obj, leaf, value)


# ---------------------------------------------------------------------------------------------
# building the dataclass tree
# ---------------------------------------------------------------------------------------------


def _from_raw(raw: dict, errors: list[str]) -> MegarlConfig:
    echoes = pop_echoes(raw)
    cfg = _build(MegarlConfig, raw, "", errors)
    resolve_references(cfg, errors, _coerce_reference, all_keys(), whole_only=True)
    _resolve(cfg, errors)
    check_echoes(cfg, echoes, errors)
    return cfg


def _resolve(cfg: MegarlConfig, errors: list[str]) -> None:
    """The one place a built config is completed: keys given two ways become one
    (:mod:`megarl.config.spellings`), keys left unset (None) take their sources' values
    (``FOLLOWS``), then ``${...}`` references are substituted."""
    resolve_spellings(cfg, errors)
    resolve_follows(cfg)
    resolve_references(cfg, errors, _coerce_reference, all_keys(), whole_only=False)


def _build(cls: type, raw: Any, path: str, errors: list[str], default: Any = None) -> Any:
    """``cls`` from a raw section; keys it does not set keep ``default``'s values (the owning
    field's default, e.g. the critic's optimizer with its own lr), else ``cls``'s defaults."""
    if raw is None:  # an empty section ("critic:") keeps its defaults
        raw = {}
    if not isinstance(raw, dict):
        errors.append(f"{path or 'the top level'}: expected a section (mapping), got {_show(raw)}")
        raw = {}
    hints = _hints(cls)
    kwargs = {}
    for name, value in raw.items():
        key = _join(path, str(name))
        if name not in hints:
            problem = verl_key_problem(key, value) if is_verl_key(key) else unknown_key_message(key)
            if problem is not None:
                errors.append(problem)
            continue
        if (
            value is None
            and verl_defaults().get(key, 0) is None
            and not _strip_optional(hints[name])[1]
        ):
            continue  # verl's legacy null: unset (e.g. reward_model.enable, read from reward.*)
        coerced = _coerce(hints[name], value, key, errors, _field_default(cls, str(name)))
        if coerced is not _INVALID:
            kwargs[name] = coerced
    return cls(**kwargs) if default is None else dataclasses.replace(default, **kwargs)


def _field_default(cls: type, name: str) -> Any:
    """The default value of field ``name`` of dataclass ``cls`` (None if it has none)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _coerce(tp: Any, value: Any, key: str, errors: list[str], default: Any = None) -> Any:
    """``value`` converted to type ``tp``, or ``_INVALID`` after recording an error."""
    if tp is Any:
        return copy.deepcopy(value)
    if is_whole_reference(value) and not dataclasses.is_dataclass(tp):
        return Reference(value, tp)  # typed once the tree is built (resolve_references)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key, errors, default)
    inner, optional = _strip_optional(tp)
    if optional:
        if value is None or (isinstance(value, str) and value.strip().lower() in _NULL_WORDS):
            return None
        tp = inner
    converted = _convert(tp, value, key, errors)
    if converted is _INVALID:
        null = "null or " if optional else ""
        errors.append(f"{key}: expected {null}{_describe(tp)}, got {_show(value)}")
    return _INVALID if converted is _REPORTED else converted


def _convert(tp: Any, value: Any, key: str, errors: list[str]) -> Any:
    origin = get_origin(tp)
    if origin is Literal:
        choices = get_args(tp)
        if isinstance(value, str) and value in choices:
            return value
        hint = did_you_mean(str(value), [str(c) for c in choices])
        errors.append(f"{key}: {_show(value)} is not one of {', '.join(map(str, choices))}{hint}")
        return _REPORTED
    if origin is list:
        (item_tp,) = get_args(tp) or (Any,)
        value = _quoted_list(value)
        items = value if isinstance(value, (list, tuple)) else [value]
        if isinstance(value, dict) or value is None:
            return _INVALID
        out = [_coerce(item_tp, v, f"{key}[{i}]", errors) for i, v in enumerate(items)]
        return _REPORTED if any(v is _INVALID for v in out) else out
    if origin is dict or tp is dict:
        return copy.deepcopy(value) if isinstance(value, dict) else _INVALID
    if tp is bool:
        if isinstance(value, bool):
            return value
        word = str(value).strip().lower() if isinstance(value, (str, int)) else None
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
        return _INVALID
    if tp is int:
        if isinstance(value, bool):
            return _INVALID
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                try:
                    value = float(value)
                except ValueError:
                    return _INVALID
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return _INVALID
    if tp is float:
        if isinstance(value, bool):
            return _INVALID
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                return _INVALID
        return _INVALID
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        return _INVALID
    raise TypeError(f"unsupported config field type {tp!r} at {key}")  # a schema bug


def _coerce_reference(tp: Any, value: Any, key: str, errors: list[str]) -> Any:
    """A whole ``${...}`` reference's value converted to its field's type (None if it fails)."""
    out = _coerce(tp, value, key, errors)
    return None if out is _INVALID else out


# ---------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _lookup(parts: list[str]) -> tuple[str, Any, int]:
    """Walk the schema along ``parts``.

    Returns ``("field", type, n)`` when all parts name a schema key, ``("free", type, i)`` when
    ``parts[i:]`` lie inside a free-form (dict) section, ``("unknown", type, i)`` when
    ``parts[i]`` is not a key of the section reached so far.
    """
    tp: Any = MegarlConfig
    for i, part in enumerate(parts):
        if dataclasses.is_dataclass(tp):
            hints = _hints(tp)
            if part not in hints:
                return "unknown", tp, i
            tp = hints[part]
        elif tp is dict or get_origin(tp) is dict:
            return "free", tp, i
        else:
            return "unknown", tp, i
    return "field", tp, len(parts)


def _quoted_list(value: Any) -> Any:
    """A list given as one quoted string (verl 0.9's ``trainer.logger='["console","wandb"]'``
    when the shell keeps the quotes, or a YAML file quotes it): the list; anything else as is."""
    text = value.strip().strip("'\"").strip() if isinstance(value, str) else ""
    if not (text.startswith("[") and text.endswith("]")):
        return value
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError:
        return value
    return parsed if isinstance(parsed, list) else value


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) < len(get_args(tp)):
            return (args[0] if len(args) == 1 else Union[tuple(args)]), True  # noqa: UP007
    return tp, False


def _is_string_type(tp: Any) -> bool:
    return tp is str or (
        get_origin(tp) is Literal and all(isinstance(a, str) for a in get_args(tp))
    )


def _describe(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(map(str, get_args(tp)))
    if get_origin(tp) is list:
        return f"a list of {_describe(get_args(tp)[0]).removeprefix('a ').removeprefix('an ')}s"
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    if tp in names:
        return names[tp]
    return "a mapping" if (tp is dict or get_origin(tp) is dict) else str(tp)


def _show(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (dict, list)):
        return f"a {type(value).__name__.replace('dict', 'mapping')} {value!r}"
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...").strip()


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _in_default(parts: list[str], index: int) -> bool:
    """The free-form field ``parts[:index]`` has the key ``parts`` in its default value (e.g.
    ``reward.reward_kwargs.overlong_buffer_cfg.enable``, as verl's DAPO config has it)."""
    owner = MegarlConfig()
    for part in parts[:index]:
        owner = getattr(owner, part) if dataclasses.is_dataclass(owner) else None
    return _has_path(owner, parts[index:])


def _has_path(raw: Any, parts: list[str]) -> bool:
    for part in parts:
        if not isinstance(raw, dict) or part not in raw:
            return False
        raw = raw[part]
    return True


def _get_path(raw: Any, parts: list[str]) -> Any:
    for part in parts:
        if not isinstance(raw, dict) or part not in raw:
            return None
        raw = raw[part]
    return raw


def _set_path(raw: dict, parts: list[str], value: Any) -> None:
    for part in parts[:-1]:
        if not isinstance(raw.get(part), dict):
            raw[part] = {}
        raw = raw[part]
    raw[parts[-1]] = value


def _delete_path(raw: dict, parts: list[str]) -> None:
    for part in parts[:-1]:
        raw = raw.get(part)
        if not isinstance(raw, dict):
            return
    raw.pop(parts[-1], None)
