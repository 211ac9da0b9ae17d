"""One CPU rank: the actor's TrainableModel built from a config through
:func:`megarl.trainer.setup.optimizer_settings`, as ``megarl train`` builds it; writes the
learning rate over six trainer steps and the Megatron OptimizerConfig entries the optim keys set
(read by tests/config/test_engine_keys.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    out, model, config, *overrides = sys.argv[1:]
    from megarl.config import load_config
    from megarl.models.build import build_model
    from megarl.models.trainable import TrainableModel
    from megarl.parallel.init import destroy_distributed, init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.trainer.setup import optimizer_settings

    init_distributed(seed=1)
    settings = optimizer_settings(load_config(config, overrides), total_steps=40)
    trainable = TrainableModel(build_model(model, ParallelLayout()), settings)
    lrs = [trainable.lr]
    for _ in range(5):
        trainable.advance_lr()  # once per trainer step, as the loop does
        lrs.append(trainable.lr)
    built = trainable.optimizer.config
    names = ("adam_beta1", "adam_beta2", "adam_eps", "clip_grad")
    result = {"lrs": lrs, **{name: getattr(built, name) for name in names}}
    Path(out).write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    from tests._worker_exit import exit_now

    main()
    exit_now()
