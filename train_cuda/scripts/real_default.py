"""The default-model run: a full-size 50% Mamba2 hybrid of the teacher whose embeddings, MLPs and
attention layers stay the teacher's (frozen), with a ReDrafter drafter on the teacher's LM head:
`hybrid chat`'s embedded default, of which only the trained parts ship (docs/models.md).

    python train_cuda/scripts/real_default.py --teacher TEACHER --corpus CORPUS_DIR --out OUT [--settings YAML] [--tiny] [--resume]
    hybrid convert OUT/student/model OUT/q8 -q --bits 8 --group-size 64 --dtype float16 --redrafter OUT/redrafter/redrafter
    python -m mlx_hybrid.convert.default_model OUT/q8 TEACHER.gguf GENERATION_CONFIG.json mlx_hybrid/data/default --force

With `--settings configs/real_hybrid_target.yaml` the same stages make the speed benchmark's hybrid
target instead (MLPs frozen only, its own drafter LM head); a settings file may also shrink the
student (`layers`, `vocab_size`: hybrid_train/shrink.py).

TEACHER: a Hugging Face Llama/Mistral directory or a .gguf file (converted once into OUT/teacher;
needs the gguf and accelerate packages). CORPUS_DIR: train.txt and heldout.txt, one document a
line (scripts/fetch_corpus.py). Stages (settings: configs/real_default.yaml; --tiny shrinks them):

1. news: the teacher continues two-sentence windows of train.txt (sampled, `samples` times each);
2. questions: the teacher writes user turns itself (Magpie: its chat template up to the user's
   turn, sampled), deduplicated, the speed benchmark's (benchmarks/chat_prompts.txt) dropped;
   chat: the teacher answers them (sampled);
3. student: `distill` into the student with every 2nd layer Mamba2 (the settings' `freeze` parts kept
   the teacher's), on the news, chat and train.txt text, KL to the teacher on every label; with an
   `end-to-end` section (configs/real_quality_e2e.yaml), a second `distill` from that student on
   the same data, its own `freeze` (the parts it names stay the teacher's) and learning rate: the
   later stages then take this student, and perplexity reports both;
4. drafter-labels: the student's own greedy continuations of windows of its training sequences
   (chat turns and news, the first `context` tokens); redrafter: the drafter distilled from the
   student along them, top-1 per step on continuations of other windows and of heldout.txt;
5. perplexity of teacher and student on heldout.txt and on held-out chat answers (the last
   `questions.heldout`, kept out of the distillation data), as word perplexity: the vocabularies differ.

A finished stage is skipped, so a killed run restarted with --resume goes on where it stopped.
OUT/report.json gets the numbers and timings.
"""

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
from real_run import check_corpus, finish, head_dim, hf_model, make_prompts, script_main, stage, start  # noqa: E402

from hybrid_train.errors import TrainError  # noqa: E402
from hybrid_train.teacher import load_tokenizer  # noqa: E402

SETTINGS = HERE.parent / "configs" / "real_default.yaml"
BENCHMARK_PROMPTS = HERE.parents[1] / "benchmarks" / "chat_prompts.txt"
TINY = {  # sizes for the CPU test of this script
    "news": {"max_prompts": 8},
    "questions": {"count": 8, "heldout": 2, "max_new_tokens": 12, "batch_size": 4, "ended_only": False, "min_chars": 1},
    "pseudo-labels": {"max_new_tokens": 12, "batch_size": 4},
    "student": {"steps": 3, "batch_size": 4, "seq_len": 64, "warmup_steps": 1, "save_every": 2},
    "end-to-end": {"steps": 2, "batch_size": 4, "seq_len": 64, "warmup_steps": 1, "save_every": 2},
    "drafter-labels": {"prompts": 6, "heldout": 4, "context": 8, "max_new_tokens": 8, "batch_size": 4},
    "redrafter": {"draft_steps": 2, "steps": 3, "batch_size": 4, "seq_len": 64, "warmup_steps": 1, "save_every": 2},
    "perplexity": {"seq_len": 32, "max_blocks": 4},
}


def user_turn_prefix(tokenizer) -> str:
    """The chat template's text up to the user's words (system prompt included): the teacher
    continues it with a question of its own (Magpie)."""
    marker = "\x00MARK\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return text[: text.index(marker)]


def questions(labels: Path, eos: int | None, min_chars: int) -> list[str]:
    """The teacher's user turns, one line each, without short or repeated ones or the speed
    benchmark's prompts (benchmarks/chat_prompts.txt: never trained on); with eos, only those it
    ended itself (with that end-of-turn token)."""
    seen = {q.strip().lower() for q in BENCHMARK_PROMPTS.read_text().splitlines()} if BENCHMARK_PROMPTS.is_file() else set()
    out = []
    for row in map(json.loads, labels.read_text().splitlines()):
        q = " ".join(row["response"].split())
        ended = eos is None or row["response_ids"][-1:] == [eos]
        if ended and len(q) >= min_chars and q.lower() not in seen:
            seen.add(q.lower())
            out.append(q)
    return out


def windows(texts, tokenizer, length: int, count: int) -> list[str]:
    """The first `length` tokens of the texts that are longer, as text (special tokens kept), the
    first `count` of them. Prompts of one length generate in few batches: a hybrid base has no KV
    cache in transformers, so `pseudo-labels` batches only prompts of equal length."""
    out = []
    for text in texts:
        if len(out) == count:
            break
        ids = tokenizer(text, add_special_tokens=False).input_ids
        window = tokenizer.decode(ids[:length])
        if len(ids) > length and "\ufffd" not in window:  # not cut inside a character
            out.append(window)
    return out


