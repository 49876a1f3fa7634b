"""Medusa-1, Medusa-2, ReDrafter and draft-model stages on a tiny random teacher (and a hybrid made
from it).

- each loss against a value worked out by hand;
- each stage from its config lowers its loss on a fixed batch (batch_size = the 6 examples) and
  reports held-out top-1 accuracy per head / drafted step;
- a stopped run resumed with --resume reaches the same exported weights as an uninterrupted one;
- the exports load in the MLX runtime (mlx_hybrid.speculative) and give the torch logits within
  ATOL; the runtime's own Medusa head accuracies and ReDrafter beam search agree with the
  positions trained and measured here;
- pseudo-labels of a hybrid base are its own greedy continuations, and heads train on it.

Tolerance: logits ~1-10 in magnitude, torch float32 vs MLX float32 (different summation orders):
ATOL 1e-4 (measured max |diff| 1.7e-6 for heads, 3.3e-6 for the drafter, logits up to ~8).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import SENTENCES, write_config
from safetensors.torch import load_file

from hybrid_train.__main__ import main
from hybrid_train.data import example
from hybrid_train.head_stages import draft_accuracy
from hybrid_train.heads import Drafter, MedusaHeads, examples_from, hidden_states, load_base, save_heads, top1_accuracy
from hybrid_train.losses import IGNORE, kd_loss, medusa_loss
from hybrid_train.model import HybridArgs, convert_layers, save_hybrid
from hybrid_train.teacher import load_teacher, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(batch_size=6, lr=3e-3, save_every=4, seed=0)
ATOL = 1e-4
LN3 = math.log(3)


def run(stage, cfg_path, *extra):
    return main([stage, "--config", str(cfg_path), *extra])


def losses(out: Path, key="loss") -> list[float]:
    return [json.loads(line)[key] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def greedy(teacher_dir, prompts, tmp_path_factory):
    """The teacher's greedy continuations of the 6 prompts (plain text, as the real run uses)."""
    tmp = tmp_path_factory.mktemp("greedy")
    cfg = write_config(tmp / "pl.json", teacher=str(teacher_dir), prompts=str(prompts), out=str(tmp / "labels.jsonl"),
                       max_new_tokens=24, batch_size=4, chat=False)
    assert run("pseudo-labels", cfg) == 0
    return tmp / "labels.jsonl"


