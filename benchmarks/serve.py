#!/usr/bin/env python
"""`hybrid serve` under load: the prompt cache's effect on a growing chat, and requests/s and
latency at several concurrent clients with continuous batching and with a plain queue.

Each configuration is its own `hybrid serve` process (on this machine's default device), all
started at once and driven in turn over HTTP from here with the standard library's client (so the
client needs nothing installed):

- chat: a 10-turn conversation (user turns from benchmarks/chat_prompts.txt, greedy replies of
  --reply-tokens, appended to the history), time to the first streamed token of each turn, with
  the prompt cache (the default) and without it (`--prompt-cache 0`). The replies, hence the
  prompts, are the same in both runs.
- concurrency: --requests requests (distinct prompts, --max-tokens tokens each, EOS suppressed
  with logit_bias so every request generates them all) from 1, 4 and 16 client threads; per
  level, requests/s, generated tokens/s and the p50/p95 latency and time to first token, with
  continuous batching (the default, `--max-batch 16`) and with a queue (`--max-batch 1`).
- steps (`--parts steps`, in this process, no server): the time of one batched decode step at 1, 4
  and 16 rows (`mlx_hybrid.batch`), what bounds batching's gain on a device.
- robustness (`--parts robustness`): each kind of bad request (status and error code, and that a
  good request is served after it), a client that disconnects mid-stream (how many tokens the
  server generated before it stopped), and --in-a-row short requests one after another with the
  server's memory (MLX's active memory, the prompt cache's bytes, the process's resident set)
  every 100, under a 64 MB prompt-cache bound.

    python -m benchmarks.serve                                  # the embedded default model
    python -m benchmarks.serve --parts steps                    # the decode step's cost per batch width
    python -m benchmarks.serve --parts robustness               # bad requests, a disconnect, 1,000 requests
    python -m benchmarks.serve --model DIR --out DIR --label "NVIDIA H100, MLX CUDA backend"
"""

from __future__ import annotations

import argparse
import http.client
import json
import shlex
import subprocess
import sys
import threading
import time
from datetime import date
from pathlib import Path
from statistics import median

BENCH_DIR = Path(__file__).resolve().parent
from benchmarks.index import render_file
from benchmarks.run import device_description, median_eval_ms, slugify

MODEL_ID = "bench"


class Served:
    """A `hybrid serve` process on a free port of 127.0.0.1."""

    def __init__(self, model: str | None, *options: str):
        command = [sys.executable, "-m", "mlx_hybrid.cli.main", "serve", "--port", "0", "--temp", "0", *options]
        command += ["--model", model] if model else []
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while True:
            line = self.process.stderr.readline()
            if line.startswith("Serving "):
                self.model = line.split("'")[1]
                self.host, port = line.split("http://")[1].split("/")[0].rsplit(":", 1)
                self.port = int(port)
                break
            if (not line and self.process.poll() is not None) or time.monotonic() > deadline:
                raise RuntimeError(f"hybrid serve did not start: {' '.join(command)}")
        threading.Thread(target=self.process.stderr.read, daemon=True).start()  # keep its pipe drained

    def stream(self, path: str, body: dict) -> dict:
        """POST a streaming request; returns ttft (s, to the first text), latency (s), usage."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        body = dict(body, model=self.model, stream=True, stream_options={"include_usage": True})
        tic = time.perf_counter()
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{path}: HTTP {response.status}: {response.read()[:300]!r}")
        ttft, text, usage = None, [], None
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                piece = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - tic
                    text.append(piece)
        latency = time.perf_counter() - tic
        conn.close()
        return {"ttft": ttft if ttft is not None else latency, "latency": latency, "usage": usage, "text": "".join(text)}

    def health(self) -> dict:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        conn.request("GET", "/health")
        out = json.loads(conn.getresponse().read())
        conn.close()
        return out

    def stop(self):
        self.process.terminate()
        self.process.wait(60)


def chat(servers: list[Served], prompts: list[str], turns: int, reply_tokens: int) -> list[list[dict]]:
    """The same conversation on each server, turn by turn in turn (drift in the machine's speed
    then hits all alike); per server, per turn: TTFT, prompt and cached tokens, the reply."""
    histories, out = [[] for _ in servers], [[] for _ in servers]
    for text in prompts[:turns]:
        for server, messages, rows in zip(servers, histories, out):
            messages.append({"role": "user", "content": text})
            r = server.stream("/v1/chat/completions", {"messages": messages, "max_tokens": reply_tokens})
            messages.append({"role": "assistant", "content": r["text"]})
            u = r["usage"]
            rows.append({"ttft": r["ttft"], "prompt_tokens": u["prompt_tokens"], "cached_tokens": u["prompt_tokens_details"]["cached_tokens"], "reply": r["text"]})
    return out


def load_level(server: Served, prompts: list[str], clients: int, max_tokens: int, no_eos: dict) -> dict:
    todo, lock, results = list(prompts), threading.Lock(), []

    def client():
        while True:
            with lock:
                if not todo:
                    return
                prompt = todo.pop()
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "logit_bias": no_eos}
            r = server.stream("/v1/chat/completions", body)
            with lock:
                results.append(r)

    tic = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - tic
    latencies = sorted(r["latency"] for r in results)
    ttfts = sorted(r["ttft"] for r in results)
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    return {
        "clients": clients, "requests": len(results), "wall_s": wall, "requests_per_s": len(results) / wall,
        "tokens_per_s": tokens / wall, "completion_tokens": tokens,
        "latency_p50": median(latencies), "latency_p95": percentile(latencies, 95),
        "ttft_p50": median(ttfts), "ttft_p95": percentile(ttfts, 95),
    }


def workload(prompts: list[str], clients: int, n: int) -> list[str]:
    """n distinct prompts, distinct from the chat's and from other levels' from their first token
    on, so that no level reads another's from the prompt cache."""
    return [f"Request {clients}.{i}: {prompts[(i * 7) % len(prompts)]}" for i in range(n)]


