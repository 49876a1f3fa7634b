#!/usr/bin/env python
"""Chat quality on held-out questions: accuracy, agreement with a teacher, loops, end-of-turn.

Each question of benchmarks/data/questions.jsonl is asked alone (one user turn, no system prompt
of ours: the chat template's own default applies, as in `hybrid chat` without --system), rendered
by `mlx_hybrid.chat.render_chat` and answered by `mlx_hybrid.generate.stream_generate` with
--max-tokens. A reply is correct when one of the question's patterns (regular expressions,
case-insensitive) matches anywhere in it.

For each model and sampling setting:

- accuracy: correct replies / replies;
- agreement where the teacher is right (with --teacher): over the questions the teacher's greedy
  reply gets right, the mean fraction of the model's replies that are right;
- loops: for each of the 20 loop prompts (`"loop_set": true`), the largest number of times one
  4-gram of generated token ids occurs in the reply (overlapping occurrences, the end-of-turn token
  excluded); a prompt loops when that count exceeds 3;
- ended: the fraction of replies whose last token is one of the tokenizer's end-of-turn (EOS)
  tokens, rather than stopped at --max-tokens.

The teacher always answers greedily (its reference answers). The model answers greedily by
default, with --temp / --top-p / --repetition-penalty, or with each setting of a small grid
(--sweep). A sampled setting draws --samples replies per question, reply s of question i with seed
--seed + 1000 s + i, so a rerun gives the same replies; greedy draws one. --sweep picks the setting
with the highest agreement (accuracy without a teacher) among those with no looping prompt.

    python -m benchmarks.chat_quality --teacher path/to/SmolLM2-135M-Instruct.Q4_1.gguf --sweep   # the default model
    python -m benchmarks.chat_quality --model path/to/student --teacher path/to/smollm2 --sweep --limit 30
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
QUESTIONS = BENCH_DIR / "data" / "questions.jsonl"
NGRAM = 4
LOOP_LIMIT = 3  # a prompt loops when one 4-gram occurs more often than this
LOOP_PROMPTS = 20
SWEEP = dict(temp=(0.0, 0.3, 0.6), top_p=(0.9,), repetition_penalty=(1.0, 1.1, 1.2))


# ----------------------------------------------------------------------------- scoring


def load_questions(path: Path = QUESTIONS) -> list[dict]:
    """The questions of a JSONL file, checked: fields, kinds, unique ids, patterns that compile."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    seen = set()
    for r in rows:
        if set(r) - {"loop_set"} != {"id", "kind", "question", "answers"}:
            raise ValueError(f"{path}: row {r.get('id')!r} needs exactly id, kind, question, answers (and loop_set)")
        if r["id"] in seen:
            raise ValueError(f"{path}: id {r['id']!r} appears twice")
        seen.add(r["id"])
        if r["kind"] not in ("fact", "instruction"):
            raise ValueError(f"{path}: {r['id']}: kind must be fact or instruction, got {r['kind']!r}")
        if not r["answers"] or not all(isinstance(a, str) for a in r["answers"]):
            raise ValueError(f"{path}: {r['id']}: answers must be a non-empty list of patterns")
        for a in r["answers"]:
            re.compile(a, re.I)
    return rows


def is_correct(reply: str, patterns: list[str]) -> bool:
    """Whether any pattern matches anywhere in reply, case-insensitively."""
    return any(re.search(p, reply, re.I) for p in patterns)


def max_ngram_count(tokens: list[int], n: int = NGRAM) -> int:
    """The most times one n-gram occurs in tokens, overlapping occurrences counted (0 when
    shorter than n)."""
    counts = Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))
    return max(counts.values(), default=0)


def ended_on_eot(tokens: list[int], eos: set[int]) -> bool:
    """Whether the reply's last token is an end-of-turn token (not cut at max tokens)."""
    return bool(tokens) and tokens[-1] in eos


def agreement(model_scores: dict[str, float], teacher_correct: dict[str, bool]) -> float | None:
    """Mean of the model's per-question score (fraction of its replies right) over the questions
    the teacher gets right; None when the teacher gets none right."""
    right = [q for q, ok in teacher_correct.items() if ok]
    return sum(model_scores[q] for q in right) / len(right) if right else None