def write_prompts(path: Path, prompts: list[str]) -> Path:
    """A .jsonl prompt file (`pseudo-labels` reads .jsonl prompts as they are: they may hold newlines)."""
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def split_chat(chat: Path, heldout: int) -> tuple[Path, Path]:
    """The chat answers but the last `heldout` (distillation data), and those as text, question and
    answer on one line each (held-out chat perplexity)."""
    rows = chat.read_text().splitlines()
    if len(rows) <= heldout:
        raise TrainError(f"{len(rows)} chat answers: fewer than heldout ({heldout}) + 1")
    train = chat.with_name("chat-train.jsonl")
    train.write_text("".join(r + "\n" for r in rows[:-heldout]))
    text = chat.with_name("chat-heldout.txt")
    text.write_text("".join(" ".join(f"{r['prompt']} {r['response']}".split()) + "\n" for r in map(json.loads, rows[-heldout:])))
    return train, text


def merge(paths: list[Path], out: Path) -> Path:
    out.write_text("".join(p.read_text() for p in paths))
    return out


def run(args) -> int:
    check_corpus(args.corpus)
    s, out, timings, began = start(args, SETTINGS, TINY)
    teacher = hf_model(args.teacher, out / "teacher", timings)
    sampled = {k: s["pseudo-labels"][k] for k in ("max_new_tokens", "batch_size", "temperature", "top_p", "seed")}

    def labels(name: str, model: Path, prompts: Path, chat: bool, settings: dict) -> Path:
        path = out / f"{name}.jsonl"
        if not path.is_file():
            cfg = dict(settings, teacher=str(model), prompts=str(prompts), out=str(path), chat=chat)
            stage(name, cfg, out, False, timings, kind="pseudo-labels")
        return path

    p = s["news"]
    news_prompts = make_prompts(args.corpus / "train.txt", p["sentences"], p["stride"], p["max_prompts"])
    news = labels("news", teacher, write_prompts(out / "news-prompts.jsonl", news_prompts * p["samples"]), False, sampled)

    q = dict(s["questions"])
    tokenizer = load_tokenizer(teacher)
    prefix = user_turn_prefix(tokenizer)
    seeds = write_prompts(out / "question-prompts.jsonl", [prefix] * q.pop("count"))
    ended_only, min_chars, held_chat = q.pop("ended_only"), q.pop("min_chars"), q.pop("heldout")
    asked = questions(labels("questions", teacher, seeds, False, q), tokenizer.eos_token_id if ended_only else None, min_chars)
    if not asked:
        raise TrainError("the teacher wrote no usable questions: check its chat template")
    chat = labels("chat", teacher, write_prompts(out / "chat-prompts.jsonl", asked), True, sampled)
    chat_train, chat_heldout = split_chat(chat, held_chat)

    distill_data = str(merge([news, chat_train], out / "distill.jsonl"))

    def distill(section: str, student: Path, **extra):
        """A distill stage from the settings' section, on the news and chat data and train.txt text."""
        if not (student / "model" / "config.json").is_file():
            cfg = dict(s[section], teacher=str(teacher), data=distill_data, hybrid={"d_state": head_dim(teacher)},
                       text=[str(args.corpus / t) for t in s[section].get("text", [])], out=str(student), **extra)
            stage(section, cfg, out, args.resume, timings, kind="distill")
        return student

    students = [distill("student", out / "student")]
    if "end-to-end" in s:  # MambaInLlama's second stage: the parts frozen so far train too, at a lower rate
        students.append(distill("end-to-end", out / "student-e2e", init=str(students[0] / "model"),
                                attention=s["student"].get("attention", {"every": 2}), mixer=s["student"].get("mixer", "mamba2")))
    student = students[-1]

    d = dict(s["drafter-labels"])
    count, held_count, context = d.pop("prompts"), d.pop("heldout"), d.pop("context")
    student_tokenizer = load_tokenizer(student / "model")
    rows = [r["prompt_ids"] + r["response_ids"] for r in map(json.loads, (out / "distill.jsonl").read_text().splitlines())]
    random.Random(0).shuffle(rows)
    docs = [line for line in (args.corpus / "heldout.txt").read_text(encoding="utf-8").splitlines() if line.strip()]
    train_windows = windows(map(tokenizer.decode, rows), student_tokenizer, context, count + held_count // 2)
    held = train_windows[count:] + windows(docs, student_tokenizer, context, held_count - held_count // 2)
    drafter_data = {name: labels(f"student-{name}", student / "model", write_prompts(out / f"student-{name}-prompts.jsonl", p), False, d)
                    for name, p in (("train", train_windows[:count]), ("heldout", held))}
    redrafter = out / "redrafter"
    if not (redrafter / "report.json").is_file():
        cfg = dict(s["redrafter"], base=str(student / "model"), out=str(redrafter),
                   data=str(drafter_data["train"]),
                   eval_data=str(drafter_data["heldout"]))
        stage("redrafter", cfg, out, args.resume, timings)

    ppl = {}
    for name, text in (("news", args.corpus / "heldout.txt"), ("chat", chat_heldout)):
        ppl[name] = out / f"perplexity-{name}.json"
        stage(f"perplexity-{name}", dict(s["perplexity"], models=[str(teacher)] + [str(m / "model") for m in students],
                                         text=[str(text)], out=str(ppl[name])), out, False, timings, kind="perplexity")
    report = {
        "teacher": str(args.teacher),
        "corpus": str(args.corpus),
        "news_prompts": len(news_prompts),
        "questions": len(asked),
        "perplexity": {name: json.loads(path.read_text()) for name, path in ppl.items()},
        "redrafter": json.loads((redrafter / "report.json").read_text())["heldout"],
    }
    return finish(out, report, timings, began)


if __name__ == "__main__":
    sys.exit(script_main(__doc__, "teacher", run))