BAD_REQUESTS = [  # (what, path, body): each must get a 4xx in OpenAI's error shape
    ("malformed JSON", "/v1/chat/completions", b'{"model": "M", "messages": ['),
    ("body not an object", "/v1/completions", b"[1, 2]"),
    ("unknown field", "/v1/completions", {"prompt": "hi", "beam_search": True}),
    ("wrong type", "/v1/completions", {"prompt": "hi", "max_tokens": "12"}),
    ("value out of range", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 7}),
    ("prompt over the context", "/v1/completions", {"prompt": "hello " * 20000}),
    ("absurd max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": 10**12}),
    ("unsupported n", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 4}),
    ("unknown model", "/v1/completions", {"prompt": "hi", "model": "gpt-4o"}),
    ("unknown route", "/v1/embeddings", {"input": "hi"}),
]


def robustness(server: Served, in_a_row: int, no_eos: dict) -> dict:
    bad = []
    for what, path, body in BAD_REQUESTS:
        if isinstance(body, dict):
            body = json.dumps({"model": server.model} | body).encode()
        conn = http.client.HTTPConnection(server.host, server.port, timeout=600)
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        error = json.loads(response.read()).get("error", {})
        conn.close()
        after = server.stream("/v1/completions", {"prompt": "still serving?", "max_tokens": 2})
        bad.append({"what": what, "status": response.status, "code": error.get("code"), "param": error.get("param"),
                    "served_after": after["usage"]["completion_tokens"] > 0})

    before = server.health()["generated_tokens"]
    limit = 2000
    conn = http.client.HTTPConnection(server.host, server.port, timeout=600)
    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": limit, "stream": True, "logit_bias": no_eos}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response, chunks = conn.getresponse(), 0
    for line in response:
        chunks += line.startswith(b"data: ")
        if chunks == 3:
            break
    tic = time.perf_counter()
    response.close()  # the client goes away mid-stream
    conn.close()
    while server.health()["running"]:
        time.sleep(0.05)
    disconnect = {"max_tokens": limit, "generated_before_stop": server.health()["generated_tokens"] - before, "stopped_after_s": time.perf_counter() - tic}

    samples = []
    for i in range(in_a_row + 1):
        if i % 100 == 0:
            h = server.health()
            samples.append({"requests": i, "mlx_active": h["memory"]["active"], "prompt_cache_bytes": h["prompt_cache"]["bytes"],
                            "prompt_cache_max": h["prompt_cache"]["max_bytes"], "rss": resident_bytes(server.process.pid)})
        if i < in_a_row:
            server.stream("/v1/completions", {"prompt": f"Request {i}", "max_tokens": 1})
    return {"bad_requests": bad, "disconnect": disconnect, "in_a_row": samples}