def summarize(records: list[dict], questions: list[dict], teacher_correct: dict[str, bool] | None) -> dict:
    """A setting's numbers from its per-reply records."""
    loop_ids = [q["id"] for q in questions if q.get("loop_set")]
    by_q = {q["id"]: [r for r in records if r["id"] == q["id"]] for q in questions}
    scores = {q: sum(r["correct"] for r in rs) / len(rs) for q, rs in by_q.items()}
    worst = {q: max(r["max_4gram"] for r in by_q[q]) for q in loop_ids}
    return dict(
        replies=len(records),
        accuracy=sum(r["correct"] for r in records) / len(records),
        agreement=agreement(scores, teacher_correct) if teacher_correct is not None else None,
        teacher_right=sum(teacher_correct.values()) if teacher_correct is not None else None,
        loop_prompts=len(loop_ids),
        looping=sum(c > LOOP_LIMIT for c in worst.values()),
        max_4gram=worst,
        ended=sum(r["ended"] for r in records) / len(records),
        tokens=sum(r["tokens"] for r in records),
    )


# ----------------------------------------------------------------------------- running


def settings(args) -> list[dict]:
    """The sampling settings to run: the grid (greedy once, top_p only above temperature 0), or the flags'."""
    if not args.sweep:
        return [dict(temp=args.temp, top_p=args.top_p, repetition_penalty=args.repetition_penalty)]
    out = []
    for temp in SWEEP["temp"]:
        for top_p in SWEEP["top_p"] if temp > 0 else (1.0,):
            for rp in SWEEP["repetition_penalty"]:
                out.append(dict(temp=temp, top_p=top_p, repetition_penalty=rp))
    return out


def describe(s: dict) -> str:
    if s["temp"] == 0 and s["repetition_penalty"] == 1.0:
        return "greedy"
    head = "greedy" if s["temp"] == 0 else f"temp {s['temp']:g}, top-p {s['top_p']:g}"
    return head + (f", rep. penalty {s['repetition_penalty']:g}" if s["repetition_penalty"] != 1.0 else "")