def perturb(module, seed=3):
    """Move every parameter off its initial value (zero ResBlocks, copied LM heads)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return module


def test_medusa_loss_by_hand():
    # Head 1 (weight 0.8): one position, p = (1/4, 3/4), target 1: CE = -ln(3/4) = 0.287682.
    # Head 2 (weight 0.8^2 = 0.64): p = (1/2, 1/2), target 0: ln 2 = 0.693147; p = (3/4, 1/4), target 0:
    #   -ln(3/4) = 0.287682; mean 0.490415.
    # Loss = 0.8 * 0.287682 + 0.64 * 0.490415 = 0.230146 + 0.313865 = 0.544011.
    logits = [torch.tensor([[0.0, LN3]]), torch.tensor([[0.0, 0.0], [LN3, 0.0]])]
    targets = [torch.tensor([1]), torch.tensor([0, 0])]
    loss, parts = medusa_loss(logits, targets, decay=0.8)
    assert parts["head1"].item() == pytest.approx(0.287682, abs=1e-6)
    assert parts["head2"].item() == pytest.approx(0.490415, abs=1e-6)
    assert loss.item() == pytest.approx(0.544011, abs=1e-6)


def test_kd_loss_by_hand():
    # Step 1: drafter p = (1/4, 3/4), base q = (3/4, 1/4): KL(q || p) = 3/4 ln 3 - 1/4 ln 3 = 1/2 ln 3 = 0.549306;
    #   top-1 disagrees.
    # Step 2: p = q = (1/4, 3/4): KL 0; p = (1/4, 3/4), q = (1/3, 2/3): KL = 1/3 ln(4/3) + 2/3 ln(8/9)
    #   = 0.095894 - 0.078522 = 0.017372; mean 0.008686; top-1 agrees at both.
    # Loss = 0.549306 + 0.008686 = 0.557992.
    drafter = [torch.tensor([[0.0, LN3]]), torch.tensor([[0.0, LN3], [0.0, LN3]])]
    base = [torch.tensor([[LN3, 0.0]]), torch.tensor([[0.0, LN3], [0.0, math.log(2)]])]
    loss, parts = kd_loss(drafter, base)
    assert parts["kl1"].item() == pytest.approx(0.549306, abs=1e-6)
    assert parts["kl2"].item() == pytest.approx(0.008686, abs=1e-6)
    assert (parts["top1_1"].item(), parts["top1_2"].item()) == (0.0, 1.0)
    assert loss.item() == pytest.approx(0.557992, abs=1e-6)
    # Medusa's weights: 0.8 * 0.549306 + 0.64 * 0.008686 = 0.439445 + 0.005559 = 0.445004.
    assert kd_loss(drafter, base, decay=0.8)[0].item() == pytest.approx(0.445004, abs=1e-6)


@pytest.mark.parametrize("stage,extra,key", [
    ("medusa", dict(num_heads=3), "head1"),
    ("medusa", dict(num_heads=3, distill=True), "kl1"),
    ("medusa", dict(num_heads=3, tied_lm_head=True, lr=3e-2), "head1"),  # ResBlocks alone: a larger step
    ("medusa2", dict(num_heads=2, heads_warmup=2, backbone_lr=1e-3), "head1"),
    ("redrafter", dict(draft_steps=3), "kl1"),
])
def test_stage_lowers_its_loss_and_reports_accuracy(tmp_path, teacher_dir, greedy, stage, extra, key):
    cfg = write_config(tmp_path / "c.json", base=str(teacher_dir), data=str(greedy), eval_data=str(greedy),
                       out=str(tmp_path / "o"), steps=8, **(FAST | extra))
    assert run(stage, cfg) == 0
    loss = losses(tmp_path / "o")
    assert len(loss) == 8 and loss[-1] < 0.8 * loss[0]
    assert losses(tmp_path / "o", key)[-1] < losses(tmp_path / "o", key)[0]
    report = json.loads((tmp_path / "o" / "report.json").read_text())["heldout"]
    ahead = extra.get("num_heads") or extra["draft_steps"]
    assert len(report["top1"]) == ahead and all(0 <= a <= 1 for a in report["top1"])
    assert report["positions"] == sorted(report["positions"], reverse=True) and report["examples"] == 6
    exported = {"medusa": "medusa", "medusa2": "model/medusa", "redrafter": "redrafter"}[stage]
    assert (tmp_path / "o" / exported / "config.json").is_file()
    if stage == "medusa2":
        # The KL to the original is 0 before the backbone moves: it stays frozen during the heads' warm-up.
        assert losses(tmp_path / "o", "kl")[:2] == [0.0, 0.0] and losses(tmp_path / "o", "kl")[-1] > 0
        assert 0 <= report["base_top1"] <= 1  # the changed backbone's agreement with the original's greedy tokens
        # The changed backbone stays a Llama (Hugging Face's format), which the runtime reads with its heads beside it.
        assert json.loads((tmp_path / "o" / "model" / "config.json").read_text())["model_type"] == "llama"
        from mlx_hybrid.loader import load_model
        from mlx_hybrid.speculative import load_proposer

        target = load_model(tmp_path / "o" / "model")
        assert load_proposer("medusa", target, tmp_path / "o" / "model").heads.config.medusa_num_heads == 2
    else:
        assert report["base_top1"] == 1.0  # the data are the base's greedy continuations


def test_checkpointing_through_the_medusa_wrapper_without_deprecation(teacher_dir):
    """Medusa-2's wrapper turns the backbone's activation checkpointing on and off, under the name
    this transformers has, without its deprecation warning."""
    import warnings

    from hybrid_train.heads import MedusaLM
    from hybrid_train.train import set_checkpointing

    base = load_teacher(teacher_dir)
    model = MedusaLM(base, MedusaHeads.for_base(base, 2))
    checkpointed = lambda: any(getattr(m, "gradient_checkpointing", False) for m in base.modules())  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        set_checkpointing(model, True)
        assert checkpointed()
        set_checkpointing(model, False)
        assert not checkpointed()


def test_draft_accuracy_by_hand():
    # One response of 6 tokens after a 1-token prompt; the draft is right at response positions
    # 0, 1, 3, 4, 5. With K = 2 the runs of agreeing tokens from each position, capped at 2, are
    # 2, 1, 0, 2, 2, 1: accepted 8/6, top-1 5/6.
    response = [1, 2, 3, 4, 5, 6]
    guesses = [1, 2, 0, 4, 5, 6]

    class Fixed:
        def __call__(self, input_ids, use_cache):
            logits = torch.zeros(1, input_ids.shape[1], 8)
            for t, g in enumerate(guesses):
                logits[0, t, g] = 1.0
            logits[0, 6, 7] = 1.0  # the position after the response has no label
            return type("Out", (), {"logits": logits})

    got = draft_accuracy(Fixed(), [example([9], response, 64)], "cpu", num_draft=2)
    assert got["top1"] == pytest.approx(5 / 6) and got["accepted"] == pytest.approx(8 / 6) and got["positions"] == 6


def test_medusa2_refuses_tied_heads(tmp_path, teacher_dir, greedy, capsys):
    cfg = write_config(tmp_path / "c.json", base=str(teacher_dir), data=str(greedy), out=str(tmp_path / "o"), steps=2,
                       tied_lm_head=True, **FAST)
    assert run("medusa2", cfg) == 1
    assert "tied_lm_head is for Medusa-1" in capsys.readouterr().err


def test_medusa2_starts_from_medusa1_heads(tmp_path, teacher_dir, greedy):
    common = dict(base=str(teacher_dir), data=str(greedy), steps=4, num_heads=2, **FAST)
    assert run("medusa", write_config(tmp_path / "a.json", out=str(tmp_path / "m1"), **common)) == 0
    cfg = write_config(tmp_path / "b.json", out=str(tmp_path / "m2"), init_heads=str(tmp_path / "m1" / "medusa"),
                       heads_warmup=4, **common)
    assert run("medusa2", cfg) == 0
    # With the backbone held for all 4 steps, Medusa-2's first step is Medusa-1's fifth:
    # its heads loss continues below Medusa-1's first.
    first = losses(tmp_path / "m2", "head1")[0]
    assert first < losses(tmp_path / "m1", "head1")[0]
    # A head set of another shape is a one-line error.
    bad = write_config(tmp_path / "c.json", **dict(common, num_heads=3), out=str(tmp_path / "m3"), init_heads=str(tmp_path / "m1" / "medusa"))
    assert run("medusa2", bad) == 1


@pytest.mark.parametrize("stage,extra", [("medusa2", dict(num_heads=2, heads_warmup=2)), ("redrafter", dict(draft_steps=2))])
def test_resume_equals_uninterrupted(tmp_path, teacher_dir, greedy, stage, extra):
    # min_lr = lr keeps the schedule flat, so a 3-step run resumed as a 6-step one is the 6-step run.
    common = dict(base=str(teacher_dir), data=str(greedy), batch_size=3, lr=3e-3, min_lr=3e-3, save_every=3, seed=7, **extra)
    assert run(stage, write_config(tmp_path / "full.json", out=str(tmp_path / "full"), steps=6, **common)) == 0
    assert run(stage, write_config(tmp_path / "k.json", out=str(tmp_path / "part"), steps=3, **common)) == 0
    assert run(stage, write_config(tmp_path / "k.json", out=str(tmp_path / "part"), steps=6, **common)) == 1  # needs --resume
    assert run(stage, tmp_path / "k.json", "--resume") == 0
    exported = "model/medusa" if stage == "medusa2" else "redrafter"
    for sub in [exported] + (["model"] if stage == "medusa2" else []):
        a, b = load_file(tmp_path / "full" / sub / "model.safetensors"), load_file(tmp_path / "part" / sub / "model.safetensors")
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(b[name], a[name], atol=0, rtol=0)
    assert losses(tmp_path / "part") == losses(tmp_path / "full")


def test_bad_head_configs_fail_with_one_line(tmp_path, teacher_dir, greedy, capsys):
    assert run("medusa", write_config(tmp_path / "a.json", data=str(greedy), out="x", steps=1)) == 1
    assert capsys.readouterr().err.strip() == "error: config: 'base' is required"
    assert run("redrafter", write_config(tmp_path / "b.json", base=str(teacher_dir), data=str(greedy), out="x", steps=1,
                                         draft_steps=0)) == 1
    assert "draft_steps must be at least 1" in capsys.readouterr().err
    assert run("draft", write_config(tmp_path / "c.json", base=str(teacher_dir), data=str(greedy), out="x", steps=1,
                                     layers=[0, 7])) == 1
    assert capsys.readouterr().err.strip() == "error: layers must be increasing layer indices in [0, 4), got [0, 7]"


# --- the MLX runtime reads the exports -------------------------------------------------------------

mx = pytest.importorskip("mlx.core")


def _mlx_target(teacher_dir):
    from mlx_hybrid.loader import load_model

    return load_model(teacher_dir, dtype="float32")


@pytest.mark.parametrize("tied", [False, True])
def test_medusa_export_in_the_mlx_runtime(tmp_path, teacher_dir, greedy, tied):
    """tied: the heads end with the base's LM head, which they neither train nor save."""
    from mlx_hybrid.decode import generate_step
    from mlx_hybrid.speculative.calibration import greedy_runs
    from mlx_hybrid.speculative.medusa import head_accuracies, load_medusa

    base = load_teacher(teacher_dir)
    heads = perturb(MedusaHeads.for_base(base, num_heads=3, num_layers=2, tied_lm_head=tied))
    save_heads(heads, heads.config(), tmp_path / "medusa")
    saved = load_file(tmp_path / "medusa" / "model.safetensors")
    assert ("medusa_head.0.2.weight" in saved) == (not tied)
    assert json.loads((tmp_path / "medusa" / "config.json").read_text()).get("tied_lm_head", False) == tied
    target = _mlx_target(teacher_dir)
    loaded = load_medusa(tmp_path / "medusa", target, dtype="float32")
    h = torch.randn(1, 20, base.config.hidden_size)
    with torch.no_grad():
        expected = np.stack([(base.lm_head(head(h[0])) if tied else head(h[0])).numpy() for head in heads.medusa_head])
    np.testing.assert_allclose(np.array(loaded(mx.array(h[0].numpy()))), expected, atol=ATOL, rtol=0)

    # The positions: the runtime's head accuracies (head k against the token k+1 after the hidden
    # state's own next token, on the target's greedy continuations) equal the ones measured here.
    tok = load_tokenizer(teacher_dir)
    prompts = [tok(s, add_special_tokens=True).input_ids for s in SENTENCES[:3]]
    acc = head_accuracies(loaded, greedy_runs(target, prompts, 12), topk=1)[:, 0]
    conts = [[t for t, _ in generate_step(mx.array(p), target, target.make_cache(), lambda x: mx.argmax(x, -1), max_tokens=12)]
             for p in prompts]
    ours = top1_accuracy(base, [example(p, c, 64) for p, c in zip(prompts, conts)], "cpu", medusa=heads)
    np.testing.assert_allclose(ours["top1"], acc, atol=1e-9)
    assert ours["base_top1"] == 1.0  # MLX's greedy continuation is torch's


