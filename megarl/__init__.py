"""megarl: Megatron-Core RL post-training (PPO, GRPO and their family) with verl's config keys.

Packages, bottom up: ``config`` (typed config tree, loader, validation), ``parallel`` (process
groups, CPU emulation, the local world launcher), ``models`` (Megatron GPT models, HF mapping,
weights), ``checkpoint`` (distributed checkpoints), ``algo`` (pure RL math), ``rollout`` (engines,
resharding to vLLM), ``reward``, ``data``, ``trainer``, ``tracking``; ``commands`` and ``cli``
are the command line.
"""

from megarl.parallel.import_hooks import install as _install_import_hooks

_install_import_hooks()  # skips two costly third-party imports megarl never uses
