"""The `hybrid` command: chat and generate with Llama-family and hybrid models on MLX."""

import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from mlx_hybrid.cli import on_interrupt
from mlx_hybrid.errors import HybridError

app = typer.Typer(
    help="Fast on-device LLM inference on MLX: chat with or generate from a model directory.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _no_type_for_flags(display_type_rich):
    """typer's rich help prints each option's type beside it, `<bool>` beside a flag too, which
    takes no value (its plain help leaves flags bare): flags get no type column."""

    def display(self, ctx):
        return None if self.is_flag else display_type_rich(self, ctx)

    return display


typer.core.TyperOption.display_type_rich = _no_type_for_flags(typer.core.TyperOption.display_type_rich)
out = Console(highlight=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)

MODEL_HELP = (
    "Model directory (config.json, *.safetensors, tokenizer) or Hugging Face repo id (org/name, via the Hub cache). "
    "Default: the embedded distilled hybrid (4-bit, with its ReDrafter drafter)."
)


def _print_version(value: bool):
    if value:
        from mlx_hybrid import __version__

        out.print(f"mlx-hybrid {__version__}", markup=False)
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
):
    """Fast on-device LLM inference on MLX: chat with or generate from a model directory."""


def _load(model_dir: Optional[Path]):
    """(model, tokenizer, its directory): model_dir (a directory or Hub repo id), or the embedded
    default model's."""
    from mlx_hybrid.hub import resolve
    from mlx_hybrid.default_model import default_model_path
    from mlx_hybrid.loader import load

    model_dir = default_model_path() if model_dir is None else resolve(model_dir)
    with err.status(f"Loading {model_dir} ..."):
        return (*load(model_dir), model_dir)


def _given(temp, top_p, top_k, min_p, repetition_penalty, seed) -> dict:
    """The sampling flags given on the command line, checked before any model loads."""
    from mlx_hybrid.sampling import SamplingParams

    given = dict(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty, seed=seed)
    SamplingParams(**{k: v for k, v in given.items() if v is not None}).check()
    return given


def _sampling(model, given: dict, proposer):
    """The flags given over the model's generation_config.json defaults, and a line saying which
    setting came from where."""
    from mlx_hybrid.generation_config import model_sampling_defaults

    defaults = model_sampling_defaults(model)
    params = defaults.params(speculative=proposer is not None, **given)
    params.check(model.args.vocab_size)
    return params, f"sampling: {defaults.describe(params, given)}"