def answer_all(model, tokenizer, questions, setting: dict, samples: int, seed: int, max_tokens: int, advance) -> list[dict]:
    """One record per reply: the question, the reply, and what it scores."""
    from mlx_hybrid.chat import render_chat
    from mlx_hybrid.generate import stream_generate
    from mlx_hybrid.sampling import SamplingParams

    eos = set(tokenizer.eos_token_ids)
    greedy = setting["temp"] == 0
    rp = setting["repetition_penalty"]
    records = []
    for i, q in enumerate(questions):
        for s in range(1 if greedy else samples):
            sample_seed = None if greedy else seed + 1000 * s + i
            sampling = SamplingParams(temp=setting["temp"], top_p=setting["top_p"],
                                      repetition_penalty=None if rp == 1.0 else rp, seed=sample_seed)
            prompt = render_chat(tokenizer, [{"role": "user", "content": q["question"]}])
            text, tokens = "", []
            for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, sampling=sampling):
                text += r.text
                tokens.append(r.token)
            body = tokens[:-1] if ended_on_eot(tokens, eos) else tokens
            records.append(dict(id=q["id"], sample=s, seed=sample_seed, reply=text, correct=is_correct(text, q["answers"]),
                                tokens=len(tokens), max_4gram=max_ngram_count(body), ended=ended_on_eot(tokens, eos)))
            advance()
    return records


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="the model directory to score (default: the embedded default model)")
    p.add_argument("--teacher", type=Path, help="the reference model, a directory or a GGUF file: agreement counts the questions it gets right (greedy)")
    p.add_argument("--name", help="the model's name in the result (default: its directory's name)")
    p.add_argument("--questions", type=Path, default=QUESTIONS)
    p.add_argument("--limit", type=int, help="only the first N questions (the loop prompts among them)")
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--sweep", action="store_true", help="run every setting of the grid " + json.dumps(SWEEP))
    p.add_argument("--samples", type=int, default=1, help="replies per question under a sampled setting")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--dtype", default=None, help="compute dtype (default: the runtime's)")
    p.add_argument("--label", help="where it ran (default: derived from the device)")
    p.add_argument("--results", type=Path, default=BENCH_DIR / "results", help="where the JSON goes")
    args = p.parse_args(argv)
    if args.samples < 1 or args.max_tokens < 1 or (args.limit is not None and args.limit < 1):
        p.error("--samples, --max-tokens and --limit must be >= 1")
    questions = load_questions(args.questions)[: args.limit]
    with tempfile.TemporaryDirectory() as tmp:
        return run(args, argv, questions, Path(tmp))


def run(args, argv, questions, tmp: Path) -> int:

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from benchmarks.index import render_file
    from benchmarks.perplexity import teacher_dir
    from benchmarks.run import device_description, slugify
    from mlx_hybrid.default_model import default_model_path
    from mlx_hybrid.loader import load

    if args.model is None:
        args.model, args.name = default_model_path(), args.name or "default"
    if args.teacher is not None and args.teacher.suffix == ".gguf":
        args.teacher = teacher_dir(args.teacher, tmp)

    console = Console(stderr=True)
    device = device_description()
    label = args.label or device["default_label"]
    grid = settings(args)
    per = lambda s: len(questions) * (1 if s["temp"] == 0 else args.samples)  # noqa: E731
    total = (len(questions) if args.teacher else 0) + sum(per(s) for s in grid)
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TimeRemainingColumn(), console=console)
    teacher, teacher_correct, runs = None, None, []
    with progress:
        task = progress.add_task("loading", total=total)
        advance = lambda: progress.advance(task)  # noqa: E731
        if args.teacher:
            progress.update(task, description=f"teacher {args.teacher.name}: greedy")
            model, tokenizer = load(args.teacher, args.dtype)
            tic = time.perf_counter()
            records = answer_all(model, tokenizer, questions, settings(argparse.Namespace(sweep=False, temp=0.0, top_p=1.0,
                                 repetition_penalty=1.0))[0], 1, args.seed, args.max_tokens, advance)
            seconds = time.perf_counter() - tic
            teacher_correct = {r["id"]: r["correct"] for r in records}
            teacher = dict(path=str(args.teacher), name=args.teacher.name, setting="greedy",
                           summary=dict(summarize(records, questions, None), seconds=seconds), records=records)
            del model, tokenizer
        model, tokenizer = load(args.model, args.dtype)
        for s in grid:
            progress.update(task, description=f"{args.name or args.model.name}: {describe(s)}")
            tic = time.perf_counter()
            records = answer_all(model, tokenizer, questions, s, args.samples, args.seed, args.max_tokens, advance)
            summary = dict(summarize(records, questions, teacher_correct), seconds=time.perf_counter() - tic)
            runs.append(dict(sampling=s, setting=describe(s), samples=1 if s["temp"] == 0 else args.samples,
                             summary=summary, records=records))
    key = "agreement" if teacher else "accuracy"
    clean = [i for i, r in enumerate(runs) if r["summary"]["looping"] == 0]
    best = max(clean, key=lambda i: runs[i]["summary"][key] or 0.0) if clean else None  # first of equals: the grid's order

    name = args.name or args.model.name
    result = dict(
        label=label, device=device, command="python -m benchmarks.chat_quality " + shlex.join(argv),
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"), questions=str(args.questions), n_questions=len(questions),
        kinds=dict(Counter(q["kind"] for q in questions)), max_tokens=args.max_tokens, seed=args.seed,
        ngram=dict(n=NGRAM, unit="generated token ids, end-of-turn token excluded", loop_limit=LOOP_LIMIT),
        teacher=teacher, model=dict(path=str(args.model), name=name), runs=runs, best=best, best_by=f"{key}, no looping prompt",
    )
    args.results.mkdir(parents=True, exist_ok=True)
    out = args.results / f"{slugify(f'chat quality {name} {label}')}.json"
    out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(render_file(out))
    console.print(f"wrote {out}; python -m benchmarks.index puts it in benchmarks/README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
