#!/usr/bin/env python
"""Regenerate the tables of benchmarks/README.md (and the training-scaling table of
train_cuda/README.md) from the result files in benchmarks/results/.

Benchmarks write only their result files (JSON, and a PNG beside some); the README's tables are
this script's, between `<!-- table:NAME -->` and `<!-- /table:NAME -->`: the index of every result
file, and one table per benchmark. Prose outside the markers is never touched.

    python -m benchmarks.index            # rewrite the tables
    python -m benchmarks.index --check    # exit 1 if the README's tables differ from what the files give

A file's date is the `timestamp` / `date` / `created` it records, else the date of the last commit
that changed it (renames followed), else its modification time. Paths outside the checkout appear
in commands by their last component: where a run kept its files is not part of how to reproduce it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from statistics import median

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"
README = BENCH_DIR / "README.md"

# File-name prefix -> the command that writes such files (longest prefix wins).
KINDS = {
    "decode": "benchmarks/run.py",
    "speculative": "benchmarks/speculative.py",
    "hybrid-context": "benchmarks/hybrid_context.py",
    "dsla-conversion": "benchmarks/dsla_conversion.py run",
    "convert-memory": "benchmarks/convert_memory.py",
    "scan-bandwidth": "benchmarks/scan_bandwidth.py",
    "graph-ops": "benchmarks/graph_ops.py",
    "tune": "benchmarks/tune.py",
    "tune-profile": "hybrid tune (the profile benchmarks/tune.py used)",
    "pass-cost": "benchmarks/pass_cost.py",
    "pass-cost-passes": "benchmarks/pass_cost.py --passes",
    "pass-cost-split": "benchmarks/pass_cost.py --split",
    "pass-cost-forwards": "benchmarks/pass_cost.py --forwards",
    "pass-cost-ops": "benchmarks/pass_cost.py (op_* chains)",
    "kernel-profile": "benchmarks/gpu/kernel_profile.py",
    "kernel-bench": "benchmarks/gpu/kernel_bench.py --sweep",
    "attention-cost": "benchmarks/gpu/attention_cost.py",
    "dispatch-cost": "benchmarks/gpu/dispatch_cost.py --graphs",
    "draft-phases": "benchmarks/gpu/draft_phases.py",
    "pass-phases": "benchmarks/gpu/pass_phases.py",
    "pass-timeline": "benchmarks/gpu/pass_timeline.py",
    "tree-step-cost": "benchmarks/gpu/tree_step_cost.py",
    "serve": "benchmarks/serve.py",
    "serve-steps": "benchmarks/serve.py --parts steps",
    "serve-robustness": "benchmarks/serve.py --parts robustness",
    "dsla-kernel": "benchmarks/dsla_kernel.py",
    "chat-quality": "benchmarks/chat_quality.py",
    "train-heads": "train_cuda/scripts/real_heads.py",
    "train-hybrid-target": "train_cuda/scripts/real_default.py --settings train_cuda/configs/real_hybrid_target.yaml",
    "train-default": "train_cuda/scripts/real_default.py",
    "train-quality": "train_cuda/scripts/real_default.py --gpus 4 --settings train_cuda/configs/real_quality.yaml",
    "train-quality-e2e": "train_cuda/scripts/real_default.py --gpus 4 --settings train_cuda/configs/real_quality_e2e.yaml",
    "train-scaling": "train_cuda/scripts/scaling.py",
    "perplexity": "benchmarks/perplexity.py",
    "oracle-profile": "benchmarks/oracle.py",
}


@dataclass
class Result:
    path: Path
    data: dict
    kind: str
    model: str
    device: str
    date: str

    @property
    def png(self) -> Path | None:
        png = self.path.with_suffix(".png")
        return png if png.is_file() else None


def kind_of(stem: str) -> str | None:
    matches = [k for k in KINDS if stem == k or stem.startswith(k + "-")]
    return max(matches, key=len) if matches else None


def device_of(data: dict, stem: str) -> str:
    if isinstance(data.get("label"), str):
        return data["label"]
    device = data.get("device")
    if isinstance(device, dict):
        return device.get("name") or device.get("default_label", "?")
    if isinstance(device, str):
        return device
    return "NVIDIA H100" if stem.endswith("nvidia-h100") else "any (op counts)"


def date_of(path: Path, data: dict) -> str:
    for key in ("timestamp", "date", "created"):
        if isinstance(data.get(key), str):
            return data[key][:10]
    try:
        out = subprocess.run(["git", "log", "-1", "--follow", "--diff-filter=AM", "--format=%ad", "--date=short", "--", path.name],
                             cwd=path.parent, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or date.fromtimestamp(path.stat().st_mtime).isoformat()


def load_result(path: Path) -> Result:
    kind = kind_of(path.stem)
    if kind is None:
        raise SystemExit(f"error: {path.name} matches no benchmark prefix ({', '.join(KINDS)})")
    data = json.loads(path.read_text())
    rest = path.stem[len(kind) + 1 :]
    model = re.sub(r"-?\b(nvidia|cpu|amd|apple)\b.*$", "", rest)
    return Result(path, data, kind, model, device_of(data, path.stem), date_of(path, data))


def load_results(results: Path = RESULTS) -> list[Result]:
    return [load_result(path) for path in sorted(results.glob("*.json"))]


# Options that only say where a run wrote its files or kept scratch models: not part of how to
# reproduce it, and their values are paths of the machine that ran it.
WHERE_OPTIONS = ("--out", "--results", "--work-dir")


def show_command(command: str, drop: str | None = None) -> str:
    """The command as it runs from the checkout's root: a benchmark script as its module
    (`python -m benchmarks.run`), without WHERE_OPTIONS, paths outside the checkout shortened to
    their last component, and without option `drop` and its value, where a table shows that value
    itself."""
    words = shlex.split(re.sub(r"(?:\S*/)?benchmarks/((?:gpu/)?\w+)\.py", lambda m: "-m benchmarks." + m.group(1).replace("/", "."), command))
    for option in (drop, *WHERE_OPTIONS):
        if option in words:
            del words[words.index(option) : words.index(option) + 2]
    for i, w in enumerate(words):
        if w.startswith(("/", "~")):
            p = Path(w).expanduser()
            words[i] = str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else p.name
    return shlex.join(words)


def png_link(r: Result, alt: str) -> list[str]:
    return [f"![{alt}](results/{r.png.name})"] if r.png else []


# ----------------------------------------------------------------------------- tables


def index_table(results: list[Result]) -> str:
    lines = ["| result | written by | model | device | date |", "| --- | --- | --- | --- | --- |"]
    for r in results:
        plot = f" ([plot](results/{r.png.name}))" if r.png else ""
        lines.append(f"| [{r.path.name}](results/{r.path.name}){plot} | `{KINDS[r.kind]}` | {r.model or '-'} | {r.device} | {r.date} |")
    return "\n".join(lines)


def decode_tables(results: list[Result]) -> str:
    out = []
    for label in dict.fromkeys(r.device for r in results):
        group = [r for r in results if r.device == label]
        lines = [f"#### {label}", "",
                 "| model | variant | prefill tok/s mlx-hybrid | prefill tok/s mlx-lm | prefill ratio | decode tok/s mlx-hybrid "
                 "| decode tok/s mlx-lm | decode ratio | peak GB mlx-hybrid | peak GB mlx-lm | same tokens | max Δ logprob "
                 "| float dtype mlx-hybrid / mlx-lm |",
                 "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: | ---: | --- |"]
        for r in group:
            for variant, v in r.data["variants"].items():
                ours, theirs = (v["runtimes"][k]["median"] for k in ("mlx_hybrid", "mlx_lm"))
                same = "yes" if v["tokens_match"] else f"no (from token {v['first_mismatch']})"
                dtypes = " / ".join(v["runtimes"][k].get("compute_dtype", "?") for k in ("mlx_hybrid", "mlx_lm"))
                lines.append(
                    f"| {r.data['model']['name']} | {variant} | {ours['prefill_tps']:.1f} | {theirs['prefill_tps']:.1f} | "
                    f"{v['ratios']['prefill']:.2f}× | {ours['decode_tps']:.1f} | {theirs['decode_tps']:.1f} | "
                    f"{v['ratios']['decode']:.2f}× | {ours['peak_memory_gb']:.3f} | {theirs['peak_memory_gb']:.3f} | {same} | "
                    f"{max(v['logprobs_max_abs_diff'].values()):.2g} | {dtypes} |")
        lines.append("")
        for r in group:
            s, ver = r.data["settings"], r.data["versions"]
            lines.append(f"- **{r.data['model']['name']}** ({r.date}; mlx {ver['mlx']}, mlx-lm {ver['mlx_lm']}): "
                         f"{s['prompt_tokens']} prompt tokens, {s['gen_tokens']} generated, median of {s['trials']} interleaved "
                         f"trials, compute dtype: {s['dtype']}. `{show_command(r.data['command'])}`"
                         + (f" [plot](results/{r.png.name})" if r.png else ""))
        out.append("\n".join(lines))
    return "\n\n".join(out)


def speculative_tables(results: list[Result]) -> str:
    lines = ["| model | device | method | decode tok/s | vs mlx-hybrid plain | vs mlx-lm draft | tokens / target pass | ms / target pass | same tokens |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | :---: |"]
    notes = []
    for r in results:
        d, a = r.data, r.data.get("args", {})
        model = re.sub(r"-(chat|news)$", "", r.model)  # the prompt set: in the notes below
        peer = d["trials"].get("mlx-lm oracle draft") or d["trials"].get("mlx-lm draft")  # the oracle rows' peer: at their acceptance
        for i, row in enumerate(d["rows"]):
            ms = 1000 * row["tokens_per_step"] / row["tps"]
            # paired, as "vs mlx-hybrid plain" is: each trial against that trial's mlx-lm draft run
            vs_peer = f"{median(t['tps'] / p['tps'] for t, p in zip(d['trials'][row['method']], peer)):.2f}x" if peer else "-"
            where = (f"{model}, {d['dtype']}", f"{r.device} ({r.date})") if i == 0 else ("", "")
            lines.append(f"| {where[0]} | {where[1]} | {row['method']} | {row['tps']:.1f} | {row['speedup']:.2f}x | {vs_peer} | "
                         f"{row['tokens_per_step']:.2f} | {ms:.2f} | {'yes' if row['same'] else 'no'} |")
        prompts = d.get("prompts") or (f"{a.get('prompt_tokens')} random prompt tokens" if a.get("synthetic") not in (None, "None")
                                       else f"each of {a.get('prompts')} held-out {a.get('prompt_set', 'chat')} prompts")
        oracle = ""
        if a.get("oracle") == "True":
            at = [float(x) for x in a["profile"].split(",")]
            expected = 1 + sum(math.prod(at[: depth]) for depth in range(1, len(at) + 1))  # 1 + sum of P(depths 1..d right)
            oracle = f"; oracle rows at per-depth acceptance {' / '.join(map(str, at))}, {expected:.2f} tokens a pass expected"
        notes.append(f"- {model}, {r.device}: `{show_command(d['command'])}` ({a.get('gen_tokens')} tokens after {prompts}, "
                     f"median of {a.get('trials')} trials{oracle}" + (f"; [plot](results/{r.png.name})" if r.png else "") + ")")
    return "\n".join(lines + [""] + notes)


def pass_cost_tables(results: list[Result]) -> str:
    """benchmarks/pass_cost.py --forwards: a forward over T tokens after 256 of context, in decode
    steps (T = 1), as tuned and on each single path of the projections."""
    counts = (8, 17, 34, 64)
    paths = [("chain_kernel", "as tuned, chain"), ("tree_kernel", "as tuned, binary tree"),
             ("chain_masked", "MLX attention with a mask, chain"),
             ("chain_kernel_matmul", "tree kernel, all MLX matmul, chain"), ("chain_kernel_rows", "tree kernel, all row kernel, chain")]
    lines = ["Each cell: ms for one forward over T tokens after 256 of context (its cost in decode steps, T = 1).", "",
             "| shape, weights, device | projections | T = 1 | " + " | ".join(f"T = {t}" for t in counts) + " |",
             "| --- | --- | ---: | " + " | ".join("---:" for _ in counts) + " |"]
    notes = []
    for r in results:
        d, t = r.data, r.data["times"]
        step = t["T1_decode"]
        weights = f"{d['bits']}-bit" if d["bits"] else d["dtype"]
        for i, (key, name) in enumerate(p for p in paths if f"T8_{p[0]}" in t):
            if "tree_attention_limit" not in t:  # a file without the kernel's tuned limit ran it for every tree
                name = name.replace("as tuned", "row kernel as tuned, tree kernel")
            where = f"{d['shape']}, {weights}, {r.device} ({r.date})" if i == 0 else ""
            lines.append(f"| {where} | {name} | {step:.2f} | " + " | ".join(f"{t[f'T{n}_{key}']:.2f} ({t[f'T{n}_{key}'] / step:.2f}×)" for n in counts) + " |")
        limits = ", ".join(f"{shape}: {n}" for shape, n in t.get("row_limits", {}).items())
        tree = t.get("tree_attention_limit")
        pipelined = t.get("decode_pipelined")
        notes.append(f"- {d['shape']}, {weights}: `{show_command(d['command'])}`"
                     + (f"; a decode step as generation runs it, the next queued before the host reads this one: {pipelined:.2f} ms"
                        if pipelined else "")
                     + (f"; the most rows the row kernel takes, per weight shape: {limits}" if limits else "")
                     + (f"; the most nodes the tree-attention kernel takes: {tree}" if tree is not None else ""))
    return "\n".join(lines + [""] + notes)


def context_tables(results: list[Result]) -> str:
    contexts = sorted({x["context"] for r in results for x in r.data["rows"]})
    lines = ["Each cell: ms per decoded token (cache MiB per sequence); growth: the step's time at the longest context over the "
             "shortest.", "", "| shape, dtype, device | model | " + " | ".join(f"{c // 1024}k" for c in contexts) + " | growth |",
             "| --- | --- | " + " | ".join("---:" for _ in contexts) + " | ---: |"]
    notes = []
    for r in results:
        get = {(x["model"], x["context"]): x for x in r.data["rows"]}
        for i, name in enumerate(dict.fromkeys(x["model"] for x in r.data["rows"])):
            where = f"{r.data['shape']}, {r.data['dtype']}, {r.device} ({r.date})" if i == 0 else ""
            cells = [get.get((name, c)) for c in contexts]
            ms = [x["ms_per_token"] for x in cells if x]
            lines.append(f"| {where} | {name} | " + " | ".join(f"{x['ms_per_token']:.2f} ({x['cache_bytes'] / 2**20:.1f})" if x else ""
                                                              for x in cells) + f" | {ms[-1] / ms[0]:.2f}× |")
        notes.append(f"- {r.data['shape']}, {r.device}: `{show_command(r.data['command'])}`"
                     + (f" ([plot](results/{r.png.name}))" if r.png else ""))
    return "\n".join(lines + [""] + notes)


def mb(n: int) -> str:
    """Bytes as mlx_hybrid.adaptive.format_bytes writes them (decimal units)."""
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def dsla_tables(results: list[Result]) -> str:
    out = []
    for r in results:
        d = r.data
        lines = [f"#### {d['name']}, {r.device} ({r.date})", ""]
        lines += [f"`{show_command(d['build'])}`", ""] if d.get("build") else []
        lines += [f"`{show_command(d['command'], drop='--note')}`", ""]
        lines += [d["note"], ""] if d.get("note") else []
        lines += [f"Perplexity on {d['tokens']} held-out tokens ({d['blocks']} blocks of {d['seq_len']}, `{Path(d['text']).name}`); "
                  f"conversion order, least sensitive first: {d['order']}.", "",
                  f"| DSLA layers | rate | perplexity | ratio | cache after a block | cache at {d['context']} |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        for x in d["rows"]:
            lines.append(f"| {x['dsla_layers']} | {x['rate']:.0%} | {x['ppl']:.3f} | {x['ratio']:.3f}× | "
                         f"{mb(x['cache_bytes_measured'])} | {mb(x['cache_bytes_at_context'])} |")
        picks = ", ".join(f"{x['prompt']}: does not fit" if x["dsla_layers"] is None
                          else f"{x['prompt']}: {x['dsla_layers']} layers ({mb(x['cache_bytes'])})" for x in d["policy"])
        lines += ["", f"The policy's conversion per prompt length (+ 256 new tokens) under a budget of {mb(d['budget'])} "
                  f"(weights {mb(d['weights_bytes'])}): {picks}."]
        out.append("\n".join(lines + [""] + png_link(r, "DSLA conversion")).rstrip())
    return "\n\n".join(out)


def convert_tables(results: list[Result]) -> str:
    out = []
    for r in results:
        d = r.data
        lines = [f"#### {d['shape']} shape, random weights ({d['parameters'] / 1e9:.2f}B parameters: {d['bf16_gb']} GB as stored, "
                 f"{d['float32_gb']} GB in float32), {r.device} ({r.date})", "",
                 "| converter | source | output | peak RSS | vs float32 size | time |", "| --- | --- | --- | ---: | ---: | ---: |"]
        for x in d["runs"]:
            lines.append(f"| {x['tool']} | {x['source']} | {x['output']} | {x['peak_rss_mb'] / 1e3:.2f} GB | "
                         f"{x['peak_rss_mb'] / 1e3 / d['float32_gb']:.2f}× | {x['seconds']} s |")
        out.append("\n".join(lines + [""] + png_link(r, "conversion memory")).rstrip())
    return "\n\n".join(out)


def scan_tables(results: list[Result]) -> str:
    out = []
    for r in (r for r in results if "reference" not in r.data["timed"]):  # the CPU times the pure-MLX reference
        d = r.data
        lines = [f"#### {r.device} ({r.date}, MLX {d['mlx']}): {d['timed']}, inputs {d['input_dtype']}, "
                 f"measured bandwidth {d['bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s", "",
                 "| batch | channels | N | NA | L | saved | state MB | MB moved | µs / call | floor µs | time / floor | vs L=1 "
                 "| MLX `state * 0.5` µs |",
                 "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for x in d["rows"]:
            lines.append(f"| {x['batch']} | {x['channels']} | {x['n']} | {x['na']} | {x['L']} | {len(x['save'])} | "
                         f"{x['state_mb']:.0f} | {x['bytes_moved'] / 2**20:.1f} | {x['time_s'] * 1e6:.1f} | {x['floor_s'] * 1e6:.1f} | "
                         f"{x['ratio']:.2f}× | {x['vs_L1']:.2f}× | {x['mlx_state_op_s'] * 1e6:.1f} |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def graph_tables(results: list[Result]) -> str:
    out = []
    for r in results:
        lines = [f"Counted {r.date}, MLX {r.data['mlx']}. Each cell is kernels + views; \"pass / step\": the pass's kernels over "
                 "a decode step's (kernels and views together in brackets)."]
        for name, counts in r.data["results"].items():
            step_k, step_v = counts["plain step"]
            lines += ["", f"**{name}**: plain decode step {step_k} kernels + {step_v} views.", "",
                      "| method | nodes | draft | verification forward | acceptance | cache moves | pass | pass / step |",
                      "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
            for method, parts in counts.items():
                if method == "plain step":
                    continue
                cells = [parts[p] for p in ("draft", "verification forward", "acceptance", "cache moves")]
                pk, pv = (sum(c[i] for c in cells) for i in (0, 1))
                lines.append(f"| {method} | {parts['nodes']} | " + " | ".join(f"{k} + {v}" for k, v in cells)
                             + f" | {pk} + {pv} | {pk / step_k:.2f}x ({(pk + pv) / (step_k + step_v):.2f}x) |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def tune_tables(results: list[Result]) -> str:
    def key(runner: str) -> str:  # tuned rows of different runs share a line
        return re.sub(r" tuned .*", " tuned", runner)

    runners = list(dict.fromkeys(key(x["runner"]) for r in results for x in r.data["rows"]))
    lines = ["Each cell: decode tok/s (vs plain; tokens / target pass); in bold the profile's choice.", "",
             "| runner | " + " | ".join(f"{r.model}, {r.device} ({r.date})" for r in results) + " |",
             "| --- | " + " | ".join("---:" for _ in results) + " |"]
    for name in runners:
        cells = []
        for r in results:
            x = next((x for x in r.data["rows"] if key(x["runner"]) == name), None)
            cell = "" if x is None else f"{x['tps']:.1f} ({x['vs_plain']:.2f}x; {x['tokens_per_step']:.2f})"
            cells.append(f"**{cell}**" if x and x["runner"] == r.data["choice"] else cell)
            if x and name.endswith(" tuned"):
                cells[-1] = f"{x['runner'].split(' tuned ')[1]}: {cells[-1]}"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    for r in results:
        beaten = r.data.get("faster_than_tuned")
        verdict = "its choice was the fastest runner" if not beaten else f"faster than its choice: {', '.join(beaten)}"
        profile = r.path.with_name(r.path.name.replace("tune-", "tune-profile-", 1)).with_suffix(".png")
        lines.append(f"- {r.model}, {r.device}: `{show_command(r.data['command'])}`; profile {r.data['profile_status']}, {verdict}"
                     + (f" ([profile](results/{profile.name}))" if profile.is_file() else "") + ".")
    return "\n".join(lines)


def training_tables(results: list[Result]) -> str:
    lines = ["| run | date | held-out top-1 per head / drafted step | other |", "| --- | --- | --- | --- |"]
    for r in results:
        d = r.data
        top1 = lambda x: " / ".join(f"{a:.3f}" for a in x["top1"])  # noqa: E731
        cells = [f"{name}: {top1(d[name])}" for name in ("medusa1", "redrafter") if name in d]
        other = []
        if "draft" in d:
            other.append(f"draft: top-1 {d['draft']['top1']:.3f}, accepted {d['draft']['accepted']:.2f} at K = {d['draft']['num_draft']}")
        for text, rows in d.get("perplexity", {}).items():
            other.append(f"{text} perplexity {rows[-1]['ppl']:.2f} vs teacher {rows[0]['ppl']:.2f} ({rows[-1]['ratio']:.2f}x)")
        other.append(f"{d['seconds']['total']:.0f} s")
        lines.append(f"| [{r.path.name}](results/{r.path.name}) | {r.date} | {'; '.join(cells)} | {'; '.join(other)} |")
    return "\n".join(lines)


def scaling_tables(results: list[Result]) -> str:
    """train_cuda/scripts/scaling.py: tokens/s and peak memory per GPU, each run against the run on
    one GPU (scaling efficiency: tokens/s per GPU over the one GPU's tokens/s)."""
    out = []
    for r in results:
        d, s = r.data, r.data["settings"]
        base = next((x for x in d["runs"] if x["gpus"] == 1 and "error" not in x), None)
        lines = [f"#### {d['shape']} (random weights), {r.device} ({r.date}): `{show_command(d['command'])}`", "",
                 f"{s['per_gpu']} x {s['seq_len']} tokens a GPU a step, freeze {s['freeze']}"
                 + (", activation checkpointing" if s["grad_checkpointing"] else "")
                 + f"; tokens/s over steps {s['warmup'] + 1}-{s['steps']}.", "",
                 "| parallel | GPUs | teacher | tokens/s | tokens/s per GPU | scaling efficiency | peak GiB per GPU |",
                 "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
        notes = []
        for x in d["runs"]:
            name = "one GPU" if x["gpus"] == 1 else x["parallel"]
            if "command" in x:  # measured by another command than the file's
                notes += [x["command"]] if x["command"] not in notes else []
                name += f" ({notes.index(x['command']) + 1})"
            if "error" in x:
                lines.append(f"| {name} | {x['gpus']} | {x['teacher']} | {x['error']} | | | |")
                continue
            per = x["tokens_per_s"] / x["gpus"]
            eff = f"{per / base['tokens_per_s']:.0%}" if base else "-"
            lines.append(f"| {name} | {x['gpus']} | {x['teacher']} | {x['tokens_per_s']:,.0f} | {per:,.0f} | {eff} | {x['peak_gib']:.1f} |")
        lines += [""] + [f"({i}) `{show_command(c)}`" for i, c in enumerate(notes, 1)] + ([""] if notes else [])
        out.append("\n".join(lines + png_link(r, f"{d['shape']} scaling")).rstrip())
    return "\n\n".join(out)


def serve_tables(results: list[Result]) -> str:
    out = []
    for r in results:
        d, head = r.data, f"#### {r.data['model']}, {r.device} ({r.date}): `{show_command(r.data.get('command', 'python ' + KINDS[r.kind]))}`"
        if r.kind == "serve":
            lines = [head, "", "| turn | prompt tokens | from the cache | TTFT, cache (ms) | TTFT, no cache (ms) |",
                     "| ---: | ---: | ---: | ---: | ---: |"]
            pairs = list(zip(d["chat_with_cache"], d["chat_without_cache"]))
            for turn, (a, b) in enumerate(pairs, 1):
                lines.append(f"| {turn} | {a['prompt_tokens']} | {a['cached_tokens']} | {1e3 * a['ttft']:.0f} | {1e3 * b['ttft']:.0f} |")
            later = pairs[1:]
            lines.append(f"| turns 2-{len(pairs)}, mean | | | {1e3 * sum(a['ttft'] for a, _ in later) / len(later):.0f} | "
                         f"{1e3 * sum(b['ttft'] for _, b in later) / len(later):.0f} |")
            lines += ["", f"Replies the same with and without the cache: {'yes' if d['same_replies'] else 'no'}.", "",
                      "| server | clients | requests/s | tokens/s | latency p50 (s) | latency p95 (s) | TTFT p50 (s) | TTFT p95 (s) |",
                      "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
            for name, rows in (("continuous batching", d["batching"]), ("queue (`--max-batch 1`)", d["queue"])):
                for x in rows:
                    lines.append(f"| {name} | {x['clients']} | {x['requests_per_s']:.2f} | {x['tokens_per_s']:.1f} | {x['latency_p50']:.2f} | "
                                 f"{x['latency_p95']:.2f} | {x['ttft_p50']:.2f} | {x['ttft_p95']:.2f} |")
        elif r.kind == "serve-steps":
            lines = [head, "", "| rows | step (ms) | tokens/s |", "| ---: | ---: | ---: |"]
            lines += [f"| {x['rows']} | {x['step_ms']:.1f} | {x['tokens_per_s']:.1f} |" for x in d["steps"]]
        else:
            lines = [head, "", "| bad request | status | code | param | served after it |", "| --- | ---: | --- | --- | :---: |"]
            lines += [f"| {x['what']} | {x['status']} | {x['code'] or ''} | {x['param'] or ''} | {'yes' if x['served_after'] else 'no'} |"
                      for x in d["bad_requests"]]
            c = d["disconnect"]
            lines += ["", f"A client that closed a {c['max_tokens']}-token stream after 3 chunks: {c['generated_before_stop']} tokens "
                      f"generated, the server idle {c['stopped_after_s']:.2f} s after the close.", "",
                      "| requests in a row | MLX active (MB) | prompt cache (MB) | resident set (MB) |", "| ---: | ---: | ---: | ---: |"]
            for x in d["in_a_row"]:
                rss = f"{x['rss'] / 1e6:.0f}" if x["rss"] else "-"  # None where the OS does not tell it
                lines.append(f"| {x['requests']} | {x['mlx_active'] / 1e6:.1f} | {x['prompt_cache_bytes'] / 1e6:.1f} | {rss} |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def perplexity_tables(results: list[Result]) -> str:
    out = []
    for r in results:
        d = r.data
        lines = [f"#### {r.device} ({r.date}), {', '.join(d['text'])}, blocks of {d['seq_len']} tokens: `{show_command(d['command'])}`", "",
                 "| model | perplexity | ratio | word perplexity | word ratio | tokens | words |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {x['model']} ({x['path']}) | {x['ppl']:.3f} | {x['ratio']:.3f} | {x['word_ppl']:.2f} | {x['word_ratio']:.3f} | {x['tokens']} | {x['words']} |"
                  for x in d["rows"]]
        out.append("\n".join(lines))
    return "\n\n".join(out)


def dsla_kernel_tables(results: list[Result]) -> str:
    out = []
    for r in results:
        d = r.data
        lines = [f"#### {r.device}, {d['shape']} shape, bfloat16 ({r.date}): `{show_command(d['command'])}`", "",
                 "| form | DSLA layer call | kernel (us) | unfused (us) | speedup | max abs diff |", "| --- | --- | ---: | ---: | ---: | ---: |"]
        for form, rows in d["layer"].items():
            lines += [f"| {form} | {name} | {x['kernel_us']} | {x['unfused_us']} | {x['speedup']}× | {x['max_abs_diff']:.2g} |" for name, x in rows.items()]
        lines += ["", "| form | converted | decode tok/s, kernel | decode tok/s, unfused | speedup |", "| --- | ---: | ---: | ---: | ---: |"]
        for form, rows in d["adaptive"].items():
            lines += [f"| {form} | {x['rate']:.0%} ({x['dsla_layers']} layers) | {x['kernel_tok_s']} | {x['unfused_tok_s']} | {x['speedup']}× |"
                      for x in rows]
        out.append("\n".join(lines))
    return "\n\n".join(out)


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def chat_quality_tables(results: list[Result]) -> str:
    out = []
    for r in results:
        d = r.data
        t = d["teacher"]
        lines = [f"#### {d['model']['name']}" + (f" against {t['name']}" if t else "") + f", {r.device} ({r.date})", "",
                 f"`{show_command(d['command'])}`", "",
                 f"{d['n_questions']} questions ({', '.join(f'{n} {k}' for k, n in d['kinds'].items())}), at most "
                 f"{d['max_tokens']} tokens a reply." + (f" The teacher gets {t['summary']['accuracy']:.0%} right greedily "
                                                        f"({sum(x['correct'] for x in t['records'])} questions)." if t else ""), "",
                 "| model | sampling | replies | accuracy | agreement where the teacher is right | looping prompts | "
                 "largest 4-gram count | ended on end-of-turn | time |",
                 "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        rows = ([(t["name"], "greedy (reference)", t["summary"], False)] if t else []) + [
            (d["model"]["name"], x["setting"] + (f", {x['samples']} samples" if x["samples"] > 1 else ""), x["summary"], i == d["best"])
            for i, x in enumerate(d["runs"])]
        for name, setting, s, best in rows:
            cells = [name, setting, str(s["replies"]), pct(s["accuracy"]), pct(s["agreement"]),
                     f"{s['looping']} / {s['loop_prompts']}", str(max(s["max_4gram"].values(), default=0)), pct(s["ended"]),
                     f"{s['seconds']:.0f} s"]
            lines.append("| " + " | ".join(f"**{c}**" if best and len(d["runs"]) > 1 else c for c in cells) + " |")
        if len(d["runs"]) > 1:
            lines += ["", "In bold: the best setting (" + d["best_by"] + ")." if d["best"] is not None
                      else "No setting ran without a looping prompt."]
        out.append("\n".join(lines))
    return "\n\n".join(out)


TABLES = {
    "index": (None, index_table),
    "decode": (["decode"], decode_tables),
    "scan-bandwidth": (["scan-bandwidth"], scan_tables),
    "hybrid-context": (["hybrid-context"], context_tables),
    "convert-memory": (["convert-memory"], convert_tables),
    "dsla-conversion": (["dsla-conversion"], dsla_tables),
    "speculative": (["speculative"], speculative_tables),
    "pass-cost": (["pass-cost-forwards"], pass_cost_tables),
    "graph-ops": (["graph-ops"], graph_tables),
    "tune": (["tune"], tune_tables),
    "training": (["train-heads", "train-hybrid-target", "train-default", "train-quality", "train-quality-e2e"], training_tables),
    "training-scaling": (["train-scaling"], scaling_tables),
    "perplexity": (["perplexity"], perplexity_tables),
    "serve": (["serve", "serve-steps", "serve-robustness"], serve_tables),
    "dsla-kernel": (["dsla-kernel"], dsla_kernel_tables),
    "chat-quality": (["chat-quality"], chat_quality_tables),
}


def render(name: str, results: list[Result]) -> str:
    kinds, fn = TABLES[name]
    return fn([r for r in results if kinds is None or r.kind in kinds])


def render_file(path: Path) -> str:
    """The table one result file gets in the README (what a benchmark prints when it has written it)."""
    r = load_result(path)
    return next(fn([r]) for kinds, fn in TABLES.values() if kinds and r.kind in kinds)


# Other files that show some of the tables (relative links there point into benchmarks/).
ALSO = {ROOT / "train_cuda" / "README.md": ["training-scaling"]}


def regenerate(text: str, results: list[Result], names=TABLES, path: Path = README) -> str:
    for name in names:
        start, end = f"<!-- table:{name} -->", f"<!-- /table:{name} -->"
        pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
        if not pattern.search(text):
            raise SystemExit(f"error: {path} has no {start} ... {end} markers")
        table = render(name, results)
        if path.parent != BENCH_DIR:
            table = table.replace("](results/", "](../benchmarks/results/")
        text = pattern.sub(lambda _: f"{start}\n{table}\n{end}", text, count=1)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only compare; exit 1 if the README is stale")
    p.add_argument("--readme", type=Path, default=README)
    args = p.parse_args(argv)
    results, stale = load_results(), 0
    for path, names in [(args.readme, TABLES), *ALSO.items()]:
        text = path.read_text()
        new = regenerate(text, results, names, path)
        if new == text:
            continue
        if args.check:
            print(f"{path} is stale: run python -m benchmarks.index", file=sys.stderr)
            stale = 1
        else:
            path.write_text(new)
            print(f"updated {path}")
    return stale


if __name__ == "__main__":
    sys.exit(main())