def resident_bytes(pid: int) -> int | None:
    """The process's resident set (Linux's /proc; None elsewhere)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def step_costs(model_arg: str | None, widths: list[int], context: int = 64, steps: int = 10) -> list[dict]:
    """Median time of a batched decode step over rows that each hold `context` tokens."""
    import mlx.core as mx

    from mlx_hybrid.batch import Batch
    from mlx_hybrid.default_model import default_model_path
    from mlx_hybrid.decode import prefill
    from mlx_hybrid.hub import resolve
    from mlx_hybrid.loader import load

    model, _ = load(resolve(model_arg) if model_arg else default_model_path())
    out = []
    for width in widths:
        batch = Batch()
        for row in range(width):
            cache = model.make_cache()
            prefill(model, mx.array([(7 * row + i) % 1000 + 3 for i in range(context)]), cache)
            batch.add(cache)
        tokens = mx.array([5] * width)[:, None]
        step_ms = median_eval_ms(lambda: model(tokens, batch.caches), steps, warm=2)
        out.append({"rows": width, "step_ms": step_ms, "tokens_per_s": width / (step_ms / 1e3)})
    return out


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    k = max(0, min(len(sorted_values) - 1, -(-len(sorted_values) * q // 100) - 1))
    return sorted_values[int(k)]


def eos_bias(model: str | None) -> dict:
    from mlx_hybrid.default_model import default_model_path
    from mlx_hybrid.hub import resolve
    from mlx_hybrid.loader import load_tokenizer

    path = resolve(model) if model else default_model_path()
    config = json.loads((path / "config.json").read_text())
    eos = config.get("eos_token_id")
    tokenizer = load_tokenizer(path, [eos] if isinstance(eos, int) else eos)
    return {str(t): -100 for t in tokenizer.eos_token_ids}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="Model directory or Hub id (default: the embedded default model).")
    p.add_argument("--out", type=Path, default=BENCH_DIR / "results", help="Directory for the JSON result.")
    p.add_argument("--label", help="Device label (default: derived from the device).")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=32, help="Requests per concurrency level.")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--parts", default="serve", choices=["serve", "steps", "robustness"], help="what to measure (see above)")
    p.add_argument("--in-a-row", type=int, default=1000, help="requests one after another (robustness)")
    args = p.parse_args(argv)

    device = device_description()
    label = args.label or device["default_label"]
    prompts = [line.strip() for line in (BENCH_DIR / "chat_prompts.txt").read_text().splitlines() if line.strip()]
    levels = [int(c) for c in args.concurrency.split(",")]
    result = {"label": label, "device": device, "model": args.model or "embedded default", "date": date.today().isoformat(),
              "command": "python -m benchmarks.serve " + shlex.join(sys.argv[1:] if argv is None else argv), "turns": args.turns, "reply_tokens": args.reply_tokens, "max_tokens": args.max_tokens, "requests": args.requests}

    if args.parts == "steps":
        result["steps"] = step_costs(args.model, levels)
    elif args.parts == "robustness":
        server = Served(args.model, "--prompt-cache", "64MB")
        try:
            result.update(robustness(server, args.in_a_row, eos_bias(args.model)))
        finally:
            server.stop()
    else:
        no_eos = eos_bias(args.model)
        servers = {"batched": Served(args.model), "uncached": Served(args.model, "--prompt-cache", "0"),
                   "queued": Served(args.model, "--max-batch", "1")}
        try:
            for server in servers.values():
                server.stream("/v1/completions", {"prompt": "warm up", "max_tokens": 4})
            result["chat_with_cache"], result["chat_without_cache"] = chat([servers["batched"], servers["uncached"]], prompts, args.turns, args.reply_tokens)
            result["batching"], result["queue"] = [], []
            for c in levels:  # the two servers level by level in turn, as the chat
                result["batching"].append(load_level(servers["batched"], workload(prompts, c, args.requests), c, args.max_tokens, no_eos))
                result["queue"].append(load_level(servers["queued"], workload(prompts, c, args.requests), c, args.max_tokens, no_eos))
            result["health_after"] = servers["batched"].health()
        finally:
            for server in servers.values():
                server.stop()
        result["same_replies"] = [t["reply"] for t in result["chat_with_cache"]] == [t["reply"] for t in result["chat_without_cache"]]

    args.out.mkdir(parents=True, exist_ok=True)
    slug = f"serve{'' if args.parts == 'serve' else '-' + args.parts}-{slugify(result['model'])}-{slugify(label)}"
    (args.out / f"{slug}.json").write_text(json.dumps(result, indent=1))
    print(render_file(args.out / f"{slug}.json"))
    print(f"\nwrote {args.out / (slug + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
