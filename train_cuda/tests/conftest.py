"""Tiny real-architecture teachers (transformers Llama/Mistral, random weights) and data, built here.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on the sentences below.
"""

import json
from pathlib import Path

import pytest
import torch

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hybrid models replace some attention layers with state space layers.",
    "Speculative decoding verifies many drafted tokens in one forward pass.",
    "Once upon a time there was a little robot who loved to read books.",
    "The river ran past the old mill and down to the sea.",
    "She counted the stars until the morning light came over the hills.",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
# DSLA-Serve's form of DSLA in HybridArgs' terms (hybrid_train.model.DSLA): full-rank gates, softmax mix,
# no output norm, clamped gates, and a K/V head per query head (TINY has 4 heads, 2 K/V heads).
DSLA_SERVE = dict(gate_rank=0, gate_clamp=-50.0, dsla_mix="softmax", dsla_o_norm=False, dsla_kv_heads=4)


def make_tokenizer(path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def make_teacher(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """A Hugging Face directory with a random-weight Llama (or Mistral) and the tiny tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(path)
    cfg = dict(TINY, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id, **overrides)
    torch.manual_seed(seed)
    model = (LlamaForCausalLM(LlamaConfig(**cfg)) if arch == "llama" else MistralForCausalLM(MistralConfig(**cfg)))
    with torch.no_grad():  # wider than the default init, so the logits differ clearly between tokens
        for p in model.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.add_(torch.randn_like(p), alpha=0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def teacher_dir(tmp_path_factory) -> Path:
    return make_teacher(tmp_path_factory.mktemp("teacher"))


@pytest.fixture
def article_corpus(tmp_path) -> Path:
    """A corpus directory as scripts/fetch_corpus.py writes it: train.txt and heldout.txt, one
    document a line."""
    path = tmp_path / "corpus"
    path.mkdir()
    docs = [" ".join(SENTENCES[i:] + SENTENCES[:i]) for i in range(len(SENTENCES))]
    (path / "train.txt").write_text("\n".join(docs) + "\n")
    (path / "heldout.txt").write_text("\n".join(docs[::-1]) + "\n")
    return path


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("\n".join(SENTENCES * 4) + "\n")
    return path


@pytest.fixture(scope="session")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(s.rsplit(" ", 3)[0] for s in SENTENCES) + "\n")
    return path


def write_config(path: Path, **cfg) -> Path:
    path.write_text(json.dumps(cfg, indent=1))
    return path


@pytest.fixture(scope="session")
def labels(teacher_dir, prompts, tmp_path_factory) -> Path:
    """The tiny teacher's greedy answers to `prompts`: distillation data."""
    from hybrid_train.__main__ import main

    tmp = tmp_path_factory.mktemp("pl")
    cfg = write_config(tmp / "pl.json", teacher=str(teacher_dir), prompts=str(prompts), out=str(tmp / "labels.jsonl"),
                       max_new_tokens=20, batch_size=4, chat=True)
    assert main(["pseudo-labels", "--config", str(cfg)]) == 0
    return tmp / "labels.jsonl"