@pytest.mark.parametrize("exit_dim,rnn,tied", [(None, True, False), (96, True, False), (None, False, False), (None, True, True)])
def test_redrafter_export_in_the_mlx_runtime(tmp_path, teacher_dir, exit_dim, rnn, tied):
    """tied: the drafter ends with the base's LM head, which it neither trains nor saves."""
    from mlx_hybrid.speculative.redrafter import load_redrafter

    base = load_teacher(teacher_dir)
    drafter = perturb(Drafter.for_base(base, exit_dim=exit_dim, num_draft_layers=2, rnn=rnn, tied_lm_head=tied))
    save_heads(drafter, drafter.config(beam_width=2, beam_length=4), tmp_path / "redrafter")
    config = json.loads((tmp_path / "redrafter" / "config.json").read_text())
    saved = load_file(tmp_path / "redrafter" / "model.safetensors")
    assert ("input_proj.weight" in saved) == (exit_dim is not None or tied)
    assert ("lm_head.2.weight" in saved) == (not tied) and config.get("tied_lm_head", False) == tied
    target = _mlx_target(teacher_dir)
    loaded = load_redrafter(tmp_path / "redrafter", target, dtype="float32")
    H = base.config.hidden_size
    assert (loaded.config.beam_width, loaded.config.beam_length) == (2, 4) and config["exit_dim"] == (H if tied else exit_dim or 2 * H)

    ids = torch.tensor([load_tokenizer(teacher_dir)(SENTENCES[1]).input_ids])
    L, T = ids.shape[1], 3
    with torch.no_grad():
        h = hidden_states(base, ids)
        e = base.get_input_embeddings()(ids)
        ours = drafter(h, e, [torch.ones(1, L - j, dtype=torch.bool) for j in range(1, T + 1)])  # every position
    # The runtime, step by step: s_j = step(s_{j-1}, embed(token t+j)), logits(h_t, s_j), all t at once.
    hm, tokens = mx.array(h[0].numpy()), mx.array(ids[0].numpy())
    state = mx.zeros((L, base.config.hidden_size))
    for j in range(1, T + 1):
        state = loaded.step(state[: L - j], target.model.embed_tokens(tokens[j:]))
        np.testing.assert_allclose(np.array(loaded.logits(hm[: L - j], state)), ours[j - 1].numpy(), atol=ATOL, rtol=0)
    # Beam search of width 1 after root token t+1 drafts step 1's top-1 at position t.
    for t in range(0, L - 1, 3):
        beam = np.array(loaded.beam_search(hm[t][None], mx.array([int(ids[0, t + 1])]), target.model.embed_tokens, 1, 2)[-1])
        assert beam[0, 0, 1] == int(ours[0][t].argmax())


