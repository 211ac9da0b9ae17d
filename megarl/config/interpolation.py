"""``${...}`` references in config values, as verl's OmegaConf writes them.

- ``${a.b}``: the value of key ``a.b``; ``${.b}``: key ``b`` of the same section;
- ``${oc.select:a.b,fallback}``: ``a.b``, or ``fallback`` when megarl has no such key;
- ``${oc.env:VAR,default}`` (or ``${env:...}``): an environment variable.

A value that is one whole reference takes the referenced value with its type (``${oc.select:
actor_rollout_ref.actor.use_dynamic_bsz,false}`` is a boolean): the loader keeps it as a
:class:`Reference` until the tree is built, then converts the value it names to the field's type.
References inside a longer string are substituted as text.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

import yaml

from megarl.config.errors import did_you_mean

_INTERPOLATION = re.compile(r"\$\{([^}]*)\}")
_MISSING = object()


@dataclass(frozen=True)
class Reference:
    """A whole-value ``${...}`` given for a field of type ``tp``, resolved once the tree is built."""

    text: str
    tp: Any


def is_whole_reference(value: Any) -> bool:
    """``value`` is one ``${...}`` and nothing else."""
    text = value.strip() if isinstance(value, str) else ""
    return text.startswith("${") and text.endswith("}") and text.count("${") == 1


def get_key(cfg: Any, key: str) -> Any:
    """The value at dotted ``key`` (through dataclasses and dicts); ``KeyError`` if absent."""
    obj = cfg
    for part in key.split("."):
        if dataclasses.is_dataclass(obj) and part in obj.__dataclass_fields__:
            obj = getattr(obj, part)
        elif isinstance(obj, dict) and part in obj:
            obj = obj[part]
        else:
            raise KeyError(key)
    return obj


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class _Resolver:
    """Resolves every reference of one built config, in place (``coerce(tp, value, key,
    errors)`` converts a whole reference's value to its field's type)."""

    def __init__(self, cfg: Any, errors: list[str], coerce: Any, keys: tuple[str, ...]):
        self.cfg, self.errors, self.coerce, self.keys = cfg, errors, coerce, keys

    def lookup(self, expr: str, key: str, text: str, depth: int) -> Any:
        """The value ``expr`` (the inside of one ``${...}``) names, or ``_MISSING`` (reported)."""
        if expr.startswith(("oc.env:", "env:")):
            name, _, default = expr.split(":", 1)[1].partition(",")
            found = os.environ.get(name.strip())
            if found is not None:
                return found
            if default:
                return default.strip().strip("'\"")
            self.errors.append(f"{key}: environment variable {name.strip()} in '{text}' is not set")
            return _MISSING
        select = expr.startswith("oc.select:")
        target, _, fallback = expr.removeprefix("oc.select:").partition(",")
        target = target.strip()
        if target.startswith("."):  # relative: a key of the same section
            target = _join(key.rsplit(".", 1)[0] if "." in key else "", target.lstrip("."))
        try:
            value = get_key(self.cfg, target)
        except KeyError:
            if select:
                return yaml.safe_load(fallback.strip()) if fallback.strip() else None
            hint = did_you_mean(target, self.keys)
            self.errors.append(f"{key}: '${{{expr}}}' refers to an unknown key{hint}")
            return _MISSING
        if depth > 8:
            self.errors.append(f"{key}: '${{{expr}}}' is part of a reference cycle")
            return _MISSING
        if isinstance(value, Reference):
            value = self.whole(value, target, depth + 1)
        elif isinstance(value, str) and "${" in value:
            value = self.text(value, target, depth + 1)
        return value

    def whole(self, ref: Reference, key: str, depth: int = 0) -> Any:
        value = self.lookup(ref.text.strip()[2:-1].strip(), key, ref.text, depth)
        if value is _MISSING:
            return None
        if dataclasses.is_dataclass(value):
            self.errors.append(f"{key}: '{ref.text}' refers to a section, not a value")
            return None
        return self.coerce(ref.tp, value, key, self.errors)

    def text(self, text: str, key: str, depth: int = 0) -> str:
        def substitute(match: re.Match) -> str:
            expr = match.group(1).strip()
            value = self.lookup(expr, key, text, depth)
            if value is _MISSING:
                return match.group(0)
            if dataclasses.is_dataclass(value) or isinstance(value, (dict, list)):
                self.errors.append(f"{key}: '${{{expr}}}' refers to a section, not a value")
                return match.group(0)
            return "null" if value is None else str(value)

        return _INTERPOLATION.sub(substitute, text)

    def walk(self, obj: Any, key: str) -> Any:
        if isinstance(obj, Reference):
            return self.whole(obj, key)
        if isinstance(obj, str):
            return self.text(obj, key) if "${" in obj else obj
        if isinstance(obj, list):
            return [self.walk(v, f"{key}[{i}]") if _deep(v) else v for i, v in enumerate(obj)]
        if isinstance(obj, dict):
            return {k: self.walk(v, _join(key, str(k))) if _deep(v) else v
                    for k, v in obj.items()}  # fmt: skip
        if dataclasses.is_dataclass(obj):
            for name, value in vars(obj).items():
                if _deep(value):
                    setattr(obj, name, self.walk(value, _join(key, name)))
        return obj


def _deep(value: Any) -> bool:
    """``value`` may hold a reference (a string with ``${``, a container, a section)."""
    if isinstance(value, str):
        return "${" in value
    return isinstance(value, (list, dict, Reference)) or hasattr(
        type(value), "__dataclass_fields__"
    )


def resolve_references(
    cfg: Any, errors: list[str], coerce: Any, keys: tuple[str, ...], *, whole_only: bool
) -> None:
    """Resolve the config's references in place: only the whole-value :class:`Reference` ones
    (``whole_only``; right after building, so that later steps see typed values), or all."""
    resolver = _Resolver(cfg, errors, coerce, keys)
    if not whole_only:
        resolver.walk(cfg, "")
        return

    def walk(obj: Any, key: str) -> None:
        for name, value in vars(obj).items():
            if isinstance(value, Reference):
                setattr(obj, name, resolver.whole(value, _join(key, name)))
            elif dataclasses.is_dataclass(value):
                walk(value, _join(key, name))

    walk(cfg, "")
