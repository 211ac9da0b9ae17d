"""Which Megatron linears get LoRA adapters: Megatron-Bridge's module matcher (verl 0.9.1's
Megatron LoRA), over megarl's global module names. Torch-free, so the pre-flight lists the
adapted modules from the model's shape before any process starts.

Bridge's rules (``peft/module_matcher.py``, ``peft/utils.py:wildcard_match``):

- ``target_modules`` non-empty: a module is adapted when its own name (the attribute name, e.g.
  ``linear_qkv``) equals an entry, or its full name matches an entry as a wildcard pattern over
  the whole name (``*`` any substring; an entry without ``*`` must equal the full name).
  ``exclude_modules`` must then be empty.
- ``target_modules`` empty: every linear is adapted (the untied ``output_layer`` too) except
  those whose own name equals an ``exclude_modules`` entry or whose full name matches one as a
  pattern. So ``layers.1`` excludes nothing (no module is named so, and it is not a whole
  name).
- A pattern is a regular expression in which ``*`` stands for ``(.*)`` (Bridge does not escape
  the rest): its ``.`` matches any character, so ``*.layers.1.*`` excludes layer 1 and layers
  10-19 (``layers.10.`` is ``layers`` + any + ``1`` + any), as in verl; ``*.layers\\.1\\.*``
  layer 1 alone. The pre-flight warns when a ``.`` matched another character
  (:func:`dot_surprises`).

Full names are the module paths inside ``GPTModel``:
``decoder.layers.{L}.self_attention.linear_qkv``, ``decoder.layers.{L}.mlp.linear_fc1``,
``decoder.layers.{L}.mlp.experts.local_experts.{e}.linear_fc1``,
``decoder.layers.{L}.mlp.shared_experts.linear_fc1``, ``output_layer``. megarl numbers layers
and experts globally (what Bridge sees at PP 1 and EP 1; Bridge's own names are stage-local):
the same modules are adapted at every layout.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

DEFAULT_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""verl's (Bridge's) default ``target_modules``."""

ADAPTABLE = (*DEFAULT_TARGETS, "output_layer")
"""Own names of the linears megarl can adapt (the router is no linear; Bridge's
``LoRATopKRouter`` is not built)."""

OUTPUT_LAYER = "output_layer"


def wildcard_match(pattern: str, name: str) -> bool:
    """Bridge's ``wildcard_match``: ``pattern`` with each ``*`` read as ``(.*)``, the rest as a
    regular expression, over the whole of ``name``. Raises ``re.error`` for a bad pattern."""
    return re.match("^" + pattern.replace("*", "(.*)") + "$", name) is not None


def pattern_error(pattern: str) -> str | None:
    """Why ``pattern`` is no valid Bridge pattern (a regular expression once ``*`` is
    ``(.*)``), or None."""
    try:
        re.compile("^" + pattern.replace("*", "(.*)") + "$")
    except re.error as exc:
        return str(exc)
    return None


def is_targeted(
    full_name: str, target_modules: Sequence[str], exclude_modules: Sequence[str]
) -> bool:
    """Whether the linear ``full_name`` gets an adapter (module docstring's rules)."""
    own = full_name.rsplit(".", 1)[-1]
    if target_modules:
        return any(own == p or wildcard_match(p, full_name) for p in target_modules)
    return not any(own == p or wildcard_match(p, full_name) for p in exclude_modules)


def is_plain_name(entry: str) -> bool:
    """An entry naming a module by its own name (no path, no wildcard)."""
    return "." not in entry and "*" not in entry


def linear_names(shape: Any) -> list[str]:
    """Full names of every linear of a model of ``shape`` (a
    :class:`~megarl.config.model_source.ModelShape` or a ``ModelDims``), or [] when its layer
    count is unknown. With tied embeddings the output layer is listed too (LoRA refuses it)."""
    layers = _get(shape, "num_layers")
    if not layers:
        return []
    experts = int(_get(shape, "num_experts") or 0)
    shared = int(_get(shape, "moe_shared_expert_ffn_hidden_size") or 0)
    names = []
    for layer in range(int(layers)):
        head = f"decoder.layers.{layer}"
        names += [f"{head}.self_attention.linear_qkv", f"{head}.self_attention.linear_proj"]
        if experts:
            for e in range(experts):
                names += [f"{head}.mlp.experts.local_experts.{e}.linear_fc{i}" for i in (1, 2)]
            if shared:
                names += [f"{head}.mlp.shared_experts.linear_fc{i}" for i in (1, 2)]
        else:
            names += [f"{head}.mlp.linear_fc1", f"{head}.mlp.linear_fc2"]
    return [*names, OUTPUT_LAYER]


def _get(shape: Any, name: str) -> Any:
    return shape.get(name) if hasattr(shape, "get") else getattr(shape, name, None)


def targeted_names(
    names: Iterable[str], target_modules: Sequence[str], exclude_modules: Sequence[str]
) -> list[str]:
    """The ``names`` that get adapters."""
    return [n for n in names if is_targeted(n, target_modules, exclude_modules)]


def unmatched_entries(names: Sequence[str], entries: Sequence[str]) -> list[str]:
    """Entries (of ``target_modules`` or ``exclude_modules``) that select none of ``names``."""
    return [e for e in entries if not any(is_targeted(n, [e], []) for n in names)]


def dot_surprises(names: Sequence[str], entry: str) -> list[str]:
    """``names`` the pattern ``entry`` matches only because a ``.`` of it matched another
    character (``*.layers.1.*`` on ``decoder.layers.10.…``): what a user reading ``.`` as a
    dot does not expect."""
    if "*" not in entry and "." not in entry:
        return []
    literal = re.sub(r"(?<!\\)\.", r"\\.", entry)
    return [n for n in names if wildcard_match(entry, n) and not wildcard_match(literal, n)]
