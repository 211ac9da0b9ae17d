"""The critic: its value pass and its update, in verl's units (``critic.*``).

The update cuts the batch as the actor's does (:func:`megarl.trainer.actor.run_update`):
``critic.ppo_epochs`` × mini-batches of ``critic.ppo_mini_batch_size`` prompts × micro-batches,
and its loss is ``megarl.algo.compute_value_loss`` (clipped by ``cliprange_value``) aggregated with
the mini-batch's global counts, so the reduced gradient is the mini-batch's at any layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.algo import compute_value_loss, masked_mean, masked_var
from megarl.models.trainable import TrainableModel
from megarl.trainer.actor import MiniBatching, run_update
from megarl.trainer.batch import RolloutTensors


@dataclass(frozen=True)
class ValueUpdate(MiniBatching):
    """The critic update's settings (``critic.*``)."""

    cliprange_value: float | None = 0.5
    loss_agg_mode: str = "token-mean"


def update_critic(
    critic: TrainableModel, batch: RolloutTensors, settings: ValueUpdate, *, seed: int, step: int
) -> dict[str, float]:
    """Run the critic update on ``batch`` (its fields hold ``values`` and ``returns``); returns
    ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean``, ``critic/grad_norm``, ..."""

    def make_loss_fn(tokens: float, seqs: float):
        counts = {
            "loss_agg_mode": settings.loss_agg_mode,
            "global_token_count": max(tokens, 1.0),
            "global_seq_count": max(seqs, 1.0),
        }

        def loss_fn(outputs, mb):
            vpreds = outputs["values"]
            width = vpreds.shape[1]
            mask = mb["response_mask"][:, :width]
            loss, metrics = compute_value_loss(
                vpreds,
                mb["returns"][:, :width],
                mb["values"][:, :width],
                mask,
                cliprange_value=settings.cliprange_value,
                **counts,
            )
            weight = mask.sum() / counts["global_token_count"]
            return loss, {
                "vf_loss": loss.detach(),
                "vf_clipfrac": metrics["vf_clipfrac"] * weight,
                "vpred_mean": (vpreds.detach() * mask).sum() / counts["global_token_count"],
            }

        return loss_fn

    metrics = run_update(
        critic,
        batch,
        settings,
        ["values", "returns"],
        make_loss_fn,
        seed=seed,
        step=step,
        purpose="critic",
    )
    return {f"critic/{k}": v for k, v in metrics.items()}


def value_metrics(batch: RolloutTensors) -> dict[str, float]:
    """verl's ``critic/values/*`` and ``critic/vf_explained_var`` (1 - Var(R - V) / Var(R))."""
    mask = batch.response_mask.bool()
    values, returns = batch.fields["values"], batch.fields["returns"]
    out: dict[str, float] = {}
    if mask.any():
        v = values[mask]
        out = {"critic/values/mean": float(v.mean()), "critic/values/max": float(v.max()),
               "critic/values/min": float(v.min())}  # fmt: skip
        var_returns = masked_var(returns, mask)
        explained = 1.0 - masked_var(returns - values, mask) / (var_returns + 1e-5)
        out["critic/vf_explained_var"] = float(explained)
        out["critic/value_mean_error"] = float(masked_mean(values - returns, mask))
    return out


def global_values(critic: TrainableModel, batch: RolloutTensors, micro_batches, max_token_len):
    """Critic values ``[B, R]`` of every response token of the batch, on every rank."""
    from megarl.trainer.passes import global_pass

    return global_pass(
        critic.chunks, batch, "critic", micro_batches=micro_batches, max_token_len=max_token_len
    )["values"]
