"""The rollout's MoE routing for routing replay R3: one format, two sources.

A request's choices are ``[positions, layers, k]`` int16 over the model's decoder layers, -1
where nothing was recorded (the last generated token, which vLLM samples but never runs through
the model; with the hooks also dense layers). :func:`source` picks:

- ``aux``: vLLM's own output (``enable_return_routed_experts``), converted by
  :func:`from_routed_experts`. vLLM 0.32 offers it only with Model Runner V2, i.e. on GPU with
  ``VLLM_USE_V2_MODEL_RUNNER=1``; it works with CUDA graphs and prefix caching.
- ``hooks``: everywhere else, :class:`RoutingCapture` records them in the worker (reached by
  ``collective_rpc``, as the weight update is). Hooks see only positions run through the model
  and do not fire inside CUDA graphs: such an engine turns prefix caching off and needs eager
  execution.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import torch

from megarl.rollout.vllm_process import MODEL_RUNNER_ENV

NOT_ROUTED = -1
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def source(capture: bool, on_gpu: bool) -> str | None:
    """Where an engine's routing comes from: ``aux`` (vLLM's aux output: GPU with Model Runner
    V2 asked for), ``hooks`` (the worker's own capture) or None (not capturing)."""
    if not capture:
        return None
    return "aux" if on_gpu and os.environ.get(MODEL_RUNNER_ENV) == "1" else "hooks"


def from_routed_experts(routed: Any, length: int) -> np.ndarray:
    """vLLM's ``CompletionOutput.routed_experts`` of a sequence of ``length`` tokens (prompt +
    response; vLLM's ``[length - 1, layers, k]``, zeros in dense layers) in the capture format:
    ``[length, layers, k]`` int16, the last position -1."""
    if routed is None:
        raise RuntimeError("vLLM returned no routed experts (enable_return_routed_experts off?)")
    routed = np.asarray(routed)
    if routed.ndim != 3 or routed.shape[0] != length - 1:
        raise RuntimeError(
            f"vLLM's routed experts have shape {routed.shape}; expected [{length - 1}, layers, k] "
            f"for a sequence of {length} tokens"
        )
    out = np.full((length, *routed.shape[1:]), NOT_ROUTED, dtype=np.int16)
    out[:-1] = routed
    return out


class RoutingCapture:
    """The ``hooks`` source, installed on a vLLM worker's model runner by :func:`install`.

    A forward hook on every MoE block's router (``mlp.gate``) takes the top-k of its logits per
    token: the experts vLLM's fused MoE then runs (Qwen2/3-MoE and Mixtral choose by top-k of
    the router's logits; a softmax before or after does not change which). The runner's forward
    is wrapped to learn each token row's request and position: rows are laid out request by
    request in the input batch's order (``query_start_loc``), and the model's ``positions``
    argument gives each row's position in its sequence.
    """

    def __init__(self, runner: Any) -> None:
        model = runner.get_model()
        blocks = [(n, m) for n, m in model.named_modules() if _is_moe_block(m)]
        if not blocks:
            raise ValueError("routing capture: the rollout model has no MoE layer")
        hf = runner.model_config.hf_config
        self.layers = int(hf.num_hidden_layers)
        self.topk = int(hf.num_experts_per_tok)
        self.num_experts = int(getattr(hf, "num_experts", None) or hf.num_local_experts)
        self._runner = runner
        self._step: dict[int, torch.Tensor] = {}
        self._moe_layers: list[int] = []
        self.requests: dict[str, np.ndarray] = {}
        for name, block in blocks:
            layer = int(_LAYER.search(name + ".")[1])
            self._moe_layers.append(layer)
            block.gate.register_forward_hook(self._hook(layer))
        original = runner._model_forward

        def model_forward(*args, **kwargs):
            self._step.clear()
            out = original(*args, **kwargs)
            self._collect(kwargs["positions"])
            return out

        runner._model_forward = model_forward

    def _hook(self, layer: int):
        def record(_module, _inputs, output) -> None:
            logits = output[0] if isinstance(output, tuple) else output
            chosen = logits[:, : self.num_experts].float().topk(self.topk, dim=-1).indices
            self._step[layer] = chosen.to(torch.int16).cpu()

        return record

    def _collect(self, positions: torch.Tensor) -> None:
        """File the forward's choices under each scheduled request and position."""
        missing = [layer for layer in self._moe_layers if layer not in self._step]
        if missing:
            raise RuntimeError(f"routing capture: MoE layers {missing} ran without their router")
        batch = self._runner.input_batch
        count = batch.num_reqs
        starts = self._runner.query_start_loc.cpu[: count + 1].tolist()
        rows = positions[: starts[-1]].cpu().numpy()
        step = torch.stack([self._step[layer] for layer in self._moe_layers], 1).numpy()
        for i, req in enumerate(batch.req_ids[:count]):
            lo, hi = starts[i], starts[i + 1]
            if lo == hi:
                continue
            at = rows[lo:hi]
            kept = self._storage(req, int(at.max()) + 1)
            kept[at[:, None], np.asarray(self._moe_layers)[None, :]] = step[lo:hi]

    def _storage(self, req: str, length: int) -> np.ndarray:
        kept = self.requests.get(req)
        if kept is None or kept.shape[0] < length:
            grown = np.full((max(length, 64), self.layers, self.topk), NOT_ROUTED, np.int16)
            if kept is not None:
                grown[: kept.shape[0]] = kept
            self.requests[req] = kept = grown
        return kept

    def take(self, request_ids: list[str], lengths: list[int]) -> list[np.ndarray]:
        """The choices of the requests vLLM returned as ``request_ids`` (external ids: vLLM
        appends a random suffix internally), ``lengths[i]`` positions each; forgotten here."""
        by_external = {internal.rsplit("-", 1)[0]: internal for internal in self.requests}
        out = []
        for rid, length in zip(request_ids, lengths, strict=True):
            kept = self.requests.pop(by_external[rid], None) if rid in by_external else None
            if kept is None:
                kept = np.full((length, self.layers, self.topk), NOT_ROUTED, np.int16)
            elif kept.shape[0] < length:
                pad = np.full((length - kept.shape[0], self.layers, self.topk), NOT_ROUTED)
                kept = np.concatenate([kept, pad.astype(np.int16)])
            out.append(kept[:length].copy())
        return out


def _is_moe_block(module: torch.nn.Module) -> bool:
    """A sparse MoE block (its router ``gate`` beside ``experts``); dense MLPs have neither."""
    return isinstance(getattr(module, "gate", None), torch.nn.Module) and hasattr(module, "experts")


# ---------------------------------------------------------------------- collective_rpc entries


def install(worker: Any) -> None:
    if getattr(worker, "_megarl_routing", None) is None:
        worker._megarl_routing = RoutingCapture(worker.model_runner)


def clear(worker: Any) -> None:
    """Forget what earlier, unfinished generations left."""
    worker._megarl_routing.requests.clear()


def take(worker: Any, request_ids: list[str], lengths: list[int]) -> list[np.ndarray]:
    return worker._megarl_routing.take(request_ids, lengths)
