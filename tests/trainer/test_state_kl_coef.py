"""The adaptive KL controller's coefficient survives a checkpoint (TrainerState round trip)."""

from __future__ import annotations

from megarl.algo import AdaptiveKLController
from megarl.trainer.state import TrainerState


def test_adaptive_kl_coefficient_is_saved_and_restored():
    ctrl = AdaptiveKLController(kl_coef=0.1, target_kl=0.01, horizon=100)
    ctrl.update(0.05, n_steps=8)  # far above target: the coefficient grows
    assert ctrl.value != 0.1
    state = TrainerState(step=3)
    state.save_kl_coef(ctrl)
    saved = TrainerState.from_dict(state.to_dict())  # what the checkpoint holds
    fresh = AdaptiveKLController(kl_coef=0.1, target_kl=0.01, horizon=100)  # a resumed run's
    saved.restore_kl_coef(fresh)
    assert fresh.value == ctrl.value


def test_no_controller_no_coefficient():
    state = TrainerState()
    state.save_kl_coef(None)
    assert state.kl_coef is None
    state.restore_kl_coef(None)


def test_critic_warmup_counts_like_verl():
    """verl updates the actor when critic_warmup <= global_steps (steps from 1)."""
    from megarl.trainer.state import actor_trains

    assert [actor_trains(s, 0) for s in (1, 2)] == [True, True]
    assert [actor_trains(s, 1) for s in (1, 2)] == [True, True]
    assert [actor_trains(s, 3) for s in (1, 2, 3, 4)] == [False, False, True, True]
