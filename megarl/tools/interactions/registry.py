"""Loading interactions from verl's interaction YAML (``interaction_config_path``), as verl's
``verl/interactions/utils/interaction_registry.py``:
``{"interaction": [{"name"?: ..., "class_name": ..., "config": {...}}, ...]}``.

Each class (a dotted path; verl's Gsm8kInteraction maps onto megarl's, see
:data:`megarl.tools.registry.VERL_CLASS_PATHS`) is built as ``cls(config=<config with "name">)``.
Without ``name`` the name is the class name lower-cased, less a trailing ``Interaction``
(``Gsm8kInteraction`` → ``gsm8k``). A duplicate name is refused. Every problem is one
:class:`~megarl.tools.errors.ToolConfigError` line naming the file and the entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from megarl.tools.errors import ToolConfigError
from megarl.tools.interactions.base import BaseInteraction
from megarl.tools.registry import read_yaml_list, resolve_class

__all__ = ["load_interactions"]


def load_interactions(path: str | Path) -> dict[str, BaseInteraction]:
    """The interactions of the file ``path`` by name, built."""
    file, entries = read_yaml_list(path, "interaction", "interaction_config_path")
    interactions: dict[str, BaseInteraction] = {}
    for index, entry in enumerate(entries):
        where = f"{file}: interaction[{index}]"
        if not isinstance(entry, Mapping) or "class_name" not in entry:
            raise ToolConfigError(f"{where}: expected a mapping with class_name and config")
        class_name = entry["class_name"]
        where += f" (class_name {class_name!r})"
        unknown = sorted(set(entry) - {"name", "class_name", "config"})
        if unknown:
            raise ToolConfigError(f"{where}: unknown key(s) {unknown}")
        config = entry.get("config") or {}
        if not isinstance(config, Mapping):
            raise ToolConfigError(f"{where}: config must be a mapping")
        name = entry.get("name")
        if name is None:
            name = str(class_name).rsplit(".", 1)[-1].removesuffix("Interaction").lower()
        if name in interactions:
            raise ToolConfigError(f"{where}: a second interaction named {name!r}")
        cls = resolve_class(class_name, where)
        if not issubclass(cls, BaseInteraction):
            raise ToolConfigError(
                f"{where}: {cls.__module__}.{cls.__qualname__} is not a megarl BaseInteraction "
                "subclass (a verl interaction imports it from megarl.tools.interactions.base)"
            )
        try:
            interactions[name] = cls(config={**config, "name": name})
        except Exception as exc:
            message = str(exc).splitlines()[0] if str(exc) else ""
            raise ToolConfigError(f"{where}: {type(exc).__name__}: {message}") from exc
    return interactions
