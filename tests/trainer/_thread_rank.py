"""A rank that reports its CPU threads (``MEGARL_TRAIN_MODULE`` of tests/trainer/
test_train_command.py): it passes the launcher's gate as ``megarl.trainer`` does, then writes
``OMP_NUM_THREADS`` and torch's intra-op thread count to ``$MEGARL_TEST_THREADS/rank<N>``."""

import os
from pathlib import Path

if __name__ == "__main__":
    from megarl.parallel.gate import pass_gate

    pass_gate(lambda: None)
    import torch

    report = f"{os.environ.get('OMP_NUM_THREADS')} {torch.get_num_threads()}"
    Path(os.environ["MEGARL_TEST_THREADS"], f"rank{os.environ['RANK']}").write_text(report)