def _utf8(text: str, what: str) -> str:
    """text, unless it came from bytes that are not UTF-8 (Python keeps those as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise HybridError(f"{what} is not UTF-8 text") from None
    return text


def _stats(r) -> str:
    memory = f"{r.peak_memory:.2f} GB" if r.peak_memory >= 1 else f"{r.peak_memory * 1e3:.0f} MB"
    speculation = ""
    if r.method is not None:
        speculation = f" | {r.method}: {r.tokens_per_step:.2f} tok/step, {r.acceptance_rate:.0%} of drafts accepted"
    return (
        f"prompt {r.prompt_tokens} tok, {r.prompt_tps:.1f} tok/s | "
        f"reply {r.generation_tokens} tok, {r.generation_tps:.1f} tok/s{speculation} | peak memory {memory}"
    )


def _proposer(method, target, tokenizer, model_dir, heads, draft_model, num_draft):
    """The proposer --speculative asks for, its files given or beside the model, with this device's
    settings (`mlx_hybrid.profiles`). Without --speculative: the method a `hybrid tune` profile
    found fastest here, or None (plain decoding)."""
    from mlx_hybrid.hub import resolve
    from mlx_hybrid.profiles import profile_choice, settings_for, use_kernel_limits

    if method is None:
        method = profile_choice(model_dir, target)
        if method is None:
            return None
    from mlx_hybrid.speculative import load_proposer

    use_kernel_limits(model_dir, target)  # which parts of a pass take the kernels here

    settings = settings_for(method, model_dir, target) if method in ("medusa", "redrafter") else None
    with err.status(f"Loading the {method} speculator ..."):
        path = draft_model if method == "draft" else heads
        path = None if path is None else resolve(path)
        proposer = load_proposer(method, target, model_dir, path, num_draft=num_draft, settings=settings, tokenizer=tokenizer)
    if settings is not None:
        err.print(f"[dim]speculation: {settings.describe(method)}[/]")
    return proposer


# Shared sampling options (typer reads defaults from these). Unset, each takes the model's
# generation_config.json value, else the value that disables it.
Temp = typer.Option(None, "--temp", help="Sampling temperature; 0 is greedy. Default: the model's generation_config.json, else 0.")
TopP = typer.Option(None, "--top-p", help="Nucleus sampling mass (0 disables). Default: generation_config.json's, else 0.")
TopK = typer.Option(None, "--top-k", help="Keep only the k most likely tokens (0 disables). Default: generation_config.json's, else 0.")
MinP = typer.Option(
    None, "--min-p", help="Drop tokens below min-p times the top probability (0 disables). Default: generation_config.json's, else 0."
)
RepPenalty = typer.Option(
    None, "--repetition-penalty",
    help="Penalize the last 20 tokens (> 1 discourages repeats). Default: generation_config.json's (not with speculation), else none.",
)
Seed = typer.Option(None, "--seed", help="Random seed for sampling.")
Speculative = typer.Option(
    None, "--speculative",
    help="Speculative decoding: medusa, redrafter or draft (files in MODEL/<method> or given by path). "
    "Default: what `hybrid tune` found fastest on this device, else none.",
)
Heads = typer.Option(None, "--heads", help="Medusa heads or ReDrafter drafter directory. Default: MODEL/medusa, MODEL/redrafter.")
DraftModel = typer.Option(None, "--draft-model", help="Draft model directory for --speculative draft. Default: MODEL/draft.")
NumDraft = typer.Option(4, "--num-draft", help="Tokens the draft model proposes per step.")
Budget = typer.Option(
    None, "--memory-budget", help="Memory for weights + cache, e.g. 8GB; DSLA layers convert to fit. Default: the device's."
)


def _conversion(dsla_layers: list, layers: int, cache: str) -> str:
    """Footer of runs under a conversion policy: layers running as DSLA, and the cache's memory."""
    n = len(dsla_layers)
    return f" | DSLA {n}/{layers} layers ({n / layers:.0%}) | KV {cache}"


class _RereadBar:
    """`ChatSession.on_reread` in the terminal: a line, then a progress bar on stderr while a turn
    reads the conversation again, so a long pause before the reply says why."""

    def __init__(self):
        self.bar = None

    def __call__(self, done: int, total: int):
        from rich.progress import Progress

        if self.bar is None:
            err.print(f"[dim]re-reading the conversation ({total} tokens)[/]")
            self.bar = Progress(console=err, transient=True)
            self.task = self.bar.add_task("re-reading", total=total)
            self.bar.start()
        self.bar.update(self.task, completed=done)
        if done == total:
            self.close()

    def close(self):
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


