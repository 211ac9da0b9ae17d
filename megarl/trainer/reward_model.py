"""The learned reward model (``reward_model.enable``): a frozen HF ``*ForSequenceClassification``
checkpoint (Llama / Qwen2, one label) on Megatron at the actor's TP×PP layout.

Each response is re-tokenised for the reward model (its own tokenizer and chat template:
:mod:`megarl.reward.retokenize`) and scored by the bias-free hidden→1 ``score`` head (megarl's
``ValueHead``, loaded from ``score.weight``) at the last token of that input
(:func:`megarl.models.runner.compute_scores`). As in verl 0.9.1's reward loop, the reward
model's score replaces the rule scorers (``data_source`` rules are not run) and goes on the
response's last valid token of ``token_level_rewards``
(:class:`megarl.reward.manager.RewardManager` with ``model_scores``). Every DP rank scores a
contiguous share of the global batch and the scores are all-gathered, so every rank holds all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state

from megarl.models.build import BuiltModel, build_model
from megarl.models.runner import SequenceBatch, compute_scores
from megarl.reward.retokenize import reward_model_input_ids
from megarl.trainer.batch import pad_token_id
from megarl.trainer.passes import gather_dp
from megarl.trainer.split import dp_share, fitting_micro_batch


@dataclass
class RewardModel:
    """This rank's chunks of the frozen reward model, its tokenizer and its pass settings."""

    model: BuiltModel
    tokenizer: Any
    """The reward model's tokenizer (and chat template)."""
    actor_tokenizer: Any
    """Decodes the responses."""
    micro_batch_size: int | None = None
    max_length: int | None = None
    param_offload: bool = False

    @classmethod
    def from_config(
        cls, cfg: Any, layout: Any, dtype: torch.dtype, actor_tokenizer: Any
    ) -> RewardModel | None:
        """Build (and freeze) ``reward_model.model.path`` when ``reward_model.enable``, else None."""
        rm = cfg.reward_model
        if not rm.enable:
            return None
        from transformers import AutoTokenizer

        path = str(Path(rm.model.path).expanduser())
        transformer_impl = cfg.actor_rollout_ref.actor.megatron.transformer_impl
        built = build_model(path, layout, role="reward", dtype=dtype,
                            transformer_impl=transformer_impl)  # fmt: skip
        built.pack = rm.model.use_remove_padding
        for chunk in built.chunks:
            chunk.eval()
            chunk.requires_grad_(False)
        reward_model = cls(
            built,
            AutoTokenizer.from_pretrained(path),
            actor_tokenizer,
            micro_batch_size=rm.micro_batch_size_per_gpu
            or cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu,
            max_length=rm.max_length,
            param_offload=rm.megatron.param_offload,
        )
        reward_model.offload()
        return reward_model

    def input_ids(self, raw_prompts: Sequence[Any], responses: Sequence[Sequence[int]]) -> list:
        """The reward model's token ids of each (prompt, response)."""
        return [
            reward_model_input_ids(p, r, self.actor_tokenizer, self.tokenizer, self.max_length)
            for p, r in zip(raw_prompts, responses, strict=True)
        ]

    @torch.no_grad()
    def score(self, raw_prompts: Sequence[Any], responses: Sequence[Sequence[int]]) -> torch.Tensor:
        """Scores ``[B]`` float32 of the global batch, on every rank (collective)."""
        sequences = self.input_ids(raw_prompts, responses)
        dp_size = parallel_state.get_data_parallel_world_size()  # CP peers score the same rows
        dp_rank = parallel_state.get_data_parallel_rank()
        n = len(sequences)
        padded = -(-n // dp_size) * dp_size  # every DP rank takes an equal share: repeat the last
        rows = dp_share(torch.arange(padded).clamp(max=n - 1), dp_rank, dp_size).tolist()
        batch = self._batch([sequences[i] for i in rows])
        micro = fitting_micro_batch(len(rows), self.micro_batch_size or len(rows))
        self.reload()
        local = compute_scores(self.model.chunks, batch, micro_batches=micro, pack=self.model.pack)
        self.offload()
        return gather_dp(local[:, None].float(), dp_size)[:n, 0]

    def _batch(self, sequences: list[list[int]]) -> SequenceBatch:
        pad = pad_token_id(self.tokenizer)
        lengths = torch.tensor([len(s) for s in sequences])
        ids = torch.full((len(sequences), int(lengths.max())), pad, dtype=torch.long)
        for i, s in enumerate(sequences):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        return SequenceBatch(ids, lengths.clone(), lengths)

    def offload(self) -> None:
        """With ``reward_model.megatron.param_offload``: parameters to host memory (a no-op under
        CPU emulation, like the reference model's)."""
        if self.param_offload:
            for chunk in self.model.chunks:
                chunk.cpu()

    def reload(self) -> None:
        if self.param_offload:
            for chunk in self.model.chunks:
                chunk.cuda()
