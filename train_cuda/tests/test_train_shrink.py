"""A student smaller than its teacher (hybrid_train/shrink.py): kept layers, trimmed vocabulary.

References: the teacher's own tokenizer (decoding), and a Llama built directly from the teacher's
kept tensors (logits, float32 on the CPU, tolerance 1e-5)."""

import json

import pytest
import torch
from conftest import SENTENCES
from transformers import LlamaConfig, LlamaForCausalLM

from hybrid_train import shrink
from hybrid_train.errors import TrainError
from hybrid_train.model import hybrid_config
from hybrid_train import teacher
from hybrid_train.teacher import load_teacher, load_tokenizer

TEXTS = SENTENCES + ["Zebras quietly x-ray 42 jugs!", "naïve café — über 😀"]


def test_trimmed_tokenizer_encodes_every_text_and_decodes_it_back(teacher_dir):
    teacher_tok = load_tokenizer(teacher_dir)
    counts = shrink.token_counts(teacher_tok(s).input_ids for s in SENTENCES[:1])
    tok, keep = shrink.trim_vocab(teacher_tok, counts, 285)
    assert len(tok) == len(keep) == 285 and keep == sorted(keep)
    old = teacher_tok.convert_ids_to_tokens(keep)
    assert tok.convert_ids_to_tokens(list(range(285))) == old  # new id k is old id keep[k]
    for text in TEXTS:
        ids = tok(text).input_ids
        assert max(ids) < 285 and tok.decode(ids) == text
        # The same text in the teacher's ids (kept tokens mapped back) decodes the same.
        assert teacher_tok.decode([keep[i] for i in ids]) == text
    # The most used tokens of the counted text stay whole: it encodes as in the teacher.
    for text in SENTENCES[:1]:
        assert [keep[i] for i in tok(text).input_ids] == teacher_tok(text).input_ids
    # Special tokens and the chat template carry over.
    chat = [{"role": "user", "content": "hi"}]
    assert [keep[i] for i in tok.apply_chat_template(chat, tokenize=True, return_dict=False)] == \
        list(teacher_tok.apply_chat_template(chat, tokenize=True, return_dict=False))
    assert keep[tok.eos_token_id] == teacher_tok.eos_token_id


def test_trim_vocab_refuses_a_size_below_bytes_and_specials(teacher_dir):
    with pytest.raises(TrainError, match="byte and special tokens"):
        shrink.trim_vocab(load_tokenizer(teacher_dir), shrink.token_counts([[5]]), 100)


def test_shrunk_student_equals_a_llama_of_the_kept_tensors(teacher_dir):
    teacher = load_teacher(teacher_dir)
    layers, keep = [0, 3], list(range(0, 300, 2))
    student = shrink.keep_rows(shrink.keep_layers(load_teacher(teacher_dir), layers), keep)
    state = teacher.state_dict()
    ref_state = {k: v for k, v in state.items() if not k.startswith("model.layers.")}
    for new, old in enumerate(layers):
        prefix = f"model.layers.{old}."
        ref_state.update({f"model.layers.{new}." + k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
    index = torch.tensor(keep)
    ref_state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][index]
    ref_state["lm_head.weight"] = state["lm_head.weight"][index]
    cfg = teacher.config.to_dict()
    cfg.update(num_hidden_layers=2, vocab_size=len(keep), layer_types=None)
    reference = LlamaForCausalLM(LlamaConfig(**cfg))
    reference.load_state_dict(ref_state)
    ids = torch.randint(0, len(keep), (2, 17))
    with torch.no_grad():
        got = student(input_ids=ids, use_cache=False).logits
        want = reference(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert student.config.num_hidden_layers == 2 and student.config.vocab_size == len(keep)
    assert [layer.self_attn.layer_idx for layer in student.model.layers] == [0, 1]


def test_keep_layers_refuses_bad_indices(teacher_dir):
    for bad in ([], [1, 0], [0, 4], [2, 2]):
        with pytest.raises(TrainError, match="layers must be"):
            shrink.keep_layers(load_teacher(teacher_dir), bad)


def test_a_gguf_teachers_quantization_config_is_not_exported(teacher_dir):
    model = load_teacher(teacher_dir)
    model.config.quantization_config = {"quant_method": "gguf"}
    assert "quantization_config" not in json.loads(json.dumps(hybrid_config(model)))


def test_gguf_to_hf_writes_a_float_checkpoint(teacher_dir, tmp_path, monkeypatch):
    """transformers marks a GGUF-loaded model quantized; the HF copy of its dequantized weights
    must not say so (hybrid convert refuses quantized sources), and keeps the weights."""
    from mlx_hybrid.convert.checkpoint import open_checkpoint

    src = load_teacher(teacher_dir)
    src.config.quantization_config = {"quant_method": "gguf"}
    monkeypatch.setattr(teacher, "load_teacher", lambda path: src)
    monkeypatch.setattr(teacher, "load_tokenizer", lambda path: load_tokenizer(teacher_dir))
    out = teacher.gguf_to_hf(tmp_path / "model.gguf", tmp_path / "hf")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    open_checkpoint(out)
    copy = load_teacher(out)
    for name, value in src.state_dict().items():
        assert torch.equal(copy.state_dict()[name], value.float()), name