@app.command()
def chat(
    model: Optional[Path] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    max_tokens: int = typer.Option(512, "--max-tokens", help="Longest reply, in tokens."),
    temp: Optional[float] = Temp,
    top_p: Optional[float] = TopP,
    top_k: Optional[int] = TopK,
    min_p: Optional[float] = MinP,
    repetition_penalty: Optional[float] = RepPenalty,
    seed: Optional[int] = Seed,
    memory_budget: Optional[str] = Budget,
    speculative: Optional[str] = Speculative,
    heads: Optional[Path] = Heads,
    draft_model: Optional[Path] = DraftModel,
    num_draft: int = NumDraft,
):
    """Chat in the terminal. /reset clears the history, /exit quits, Ctrl-C stops a reply."""
    from mlx_hybrid.adaptive import parse_budget
    from mlx_hybrid.chat import ChatSession

    given = _given(temp, top_p, top_k, min_p, repetition_penalty, seed)
    if max_tokens < 1:
        raise HybridError(f"--max-tokens must be >= 1, got {max_tokens}")
    system = None if system is None else _utf8(system, "--system")
    budget = None if memory_budget is None else parse_budget(memory_budget)
    loaded, tokenizer, model = _load(model)
    proposer = _proposer(speculative, loaded, tokenizer, model, heads, draft_model, num_draft)
    sampling, described = _sampling(loaded, given, proposer)
    rereading = _RereadBar()
    session = ChatSession(loaded, tokenizer, system=system, memory_budget=budget, speculator=proposer, on_reread=rereading)
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    out.print(described, style="dim", markup=False, soft_wrap=True)
    out.print("[dim]Type a message. /reset clears the history, /exit or Ctrl-D quits, Ctrl-C stops a reply.[/]")
    last_interrupt = float("-inf")

    def quits() -> bool:
        """A Ctrl-C came: the second within a second quits; any other keeps the conversation."""
        nonlocal last_interrupt
        now = time.monotonic()
        second, last_interrupt = now - last_interrupt < 1.0, now
        return second

    while True:
        try:
            text = _utf8(input(">>> "), "the input").strip()
        except (UnicodeDecodeError, HybridError):  # bytes that are not UTF-8, strict or kept as surrogates
            err.print("error: the input is not UTF-8 text; it was skipped", markup=False)
            continue
        except EOFError:
            out.print()
            return
        except KeyboardInterrupt:
            out.print()
            if quits():
                return
            out.print("[dim](Ctrl-C again to quit; /exit or Ctrl-D also quit)[/]")
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            session.reset()
            out.print("[dim]History cleared.[/]")
            continue
        if not text:
            continue
        r = None
        try:
            replies = session.send(text, max_tokens=max_tokens, sampling=sampling)
            try:
                for r in replies:
                    out.print(r.text, end="", markup=False)
            finally:
                replies.close()
                rereading.close()
        except KeyboardInterrupt:
            out.print("[dim] \\[stopped][/]", end="")
            if quits():
                out.print()
                return
        except HybridError as e:
            out.print()
            err.print(f"error: {e} (/reset clears the history)", markup=False)
            continue
        out.print()
        if r is not None:
            limit = session.context_limit
            ctx = f" | context {session.context_used}/{limit}" if limit else ""
            if session.policy:
                from mlx_hybrid.adaptive import format_bytes

                ctx += _conversion(session.dsla_layers, len(session.cache), format_bytes(session.cache_bytes))
            out.print(f"[dim]{_stats(r)}{ctx}[/]")


