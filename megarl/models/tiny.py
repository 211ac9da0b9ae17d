"""Tiny, fully random Hugging Face checkpoints (Llama / Qwen2 / Qwen3, and the Qwen3-MoE, Qwen2-MoE
and Mixtral mixture-of-experts families) for CPU tests.

Every tensor is drawn from one seeded generator (biases and norm weights too: HF's default init
leaves them at 0 / 1, which hides mapping bugs), and the tokenizer is a byte-level BPE trained
in-process on a small synthetic corpus, so nothing touches the Hub.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megarl.config.dtypes import DTYPE_NAMES, torch_dtype
from megarl.config.model_dims import ModelDims
from megarl.models.hf_mapping import hf_param_names, hf_param_shape
from megarl.models.tiny_families import ARCHITECTURES

__all__ = [
    "ARCHITECTURES",
    "SPECIAL_TOKENS",
    "add_tiny_model_args",
    "build_tokenizer",
    "make_tiny_model",
    "make_tiny_model_from_args",
    "make_tiny_reward_model",
    "random_hf_state",
    "tiny_hf_config",
]


MOE_DEFAULTS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
"""Experts of the tiny MoE families: 8 experts, top-2, each 64 wide (vLLM's CPU attention
needs head_dim ≥ 32, which the attention defaults give)."""

# Fixed ids 0..3: eos/bos, pad, chat markers.
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

WEIGHT_STD = 0.08
"""Std of matrix weights; gives next-token distributions that are neither uniform nor one-hot."""
EMBED_STD = 0.25
"""Std of the embedding and the output layer: logits = RMSNorm(h) · W_out have std ≈ √H · 0.25
(≈ 2.8 at H = 128), i.e. next-token entropies of a few nats out of ln(vocab)."""


def tiny_hf_config(
    family: str = "qwen2",
    *,
    num_layers: int = 4,
    hidden_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 256,
    vocab_size: int = 1000,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    dtype: torch.dtype = torch.float32,
    num_experts: int = MOE_DEFAULTS["num_experts"],
    num_experts_per_tok: int = MOE_DEFAULTS["num_experts_per_tok"],
    moe_intermediate_size: int = MOE_DEFAULTS["moe_intermediate_size"],
    norm_topk_prob: bool = True,
) -> dict[str, Any]:
    """The ``config.json`` contents of a tiny model (token ids match :func:`build_tokenizer`).

    The expert arguments apply to the MoE families only (Mixtral's ``intermediate_size`` is its
    experts' width, ``moe_intermediate_size``; Mixtral always renormalises top-k
    probabilities, Qwen3-MoE as ``norm_topk_prob`` says).
    """
    if family not in ARCHITECTURES:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(ARCHITECTURES)}")
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": WEIGHT_STD,
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "tie_word_embeddings": tie_word_embeddings,
        "attention_dropout": 0.0,
        "use_cache": True,
        "bos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
        "dtype": str(dtype).removeprefix("torch."),
    }
    if family == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif family == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_layers)
    elif family in ("qwen3_moe", "qwen2_moe"):  # qwen2_moe: qkv biases, a gated shared expert
        cfg.update(
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=num_layers,
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size,
            norm_topk_prob=norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            output_router_logits=False,
            router_aux_loss_coef=0.001,
        )
        if family == "qwen3_moe":
            cfg.update(attention_bias=False)
        else:
            cfg.update(shared_expert_intermediate_size=2 * moe_intermediate_size)
    elif family == "mixtral":
        cfg.update(
            intermediate_size=moe_intermediate_size,
            sliding_window=None,
            num_local_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            output_router_logits=False,
            router_aux_loss_coef=0.001,
            router_jitter_noise=0.0,
        )
    else:  # qwen3: per-head q/k RMSNorm, no qkv bias
        cfg.update(
            attention_bias=False,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=num_layers,
        )
    return cfg


def random_hf_state(
    dims: ModelDims, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> dict[str, Tensor]:
    """Every HF tensor of ``dims`` drawn from one ``torch.Generator`` seeded with ``seed``.

    Matrices ~ N(0, WEIGHT_STD) (embedding, lm_head: N(0, EMBED_STD)), norm weights 1 + 0.1·N(0, 1),
    biases 0.1·N(0, 1). No ``lm_head.weight`` when embeddings are tied.
    """
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, Tensor] = {}
    for name in hf_param_names(dims):
        noise = torch.randn(hf_param_shape(name, dims), generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            t = 0.1 * noise
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            t = EMBED_STD * noise
        else:
            t = WEIGHT_STD * noise
        state[name] = t.to(dtype).contiguous()
    return state


_WORDS = (
    "what is the answer sum of plus minus times divided by equals result number question "
    "please compute solve think step first then so final a an and or not yes no true false "
    "user assistant system you are helpful model reward correct wrong value count letter "
    "word sort reverse copy repeat list even odd greater less than zero one two three four "
    "five six seven eight nine ten hundred thousand"
)


def _synthetic_corpus(seed: int = 0) -> Iterator[str]:
    """Arithmetic questions, numbers, letters and a few words: what the tiny RL tasks use."""
    rng = random.Random(seed)
    words = _WORDS.split()
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    for n in range(1000):
        yield f"{n} {n + 1} {n * 7 % 1000}"
    for _ in range(3000):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice(["+", "-", "*", "plus", "minus", "times"])
        yield f"what is {a} {op} {b} ? the answer is {rng.randint(0, 9999)} ."
    for _ in range(1500):
        yield " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        yield " ".join(rng.choice(letters) * rng.randint(1, 3) for _ in range(rng.randint(2, 8)))


def build_tokenizer(vocab_size: int = 1000, *, seed: int = 0) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` with exactly ``vocab_size`` tokens.

    Ids 0..3 are ``<|endoftext|>`` (eos, bos), ``<|pad|>``, ``<|im_start|>``, ``<|im_end|>``; then
    the 256 byte symbols and BPE merges learned on :func:`_synthetic_corpus`. If the corpus runs
    out of merges first, ``<|reserved_i|>`` special tokens fill the vocabulary up.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    base = len(SPECIAL_TOKENS) + 256
    if vocab_size < base:
        raise ValueError(f"vocab_size must be >= {base} (specials + 256 bytes), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(seed), trainer=trainer)
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(special) == i, (special, tok.token_to_id(special))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(SPECIAL_TOKENS[2:]),
        model_max_length=1 << 30,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    if len(fast) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(fast)} tokens, wanted {vocab_size}")
    return fast


def make_tiny_model(
    out_dir: str | Path,
    family: str = "qwen2",
    *,
    num_layers: int = 4,
    hidden_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 256,
    vocab_size: int = 1000,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **experts: Any,
) -> Path:
    """Write a random HF checkpoint (config, safetensors, generation config, tokenizer).

    The directory loads offline with ``AutoModelForCausalLM`` / ``AutoTokenizer``; the same
    arguments always give bit-identical files. ``experts``: :func:`tiny_hf_config`'s expert
    arguments (MoE families).
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_hf_config(
        family,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        rms_norm_eps=rms_norm_eps,
        dtype=dtype,
        **experts,
    )
    state = random_hf_state(ModelDims.from_hf_config(cfg), seed=seed, dtype=dtype)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen_cfg = {
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": cfg["pad_token_id"],
    }  # no sampling defaults: vLLM would adopt them (generation_config="auto")
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    build_tokenizer(vocab_size, seed=seed).save_pretrained(str(out))
    return out


