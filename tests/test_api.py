"""The package's public entry points: `load()` without a path and `load_default()` load the
embedded default model (whatever `default_model_path()` names), and a missing one is a HybridError."""

import pytest
from tests.helpers.factories import make_hf_model_dir

import mlx_hybrid
from mlx_hybrid import HybridError
from mlx_hybrid.generate import generate


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("api") / "m", seed=3)


@pytest.mark.parametrize("call", [lambda: mlx_hybrid.load(), lambda: mlx_hybrid.load_default()], ids=["load()", "load_default()"])
def test_load_without_a_path_is_the_default_model(monkeypatch, tiny_dir, call):
    monkeypatch.setattr("mlx_hybrid.default_model.default_model_path", lambda: tiny_dir)
    model, tokenizer = call()
    reference, ref_tokenizer = mlx_hybrid.load(tiny_dir)
    assert generate(model, tokenizer, "The quick", max_tokens=12) == generate(reference, ref_tokenizer, "The quick", max_tokens=12)


def test_missing_default_model_is_a_hybrid_error(monkeypatch, tmp_path):
    monkeypatch.setattr("mlx_hybrid.default_model.PATH", tmp_path / "gone")
    with pytest.raises(HybridError, match="embedded default model is missing"):
        mlx_hybrid.load()