@app.command()
def generate(
    model: Optional[Path] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text; '-' or omitted reads stdin."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Most tokens to generate."),
    raw: bool = typer.Option(False, "--raw", help="Use the prompt as is, without the chat template."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt (chat template only)."),
    stop: list[str] = typer.Option([], "--stop", help="Stop before this string (repeatable)."),
    temp: Optional[float] = Temp,
    top_p: Optional[float] = TopP,
    top_k: Optional[int] = TopK,
    min_p: Optional[float] = MinP,
    repetition_penalty: Optional[float] = RepPenalty,
    seed: Optional[int] = Seed,
    memory_budget: Optional[str] = Budget,
    speculative: Optional[str] = Speculative,
    heads: Optional[Path] = Heads,
    draft_model: Optional[Path] = DraftModel,
    num_draft: int = NumDraft,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print speed and memory to stderr."),
):
    """Generate a completion for one prompt and stream it to stdout."""
    from mlx_hybrid.adaptive import parse_budget
    from mlx_hybrid.chat import ChatSession
    from mlx_hybrid.generate import stream_generate

    given = _given(temp, top_p, top_k, min_p, repetition_penalty, seed)
    budget = None if memory_budget is None else parse_budget(memory_budget)
    if prompt is None or prompt == "-":
        if sys.stdin.isatty() and prompt is None:
            raise HybridError("no prompt: pass --prompt TEXT or pipe text on stdin")
        try:
            prompt = sys.stdin.read()
        except UnicodeDecodeError:
            raise HybridError("the prompt on stdin is not UTF-8 text") from None
    prompt = _utf8(prompt, "the prompt")
    system = None if system is None else _utf8(system, "--system")
    if not prompt.strip():
        raise HybridError("the prompt is empty")
    loaded, tokenizer, model = _load(model)
    if not raw:
        session = ChatSession(loaded, tokenizer, system=system)
        prompt = session.render(session.messages + [{"role": "user", "content": prompt}])
    proposer = _proposer(speculative, loaded, tokenizer, model, heads, draft_model, num_draft)
    sampling, described = _sampling(loaded, given, proposer)
    if verbose:
        err.print(described, style="dim", markup=False)
    r = None
    for r in stream_generate(loaded, tokenizer, prompt, max_tokens=max_tokens, sampling=sampling, stop=stop,
                             speculator=proposer, memory_budget=budget):
        out.print(r.text, end="", markup=False)
    out.print()
    if verbose and r is not None:
        from mlx_hybrid.adaptive import format_bytes

        plan = r.plan  # the cache at max_tokens, as the policy planned it
        conversion = _conversion(plan.dsla_layers, plan.num_layers, f"{format_bytes(plan.cache_bytes)} planned") if plan else ""
        err.print(f"[dim]{_stats(r)}{conversion}[/]")