def make_tiny_reward_model(
    out_dir: str | Path,
    family: str = "qwen2",
    *,
    seed: int = 0,
    chat_template: str | None = None,
    **kwargs: Any,
) -> Path:
    """A random ``*ForSequenceClassification`` reward model (``num_labels=1``): the tiny causal
    LM of :func:`make_tiny_model` (same arguments) with its ``lm_head`` replaced by a random
    bias-free ``score`` head; ``chat_template`` replaces the tokenizer's chat template."""
    from safetensors.torch import load_file, save_file

    if family not in ("llama", "qwen2"):
        raise ValueError(f"reward models are llama or qwen2, not {family!r}")
    out = make_tiny_model(out_dir, family, seed=seed, **kwargs)
    cfg = json.loads((out / "config.json").read_text())
    cfg["architectures"] = [
        ARCHITECTURES[family].replace("ForCausalLM", "ForSequenceClassification")
    ]
    cfg["id2label"], cfg["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    state = load_file(str(out / "model.safetensors"))
    state.pop("lm_head.weight", None)
    gen = torch.Generator().manual_seed(seed + 1)
    score = WEIGHT_STD * torch.randn(1, cfg["hidden_size"], generator=gen)
    state["score.weight"] = score.to(state["model.norm.weight"].dtype)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if chat_template is not None:
        config = json.loads((out / "tokenizer_config.json").read_text())
        config["chat_template"] = chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


def add_tiny_model_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add :func:`make_tiny_model`'s options (``--family``, ``--out``, ...) to ``parser``."""
    parser.add_argument("--family", choices=sorted(ARCHITECTURES), default="qwen2")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--tie-word-embeddings", action="store_true")
    for flag, default in [
        ("--num-layers", 4),
        ("--hidden-size", 128),
        ("--num-attention-heads", 4),
        ("--num-key-value-heads", 2),
        ("--head-dim", 32),
        ("--intermediate-size", 256),
        ("--vocab-size", 1000),
        ("--max-position-embeddings", 512),
        ("--seed", 0),
    ]:
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--rope-theta", type=float, default=10000.0)
    parser.add_argument("--rms-norm-eps", type=float, default=1e-6)
    parser.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="float32")
    return parser


def make_tiny_model_from_args(args: argparse.Namespace) -> Path:
    """Call :func:`make_tiny_model` with options parsed by :func:`add_tiny_model_args`."""
    return make_tiny_model(
        args.out,
        args.family,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate_size,
        vocab_size=args.vocab_size,
        tie_word_embeddings=args.tie_word_embeddings,
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=args.rope_theta,
        rms_norm_eps=args.rms_norm_eps,
        seed=args.seed,
        dtype=torch_dtype(args.dtype),
    )
