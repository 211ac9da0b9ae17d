"""``trainer.log_val_generations``: verl's choice of validation samples (sorted by input,
shuffled with seed 42, the first N), appended per validation to the run directory's
``val_generations.jsonl``."""

from __future__ import annotations

import json

from megarl.reward.dump import VAL_GENERATIONS, pick_val_generations, write_val_generations


def test_the_choice_depends_on_the_samples_not_their_order(tmp_path):
    inputs = [f"prompt {i}" for i in range(10)]
    outputs = [f"answer {i}" for i in range(10)]
    scores = [float(i % 2) for i in range(10)]
    chosen = pick_val_generations(inputs, outputs, scores, 3)
    assert len(chosen) == 3 and len(set(chosen)) == 3
    assert all(s in zip(inputs, outputs, scores, strict=True) for s in chosen)
    backwards = pick_val_generations(inputs[::-1], outputs[::-1], scores[::-1], 3)
    assert backwards == chosen  # sorted by input before the seeded shuffle, as verl
    assert pick_val_generations(inputs, outputs, scores, 50) == pick_val_generations(
        inputs, outputs, scores, 10
    )  # more than there are: all of them
    write_val_generations(tmp_path, 0, chosen)
    write_val_generations(tmp_path, 5, chosen[:1])
    lines = [json.loads(line) for line in (tmp_path / VAL_GENERATIONS).open()]
    assert [line["step"] for line in lines] == [0, 5]
    assert lines[1]["samples"] == [
        {"input": chosen[0][0], "output": chosen[0][1], "score": chosen[0][2]}
    ]