@app.command()
def convert(
    src: Path = typer.Argument(
        ..., help="Checkpoint: Hugging Face Llama/Mistral, MambaInLlama release, DSLA-Serve checkpoint, llama_hybrid (a directory or Hub repo id), or a Llama .gguf file."
    ),
    dst: Path = typer.Argument(..., help="MLX model directory to write."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float16, bfloat16 or float32. Default: as stored."),
    quantize: bool = typer.Option(False, "--quantize", "-q", help="Quantize the linear layers and embeddings."),
    bits: int = typer.Option(4, "--bits", help="Bits per quantized weight: 4 or 8."),
    group_size: int = typer.Option(64, "--group-size", help="Weights sharing one scale: 32, 64 or 128."),
    recipe: str = typer.Option(
        "uniform", "--quant-recipe", help="uniform, or mixed: embeddings, LM head and SSM dt/gates stay float."
    ),
    embed_bits: Optional[int] = typer.Option(
        None, "--embed-bits", help="Bits for the embeddings and LM head (4, 5, 6 or 8; uniform recipe). Default: --bits."
    ),
    force: bool = typer.Option(False, "--force", help="Replace DST if it exists."),
    verify: bool = typer.Option(False, "--verify", help="Compare source (PyTorch) and converted logits on samples."),
    medusa: Optional[Path] = typer.Option(None, "--medusa", help="Medusa heads (FasterDecoding layout) -> DST/medusa."),
    redrafter: Optional[Path] = typer.Option(
        None, "--redrafter", help="ReDrafter drafter (apple/ml-recurrent-drafter layout) -> DST/redrafter."
    ),
):
    """Convert a PyTorch/Hugging Face checkpoint (or a llama.cpp GGUF file) into an MLX model directory that --model takes."""
    from rich.progress import Progress

    from mlx_hybrid.convert.gguf import convert_gguf
    from mlx_hybrid.convert.hf import convert as convert_checkpoint

    from mlx_hybrid.hub import CHECKPOINT_FILES, resolve

    src, medusa, redrafter = (None if p is None else resolve(p, CHECKPOINT_FILES) for p in (src, medusa, redrafter))
    gguf = src.suffix == ".gguf"
    if gguf and (quantize or embed_bits or recipe != "uniform" or verify or medusa or redrafter):
        raise HybridError("a GGUF file keeps its own quantization: of the options, it takes only --dtype and --force")
    with Progress(console=err, transient=True) as bar:
        task = bar.add_task("Converting tensors", total=None)
        progress = lambda done, total: bar.update(task, completed=done, total=total)  # noqa: E731
        if gguf:
            convert_gguf(src, dst, dtype, progress=progress, force=force)
        else:
            convert_checkpoint(src, dst, dtype, quantize, bits, group_size, recipe, force, progress=progress,
                               medusa=medusa, redrafter=redrafter, embed_bits=embed_bits)
    embed = f", embeddings {embed_bits}-bit" if embed_bits else ""
    quant = f", {bits}-bit {recipe}{embed} (group size {group_size})" if quantize else ""
    out.print(f"Wrote {dst}{quant}", markup=False)
    if verify:
        from mlx_hybrid.convert.checkpoint import open_checkpoint
        from mlx_hybrid.convert.verify import verify as verify_conversion

        with err.status("Verifying against the PyTorch source ..."):
            result = verify_conversion(open_checkpoint(src), dst)
        out.print(f"verify: {result}", markup=False, soft_wrap=True)


@app.command()
def tune(
    model: Optional[Path] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    method: str = typer.Option("all", "--method", help="redrafter, medusa, or all of those beside the model."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Calibration prompts, one a line. Default: shipped news prompts."),
    new_tokens: int = typer.Option(48, "--new-tokens", help="Greedy tokens generated per prompt."),
    max_width: int = typer.Option(8, "--max-width", help="Widest ReDrafter beam tried."),
    max_length: int = typer.Option(6, "--max-length", help="Longest ReDrafter beam tried (tokens, root included)."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Tune on a CPU without asking."),
):
    """Measure verification cost and draft acceptance here, save the fastest speculation settings."""
    import mlx.core as mx
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from mlx_hybrid.limits import check_beam, clip_max_tokens, context_of
    from mlx_hybrid.profiles import profile_path, save_profile
    from mlx_hybrid.tune import WIDTHS, calibration_prompts, plot, stages
    from mlx_hybrid.tune import tune as run_tune

    if method not in ("redrafter", "medusa", "all"):
        raise HybridError(f"--method must be redrafter, medusa or all, got '{method}'")
    texts = calibration_prompts(prompts)
    loaded, tokenizer, model = _load(model)
    methods = [m for m in ("redrafter", "medusa") if method in (m, "all") and (Path(model) / m).is_dir()]
    if not methods:
        raise HybridError(f"nothing to tune: no {'medusa/ or redrafter/' if method == 'all' else method + '/'} directory in {model}")
    if new_tokens < max_length or max_width < 1 or max_length < 2:
        raise HybridError("need --max-width >= 1, --max-length >= 2 and --new-tokens >= --max-length")
    check_beam(max_width, max_length, loaded, "--max-width x --max-length")
    if clip_max_tokens(new_tokens, loaded) < new_tokens:
        raise HybridError(f"--new-tokens {new_tokens} exceeds the model's context ({context_of(loaded)} tokens)")
    if mx.default_device() == mx.cpu:
        err.print("note: on a CPU a verification pass over n tokens costs about n decode steps, so speculation "
                  "cannot beat plain decoding here; tuning will most likely confirm that", markup=False)
        if not yes and sys.stdin.isatty() and not _confirm("continue?"):
            return
    widths = [w for w in WIDTHS if w <= max_width] or [1]
    order = stages(methods)
    path = profile_path(model)
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"), TimeRemainingColumn())
    partial = {}
    try:
        with Progress(*columns, console=err, transient=True) as bar:
            overall, tasks = bar.add_task("all stages", total=len(order)), {}

            def progress(stage, done, total):
                if stage not in tasks:
                    tasks[stage] = bar.add_task(f"  {stage}", total=total)
                bar.update(tasks[stage], completed=done, total=total)
                bar.update(overall, completed=order.index(stage) + done / total)

            profile = run_tune(loaded, tokenizer, model, texts, methods, new_tokens, widths, max_length, progress=progress, into=partial)
    except KeyboardInterrupt:
        _keep_finished_stages(partial, path)
        raise
    save_profile(profile, path)
    out.print(f"plain decoding: {profile['plain_tps']:.1f} tok/s on {profile['device']}", markup=False)
    for m in profile["measured"][1:]:
        what = f"beam {m['beam_width']}x{m['beam_length']}" if "beam_width" in m else (
            f"tree of {len(m['medusa_choices'])}" if "medusa_choices" in m else "")
        out.print(f"{m['method']:>9} {m['kind']:<9} {what:<14} {m['tps']:.1f} tok/s ({m['tps'] / profile['plain_tps']:.2f}x)", markup=False)
    choice = profile["choice"] or "plain decoding"
    out.print(f"fastest: {choice}; profile {path}", markup=False)
    check = profile.get("tree_attention", {}).get("end_to_end")
    if check:  # the kernel's limit, run end to end both ways on the fastest setting
        from statistics import median

        takes = lambda n: "no tree" if int(n) == 0 else f"trees of up to {n} nodes"  # noqa: E731
        runs = ", ".join(f"{takes(n)} {median(tps):.1f}" for n, tps in check["tps"].items())
        out.print(f"tree-attention kernel: {takes(check['limit'])} (tok/s with it taking {runs})", markup=False)
    try:
        plot(profile, path.with_suffix(".png"))
        out.print(f"plot {path.with_suffix('.png')}", markup=False)
    except ImportError:
        out.print("plot skipped: pip install matplotlib", markup=False)


def _confirm(question: str) -> bool:
    try:
        return err.input(f"{question} [y/N] ", markup=False).strip().lower() in ("y", "yes")
    except EOFError:
        return False


def _json_or_empty(path: Path) -> dict:
    from mlx_hybrid.validate import read_json_object

    try:
        return read_json_object(path)
    except HybridError:  # a broken profile is worth less than the new stages
        return {}


def _keep_finished_stages(partial: dict, path: Path):
    """After a Ctrl-C in `hybrid tune`: save what the finished stages measured, unless nothing
    finished or a complete profile from an earlier run is there (it is worth more)."""
    from mlx_hybrid.profiles import save_profile

    finished = partial.get("stages")
    if not finished:
        err.print("interrupted before any stage finished; no profile written", markup=False)
    elif path.is_file() and "choice" in _json_or_empty(path):
        err.print(f"interrupted; the complete profile from an earlier run stays: {path}", markup=False)
    else:
        save_profile(partial, path)
        err.print(f"interrupted; the profile keeps the finished stages ({', '.join(finished)}): {path}", markup=False)


@app.command()
def doctor():
    """Check this device: every GPU kernel against its pure-MLX reference (run this first, paste it into bug reports)."""
    from rich.table import Table

    from mlx_hybrid import doctor as checks

    info = checks.device()
    for name, value in info.items():
        out.print(f"{name:<16} {value}", markup=False)
    backend = checks.kernels.kernel_backend()
    table = Table("kernel", "kernel vs reference", "ms a launch", "reference vs float64", "result", box=None, pad_edge=False)
    results = [checks.check(case, backend) for case in checks.cases()]
    for r in results:
        table.add_row(r.kernel, "n/a" if r.kernel_error is None else f"{r.kernel_error:.2g}", "n/a" if r.ms is None else f"{r.ms:.3f}",
                      f"{r.reference_error:.2g}", "ok" if r.ok else "FAIL", style=None if r.ok else "red")
    out.print(table)
    for r in results:
        if not r.ok:
            out.print(f"{r.kernel}: {r.problem}", markup=False, soft_wrap=True)
    failed = sum(not r.ok for r in results)
    if backend and info["simdgroup width"] != "32":
        raise HybridError(f"the kernels assume 32 threads a simdgroup; this GPU reports {info['simdgroup width']}")
    if failed:
        raise HybridError(f"{failed} of {len(results)} kernel checks failed")
    out.print(f"all {len(results)} checks passed", markup=False)



@app.command()
def serve(
    model: Optional[Path] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on; the default serves this machine only."),
    port: int = typer.Option(8080, "--port", help="TCP port to listen on."),
    speculative: Optional[str] = Speculative,
    heads: Optional[Path] = Heads,
    draft_model: Optional[Path] = DraftModel,
    num_draft: int = NumDraft,
    max_batch: int = typer.Option(16, "--max-batch", help="Requests decoded together; more wait in the queue."),
    prompt_cache: str = typer.Option("2GB", "--prompt-cache", help="Memory for caches kept for reuse across requests, e.g. 2GB; 0 keeps none."),
    temp: Optional[float] = typer.Option(
        None, "--temp",
        help="Sampling temperature of requests that set none. Default: the model's generation_config.json, else 1 (OpenAI's).",
    ),
):
    """Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models)."""
    from mlx_hybrid.adaptive import parse_budget
    from mlx_hybrid.hub import is_repo_id
    from mlx_hybrid.server import Loaded, Server

    if not 0 <= port <= 65535:
        raise HybridError(f"--port must be in [0, 65535], got {port}")
    if max_batch < 1:
        raise HybridError(f"--max-batch must be >= 1, got {max_batch}")
    if temp is not None and temp < 0:
        raise HybridError(f"--temp must be >= 0, got {temp}")
    cache_bytes = 0 if prompt_cache.strip() == "0" else parse_budget(prompt_cache)
    if model is None:
        model_id = "default"
    else:
        model_id = str(model) if is_repo_id(str(model)) and not model.exists() else model.resolve().name

    def load():  # runs on the server's model thread, which owns every MLX array
        loaded, tokenizer, path = _load(model)
        return Loaded(loaded, tokenizer, _proposer(speculative, loaded, tokenizer, path, heads, draft_model, num_draft))

    server = Server(load, model_id, host, port, max_batch=max_batch, prompt_cache_bytes=cache_bytes, default_temp=temp)
    server.run(on_ready=lambda url: err.print(f"Serving '{model_id}' at {url} (Ctrl-C stops)", markup=False))


def _warning(message, category, filename, lineno, file=None, line=None):
    err.print(f"warning: {message}", markup=False)


def _raise_interrupt():
    raise KeyboardInterrupt


def main():
    """Entry point: runs the app and turns every user error into one line on stderr."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, on_interrupt(_raise_interrupt))  # `run` made it exit quietly while importing
    command = typer.main.get_command(app)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning  # one line each (a bad tuning profile is named and ignored)
            code = command.main(prog_name="hybrid", standalone_mode=False)
    except HybridError as e:
        err.print(f"error: {e}", markup=False)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except MemoryError:
        err.print("error: out of memory", markup=False)
        sys.exit(1)
    except Exception as e:
        # Usage errors from typer's click (vendored or not): they carry format_message/exit_code.
        if type(e).__name__ == "NoArgsIsHelpError":
            out.print(e.ctx.get_help(), markup=False)
            sys.exit(0)
        if type(e).__name__ == "Abort":  # click's word for a Ctrl-C inside its own code
            sys.exit(130)
        if isinstance(e, OSError):  # a file, the disk or the terminal failed under us
            err.print(f"error: {e.strerror or e}{f': {e.filename}' if e.filename else ''}", markup=False)
            sys.exit(1)
        if not (hasattr(e, "format_message") and hasattr(e, "exit_code")):
            raise
        err.print(f"error: {e.format_message()}", markup=False)
        sys.exit(e.exit_code)
    sys.exit(code or 0)


if __name__ == "__main__":
    main()
