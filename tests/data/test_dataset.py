"""Prompt dataset: verl's gsm8k parquet layout, chat-template tokenisation, truncation, filter."""

from __future__ import annotations

import copy
import logging
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.config import DataConfig
from megarl.data import ChatTemplateMissing, DataError, PromptDataset, PromptTooLong

QUESTION = "Natalia sold clips to 48 of her friends in April. How many clips did she sell?"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def gsm8k_rows(n: int = 3) -> list[dict]:
    """Rows exactly as verl's examples/data_preprocess/gsm8k.py writes them."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{QUESTION} ({i}) {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(72 + i)},
            "extra_info": {
                "split": "train",
                "index": i,
                "answer": f"Natalia sold 48/2 = 24 clips in May.\n#### {72 + i}",
                "question": f"{QUESTION} ({i})",
            },
        }
        for i in range(n)
    ]


def write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_gsm8k_layout_loads_and_tokenises_as_the_rendered_template(tmp_path, tokenizer):
    path = write(tmp_path / "train.parquet", gsm8k_rows())
    ds = PromptDataset(path, tokenizer, max_prompt_length=512)
    assert len(ds) == 3
    for i, sample in enumerate(ds):
        content = f"{QUESTION} ({i}) {INSTRUCTION}"
        # the tiny model's template, written out by hand
        text = f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
        assert sample.prompt_ids == tokenizer.encode(text, add_special_tokens=False)
        assert sample.data_source == "openai/gsm8k"
        assert sample.ground_truth == str(72 + i)
        assert sample.extra_info["index"] == i and sample.extra_info["split"] == "train"
        assert sample.raw_prompt == [{"role": "user", "content": content}]
        assert sample.ability == "math"


def test_a_template_that_writes_bos_gives_exactly_one_bos(tmp_path, tokenizer):
    from tokenizers import processors

    tok = copy.deepcopy(tokenizer)
    bos = tok.bos_token_id
    # a Llama-3-like tokenizer: the post-processor adds BOS and so does the template
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, bos)]
    )
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert tok(rendered)["input_ids"][:2] == [bos, bos]  # the trap is real for this tokenizer
    ds = PromptDataset(write(tmp_path / "t.parquet", gsm8k_rows(1)), tok)
    ids = ds[0].prompt_ids
    assert ids[0] == bos and ids.count(bos) == 1


def test_plain_string_prompts(tmp_path, tokenizer):
    rows = [dict(gsm8k_rows(1)[0], prompt="what is 3 plus 4 ?")]
    path = write(tmp_path / "s.parquet", rows)
    wrapped = PromptDataset(path, tokenizer)[0].prompt_ids
    expected = "<|im_start|>user\nwhat is 3 plus 4 ?<|im_end|>\n<|im_start|>assistant\n"
    assert wrapped == tokenizer.encode(expected, add_special_tokens=False)
    raw = PromptDataset(path, tokenizer, use_chat_template=False)[0].prompt_ids
    assert raw == tokenizer.encode("what is 3 plus 4 ?", add_special_tokens=False)


def test_missing_chat_template_is_a_clear_error_unless_raw_strings_are_asked_for(
    tmp_path, tokenizer
):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    path = write(tmp_path / "t.parquet", gsm8k_rows(1))
    with pytest.raises(ChatTemplateMissing, match="data.use_chat_template=false"):
        PromptDataset(path, tok)
    with pytest.raises(ValueError, match="row 0: a chat-message prompt needs"):
        PromptDataset(path, tok, use_chat_template=False)


def test_prompt_and_reward_keys_are_honoured(tmp_path, tokenizer):
    rows = [
        {
            "question": "what is 1 plus 2 ?",
            "task": "megarl/digit_sum",
            "reward_model": {"style": "rule", "ground_truth": "3"},
        }
    ]
    path = write(tmp_path / "k.parquet", rows)
    sample = PromptDataset(path, tokenizer, prompt_key="question", reward_fn_key="task")[0]
    assert sample.data_source == "megarl/digit_sum" and sample.raw_prompt == "what is 1 plus 2 ?"
    assert sample.extra_info == {}
    with pytest.raises(DataError, match=r"no column 'prompt' \(data.prompt_key\)"):
        PromptDataset(path, tokenizer, reward_fn_key="task")


def test_bad_files_and_rows_are_named(tmp_path, tokenizer):
    with pytest.raises(DataError, match=r"data.val_files: '.*missing.parquet' does not exist"):
        PromptDataset(str(tmp_path / "missing.parquet"), tokenizer, files_key="data.val_files")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="cannot read .*junk.parquet"):
        PromptDataset(str(tmp_path / "junk.parquet"), tokenizer)
    rows = gsm8k_rows(2)
    rows[1]["reward_model"] = {"style": "rule"}
    with pytest.raises(DataError, match=r"b.parquet row 1: no reward_model.ground_truth"):
        PromptDataset(write(tmp_path / "b.parquet", rows), tokenizer)


def test_prompts_without_text_are_listed_where_they_are(tmp_path, tokenizer):
    """Issue 40: empty or whitespace-only prompts (a string, or chat messages with no text) load
    as verl loads them and are listed by file and row (``megarl train`` warns of them)."""
    rows = gsm8k_rows(5)
    rows[1]["prompt"] = [{"role": "system", "content": ""}, {"role": "user", "content": " \n"}]
    rows[3]["prompt"] = [{"role": "user", "content": ""}]
    path = write(tmp_path / "e.parquet", rows)
    assert PromptDataset(path, tokenizer).blank_prompts == [
        f"data.train_files: {path} row 1",
        f"data.train_files: {path} row 3",
    ]
    strings = [dict(gsm8k_rows(1)[0], prompt=text) for text in ("", "  ", "x")]
    path = write(tmp_path / "s.parquet", strings)
    listed = PromptDataset(path, tokenizer, use_chat_template=False).blank_prompts
    assert [where.rsplit(" ", 1)[1] for where in listed] == ["0", "1"]


# -- truncation and the overlong filter, on raw-string rows of known token counts -------------


def word_rows(lengths: list[int]) -> list[dict]:
    """Rows whose prompt is ``n`` words "w0 w1 ..." (one token per word is not assumed)."""
    return [
        {
            "data_source": "d",
            "prompt": " ".join(f"x{j}" for j in range(n)),
            "reward_model": {"style": "rule", "ground_truth": str(i)},
        }
        for i, n in enumerate(lengths)
    ]


@pytest.fixture
def rows_file(tmp_path):
    return write(tmp_path / "w.parquet", word_rows([2, 12, 5]))


def full_ids(tokenizer, n):
    return tokenizer.encode(" ".join(f"x{j}" for j in range(n)), add_special_tokens=False)


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncation_modes(rows_file, tokenizer, mode):
    ids = full_ids(tokenizer, 12)
    limit = 7
    assert len(ids) > limit and len(full_ids(tokenizer, 2)) <= limit
    expected = {
        "left": ids[len(ids) - 7 :],
        "right": ids[:7],
        "middle": ids[:3] + ids[len(ids) - 4 :],  # first 7 // 2, last 7 - 7 // 2
    }[mode]
    ds = PromptDataset(
        rows_file, tokenizer, use_chat_template=False, max_prompt_length=limit, truncation=mode
    )
    assert len(ds) == 3
    assert ds[1].prompt_ids == expected
    assert ds[0].prompt_ids == full_ids(tokenizer, 2)  # short prompts untouched


def test_truncation_error_names_the_row_and_its_length(rows_file, tokenizer):
    n = len(full_ids(tokenizer, 12))
    with pytest.raises(PromptTooLong, match=rf"w.parquet row 1: the prompt has {n} tokens, more"):
        PromptDataset(rows_file, tokenizer, use_chat_template=False, max_prompt_length=7)


def test_overlong_filter_drops_and_reports_once(rows_file, tokenizer, caplog):
    limit = len(full_ids(tokenizer, 5))
    with caplog.at_level(logging.WARNING, logger="megarl.data"):
        ds = PromptDataset(
            rows_file,
            tokenizer,
            use_chat_template=False,
            max_prompt_length=limit,
            filter_overlong_prompts=True,  # with truncation=error: filtered rows never raise
        )
    assert [s.ground_truth for s in ds] == ["0", "2"]
    assert [s.index for s in ds] == [0, 1]
    assert ds.num_filtered == 1
    notes = [r.getMessage() for r in caplog.records if "filter_overlong" in r.getMessage()]
    assert len(notes) == 1 and "dropped 1 of 3" in notes[0]


def test_max_samples_picks_verls_rows(tmp_path, tokenizer):
    import numpy as np

    path = write(tmp_path / "m.parquet", word_rows(list(range(1, 11))))
    ds = PromptDataset(path, tokenizer, use_chat_template=False, max_samples=4, seed=7)
    # verl: numpy default_rng(seed).choice(total, size, replace=False)
    chosen = np.random.default_rng(7).choice(10, 4, replace=False).tolist()
    assert [s.ground_truth for s in ds] == [str(i) for i in chosen]
    first = PromptDataset(path, tokenizer, use_chat_template=False, max_samples=4, shuffle=False)
    assert [s.ground_truth for s in first] == ["0", "1", "2", "3"]


def test_from_config_reads_both_splits(tmp_path, tokenizer):
    cfg = DataConfig(
        train_files=[write(tmp_path / "a.parquet", gsm8k_rows(3))],
        val_files=[write(tmp_path / "b.parquet", gsm8k_rows(2))],
        val_max_samples=1,
    )
    assert len(PromptDataset.from_config(cfg, tokenizer, "train", seed=1)) == 3
    assert len(PromptDataset.from_config(cfg, tokenizer, "val", seed=1)) == 1


def test_several_files_are_concatenated(tmp_path, tokenizer):
    a = write(tmp_path / "a.parquet", gsm8k_rows(2))
    b = write(tmp_path / "b.parquet", gsm8k_rows(3))
    ds = PromptDataset([a, b], tokenizer)
    assert [s.ground_truth for s in ds] == ["72", "73", "72", "73", "74"]
    assert ds[4].source.endswith("b.parquet row 2")


def test_num_workers_cap_is_noted_once(caplog):
    from megarl.data import dataset

    dataset._capped_note_given = False
    with caplog.at_level(logging.WARNING, logger="megarl.data"):
        assert dataset.cap_num_workers(8, cpus=2) == 2
        assert dataset.cap_num_workers(16, cpus=2) == 2
        assert dataset.cap_num_workers(1, cpus=2) == 1
    assert sum("dataloader_num_workers" in r.getMessage() for r in caplog.records) == 1


def test_dataloader_num_workers_from_the_config_is_capped_and_noted_once(
    tmp_path, tokenizer, caplog, monkeypatch
):
    """data.dataloader_num_workers above the CPUs: both splits load (files read in order by the
    capped number of threads) and one note names the key, however many datasets are built."""
    from megarl.data import dataset

    monkeypatch.setattr(dataset, "_capped_note_given", False)
    cpus = len(os.sched_getaffinity(0))
    train = [write(tmp_path / f"t{i}.parquet", gsm8k_rows(i + 1)) for i in range(3)]
    cfg = DataConfig(
        train_files=train,
        val_files=[write(tmp_path / "v.parquet", gsm8k_rows(2))],
        dataloader_num_workers=cpus + 7,
    )
    with caplog.at_level(logging.WARNING, logger="megarl.data"):
        train_ds = PromptDataset.from_config(cfg, tokenizer, "train", seed=1)
        val_ds = PromptDataset.from_config(cfg, tokenizer, "val", seed=1)
    assert train_ds.num_workers == val_ds.num_workers == cpus
    assert [s.ground_truth for s in train_ds] == ["72", "72", "73", "72", "73", "74"]
    notes = [r.getMessage() for r in caplog.records if "dataloader_num_workers" in r.getMessage()]
    assert notes == [
        f"data.dataloader_num_workers={cpus + 7} exceeds the {cpus} CPU(s) available; using {cpus}"
    ]
    assert (
        PromptDataset.from_config(
            DataConfig(train_files=train, dataloader_num_workers=1), tokenizer, "train", seed=1
        ).num_workers
        == 1
    )
