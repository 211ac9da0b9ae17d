"""Prompt data: verl-schema parquet datasets, verl's tokenisation, the global-batch sampler.

- :class:`PromptDataset` / :class:`PromptSample` (``megarl.data.dataset``),
- :class:`GlobalBatchSampler`, :func:`total_training_steps` (``megarl.data.sampler``),
- the synthetic verifiable task ``megarl/digit_sum`` (``megarl.data.synthetic``; ``megarl data
  synth`` writes its files).
"""

from megarl.data.dataset import DataError, PromptDataset, PromptSample, cap_num_workers
from megarl.data.sampler import GlobalBatchSampler, total_training_steps
from megarl.data.tokenize import ChatTemplateMissing, PromptTooLong

__all__ = [
    "ChatTemplateMissing",
    "DataError",
    "GlobalBatchSampler",
    "PromptDataset",
    "PromptSample",
    "PromptTooLong",
    "cap_num_workers",
    "total_training_steps",
]