def test_draft_stage(tmp_path, teacher_dir, greedy):
    """The draft stage lowers its KL, exports a 2-layer Llama (its logits in the MLX runtime those of
    torch within ATOL, and mlx-lm loads it), and the base itself, as a draft, agrees everywhere:
    accepted is then the mean of min(K, tokens left in the continuation)."""
    cfg = write_config(tmp_path / "c.json", base=str(teacher_dir), data=str(greedy), eval_data=str(greedy),
                       out=str(tmp_path / "o"), steps=8, layers=[0, 2], num_draft=3, **FAST)
    assert run("draft", cfg) == 0
    kl = losses(tmp_path / "o", "kl")
    assert len(kl) == 8 and kl[-1] < 0.8 * kl[0]
    report = json.loads((tmp_path / "o" / "report.json").read_text())["heldout"]
    assert 0 <= report["top1"] <= report["accepted"] <= 3 and report["examples"] == 6
    exported = tmp_path / "o" / "draft"
    config = json.loads((exported / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"]) == ("llama", 2)

    from mlx_lm.utils import load_model as lm_load_model

    from mlx_hybrid.loader import load_model

    ids = load_tokenizer(teacher_dir)(SENTENCES[2]).input_ids
    with torch.no_grad():
        expected = load_teacher(exported)(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(np.array(load_model(exported, dtype="float32")(mx.array([ids]))[0]), expected, atol=ATOL, rtol=0)
    assert lm_load_model(exported)[0].args.num_hidden_layers == 2

    held = examples_from(greedy, 64)
    whole = draft_accuracy(load_teacher(teacher_dir), held, "cpu", num_draft=3)
    left = [n - i for _, labels in held for n in [sum(y != IGNORE for y in labels)] for i in range(n)]
    assert whole["top1"] == 1.0 and whole["accepted"] == pytest.approx(np.minimum(left, 3).mean(), abs=1e-12)


def test_heads_on_a_hybrid_base(tmp_path, teacher_dir, prompts):
    student = convert_layers(load_teacher(teacher_dir), ["attention", "mamba2", "attention", "mamba2"], HybridArgs(d_state=8))
    perturb(student, seed=1)
    hybrid = tmp_path / "hybrid"
    save_hybrid(student, hybrid, load_tokenizer(teacher_dir))
    cfg = write_config(tmp_path / "pl.json", teacher=str(hybrid), prompts=str(prompts), out=str(tmp_path / "l.jsonl"),
                       max_new_tokens=8, batch_size=4, chat=False)
    assert run("pseudo-labels", cfg) == 0
    # Its own greedy continuations: decoding by hand, a full forward per token, one prompt at a time.
    model, eos = load_base(hybrid), load_tokenizer(hybrid).eos_token_id
    rows = [json.loads(line) for line in (tmp_path / "l.jsonl").read_text().splitlines()]
    assert len({len(r["prompt_ids"]) for r in rows}) > 1  # prompts of several lengths were batched apart
    for r in rows:
        seq = list(r["prompt_ids"])
        with torch.no_grad():
            while len(seq) - len(r["prompt_ids"]) < 8 and (len(seq) == len(r["prompt_ids"]) or seq[-1] != eos):
                seq.append(int(model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
        assert r["response_ids"] == seq[len(r["prompt_ids"]):]
    cfg = write_config(tmp_path / "m.json", base=str(hybrid), data=str(tmp_path / "l.jsonl"),
                       eval_data=str(tmp_path / "l.jsonl"), out=str(tmp_path / "m"), steps=4, num_heads=2, **FAST)
    assert run("medusa", cfg) == 0
    assert json.loads((tmp_path / "m" / "report.json").read_text())["heldout"]["base_top1"] == 1.0
    assert losses(tmp_path / "m")[-1] < losses(tmp_path / "m")[0]


def test_real_heads_script(tmp_path, teacher_dir, article_corpus):
    corpus = article_corpus
    out = tmp_path / "out"
    settings = yaml.safe_load((ROOT / "configs" / "real_heads.yaml").read_text())
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(dict(settings, stages=["medusa1", "redrafter", "medusa2", "draft"])))
    cmd = [sys.executable, str(ROOT / "scripts" / "real_heads.py"), "--base", str(teacher_dir), "--corpus", str(corpus),
           "--out", str(out), "--tiny", "--settings", str(tmp_path / "s.yaml")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert len(report["medusa1"]["top1"]) == 3 and len(report["redrafter"]["top1"]) == 3
    assert len(report["medusa2"]["top1"]) == 3 and 0 <= report["medusa2"]["base_top1"] <= 1
    assert json.loads((out / "configs" / "medusa2.json").read_text())["init_heads"] == str(out / "medusa1" / "medusa")
    # 8 news windows and 4 held out, plus the base's own questions: the last 2 held out, the rest trained on.
    asked = report["chat_questions"]
    assert asked > 2 and report["train_sequences"] == 8 + asked - 2 and report["heldout_sequences"] == 4 + 2
    assert len((out / "chat.jsonl").read_text().splitlines()) == asked - 2
    assert set(report["seconds"]) == {"pseudo-labels-prompts", "pseudo-labels-heldout", "questions", "pseudo-labels-chat",
                                      "pseudo-labels-chat-heldout", "medusa1", "redrafter", "medusa2", "draft", "total"}
    assert (out / "medusa1" / "medusa" / "config.json").is_file() and (out / "redrafter" / "redrafter" / "config.json").is_file()
    assert (out / "medusa2" / "model" / "medusa" / "config.json").is_file()
    assert 0 <= report["draft"]["top1"] <= 1 and (out / "draft" / "draft" / "config.json").is_file()


def test_medusa2_under_fsdp_equals_one_process(tmp_path, teacher_dir, greedy):
    """Sharded over two processes (gloo), Medusa-2 keeps its parameter groups (heads and backbone at
    their own lr, the backbone's schedule starting late) and shards the frozen original: it ends
    with the one-process run's heads and backbone, up to the order of float32 sums (tolerance as in
    test_train_fsdp.py)."""
    common = dict(base=str(teacher_dir), data=str(greedy), eval_data=str(greedy), steps=4, batch_size=4, micro_batch=1,
                  lr=1e-3, backbone_lr=1e-3, save_every=2, seed=7, num_heads=2, heads_warmup=2, parallel="fsdp",
                  teacher_sharding="shard")
    assert run("medusa2", write_config(tmp_path / "one.json", out=str(tmp_path / "one"), **common)) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "hybrid_train", "medusa2",
           "--config", str(write_config(tmp_path / "two.json", out=str(tmp_path / "two"), **common))]
    done = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for sub in ("model/medusa", "model"):
        a, b = load_file(tmp_path / "one" / sub / "model.safetensors"), load_file(tmp_path / "two" / sub / "model.safetensors")
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(b[name], a[name], atol=1e-4, rtol=0)
    assert json.loads((tmp_path / "two" / "report.json").read_text())["heldout"]["top1"]
