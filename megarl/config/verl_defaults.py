"""verl 0.9.1's default value of every key of its Megatron trainer config, read from the vendored
``data/verl_ppo_megatron_trainer.yaml`` (verl's own generated file; its header names the source).

A verl key megarl's schema lacks is accepted at verl's default: the features megarl does not
have are off there (``qat.enable=false``, ``use_prefix_grouper=false``, ``router_replay.*_file=
null`` ...), so spelling the default out changes nothing. Any other value is refused in one line
naming the value that works (:func:`default_problem`). A verl 0.9 ``${oc.select:key,fallback}``
default matches as written and as verl resolves it in its own tree.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Any

import yaml

VERL_YAML = Path(__file__).parent / "data" / "verl_ppo_megatron_trainer.yaml"
"""verl 0.9.1's ``_generated_ppo_megatron_trainer.yaml``, vendored with its source and version."""

_REF = re.compile(r"\$\{(?:oc\.select:)?\s*([\w.]+)\s*(?:,\s*(.*?))?\s*\}")


def leaves(tree: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a.b": value}`` for every leaf of a nested dict (an empty mapping is a leaf)."""
    out: dict[str, Any] = {}
    for name, value in tree.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if isinstance(value, dict) and value:
            out.update(leaves(value, key))
        else:
            out[key] = value
    return out


@cache
def verl_tree() -> dict:
    """verl 0.9.1's Megatron trainer config as written (``${...}`` unresolved)."""
    return yaml.safe_load(VERL_YAML.read_text())


@cache
def verl_defaults() -> dict[str, Any]:
    """Every leaf key of verl 0.9.1's Megatron trainer config -> its default as written."""
    return leaves(verl_tree())


@cache
def verl_sections() -> frozenset[str]:
    """Every section (non-leaf key) of verl 0.9.1's Megatron trainer config."""
    return frozenset(
        ".".join(key.split(".")[:i])
        for key in verl_defaults()
        for i in range(1, key.count(".") + 1)
    )


def is_verl_key(key: str) -> bool:
    """``key`` is a leaf or a section of verl 0.9.1's Megatron trainer config."""
    return key in verl_defaults() or key in verl_sections()


def resolved_default(key: str, depth: int = 0) -> Any:
    """verl's default of ``key`` with a whole-value ``${...}`` reference resolved in verl's own
    tree (``oc.select`` falls back to its second argument; ``${.x}`` is a sibling)."""
    value = verl_defaults().get(key)
    match = _REF.fullmatch(value) if isinstance(value, str) else None
    if match is None or depth > 8:
        return value
    target, fallback = match.groups()
    if target.startswith("."):
        target = key.rsplit(".", 1)[0] + target
    if target in verl_defaults():
        return resolved_default(target, depth + 1)
    if target in verl_sections():
        return {k[len(target) + 1 :]: v for k, v in verl_defaults().items()
                if k.startswith(target + ".")}  # fmt: skip
    return yaml.safe_load(fallback) if fallback else None


def _same(given: Any, default: Any) -> bool:
    if isinstance(default, bool) or isinstance(given, bool):
        words = {"true": True, "false": False}
        g = words.get(given.strip().lower(), given) if isinstance(given, str) else given
        return isinstance(g, bool) and g == default
    if isinstance(default, (int, float)) and isinstance(given, str):
        try:
            return float(given) == default
        except ValueError:
            return False
    if isinstance(default, list) and isinstance(given, (list, tuple)):
        return len(given) == len(default) and all(map(_same, given, default))
    if isinstance(default, dict) and isinstance(given, dict):
        return given.keys() == default.keys() and all(_same(given[k], default[k]) for k in given)
    return given == default


def matches_default(key: str, value: Any) -> bool:
    """``value`` is verl's default of leaf ``key``, as written or resolved."""
    written = verl_defaults().get(key)
    if _same(value, written):
        return True
    resolved = resolved_default(key)
    if isinstance(resolved, dict) and value is None:  # ${oc.select:a.section, null}
        return True
    return resolved is not written and _same(value, resolved)


def show(value: Any) -> str:
    """A value as a command line writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        return yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return str(value)


def differing(key: str, value: Any) -> list[tuple[str, Any]]:
    """The leaves of ``value`` given at verl key or section ``key`` that are not verl's default
    (each ``(dotted key, value)``); a leaf verl's config does not have counts as differing."""
    if key in verl_defaults():
        return [] if matches_default(key, value) else [(key, value)]
    if not isinstance(value, dict):  # a section given as a value
        return [] if value is None else [(key, value)]
    out: list[tuple[str, Any]] = []
    for name, inner in value.items():
        out.extend(differing(f"{key}.{name}", inner))
    return out


def default_problem(key: str, value: Any, reason: str, where: str = "") -> str | None:
    """None when ``value`` at verl key or section ``key`` is verl's default throughout; else one
    line: the first differing key and value, why megarl lacks it, and the value that works."""
    diff = differing(key, value)
    if not diff:
        return None
    leaf, given = diff[0]
    if leaf in verl_defaults():
        works = f"; verl's default {show(verl_defaults()[leaf])} is accepted"
    else:
        works = ""
    return f"unsupported: {leaf}={show(given)}{where} ({reason}{works})"
