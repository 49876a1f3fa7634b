"""An oracle proposer: speculation's end-to-end speed at a chosen acceptance, without trained heads.

Its drafts are the target's own greedy continuation (`continuation`, computed first by plain
greedy decoding), corrupted to a per-depth acceptance profile: at each pass, depth d is right with
probability profile[d - 1] given that depth d - 1 was (`Depths`, seeded, so a run repeats), and
every other draft is a token that differs from the true one at its depth. The runtime verifies
the drafts exactly as it verifies trained heads' (`speculative_steps`, the greedy loop's
`draft`), in the same shapes: `OracleTree` fills a Medusa tree, `OracleBeams` ReDrafter's beams.
The drafting itself costs nothing, so the rows measure verification and acceptance alone.

`PROFILE`, the default, is what the 135M default model's trained drafter reaches on held-out chat,
measured by running it (`measure`; `python -m benchmarks.oracle`): for its tuned 4x5 beams (4 drafts deep), the share of
passes that accepted d drafts or more among those that accepted d - 1 or more. That is the
acceptance of the pass, every beam counted: the oracle puts the true path on one beam or chain, so
a profile of one chain's top-1 accuracy (0.538 / 0.499 / 0.471 for the same drafter,
benchmarks/results/train-default-nvidia-h100.json) would undercount what the beams accept.

`--beam WxL` measures the drafter at another beam (a smaller beam accepts less and costs a
smaller pass).

    python -m benchmarks.oracle [--model DIR] [--prompts 16] [--gen-tokens 64] [--beam 2x5]
"""

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_hybrid.decode import generate_step
from mlx_hybrid.errors import HybridError
from mlx_hybrid.sampling import SamplingParams
from mlx_hybrid.speculative.accept import Candidates, Draft
from mlx_hybrid.speculative.redrafter import beam_draft
from mlx_hybrid.speculative.tree import MedusaTree, pack_beams

# python -m benchmarks.oracle --prompts 16 --gen-tokens 64: 398 passes, 2.57 tokens a pass
# (benchmarks/results/oracle-profile-default-cpu-linux-x86-64-2-cores.json)
PROFILE = (0.623, 0.657, 0.742, 0.777)


def parse_profile(text: str) -> tuple[float, ...]:
    """'0.6,0.5,0.45,0.4' -> the per-depth acceptance, each in [0, 1]."""
    try:
        profile = tuple(float(x) for x in text.split(","))
    except ValueError:
        profile = ()
    if not profile or not all(0 <= p <= 1 for p in profile):
        raise HybridError(f"--profile takes comma-separated probabilities in [0, 1], got '{text}'")
    return profile


def continuation(model, prompt: list[int], n: int) -> list[int]:
    """The target's first n tokens after prompt by plain greedy decoding."""
    argmax = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    return [t for t, _ in generate_step(mx.array(prompt), model, model.make_cache(), argmax, max_tokens=n)]


class Depths:
    """How many depths each pass gets right: depth d with probability profile[d - 1] given d - 1
    was, so k or more with probability prod(profile[:k]). The passes' uniforms form a
    low-discrepancy sequence (u_i = frac(u_0 + i / golden ratio); k = the depths whose
    probability of being reached exceeds u_i), not independent draws: over n passes each depth
    is reached in its probability's share of them to within about 2 / n, where independent draws
    stray by about 0.5 / sqrt(n); over the 30 passes of a 64-token run, independent draws moved
    the tokens a pass by a fifth."""

    STEP = (5**0.5 - 1) / 2

    def __init__(self, profile, seed: int = 0):
        self.reached = np.cumprod(np.asarray(profile, np.float64))
        self.u = np.random.default_rng(seed).random()

    def __call__(self) -> int:
        self.u = (self.u + self.STEP) % 1.0
        return int(np.sum(self.u < self.reached))


class Oracle:
    """What both shapes share: the reference (the prompt then its greedy continuation), where the
    next pass's root sits in it, and the draw of each pass's true depth.

    The greedy loop queues a pass before the host reads the last one, so `draft` cannot read its
    root; it moves past the depth it drew and the target's token after it, which is what the
    target accepts as long as it decodes the reference (the benchmark's "same tokens" confirms
    it). `propose` finds the root by matching the history it is given against the reference."""

    drafts_on_device = True

    def __init__(self, reference: list[int], start: int, profile, vocab: int, depth: int, reach: int, seed: int = 0):
        """start: where the first generated token sits in reference; depth: the drafts a pass
        holds; reach: the deepest the true path can go in the shape."""
        self.reference, self.pos, self.vocab, self.depth, self.reach = list(reference), start, vocab, depth, reach
        self.profile = np.zeros(depth)  # a depth past the profile is never right
        given = np.asarray(profile[:depth], np.float64)
        self.profile[: len(given)] = given
        self.rng, self.depths = np.random.default_rng(seed), Depths(self.profile, seed)

    def _draw(self) -> tuple[np.ndarray, int]:
        """The true tokens (depth,) after the root, -1 past the reference, and how many the pass gets right."""
        truth = self.reference[self.pos + 1 : self.pos + 1 + self.depth]
        k = min(self.depths(), len(truth), self.reach)
        self.pos += k + 1
        return np.array(truth + [-1] * (self.depth - len(truth))), k

    def _wrong(self, truth: np.ndarray, n: int) -> np.ndarray:
        """(depth, n) tokens, distinct within a row, none the row's true token."""
        offsets = np.stack([self.rng.choice(self.vocab - 1, n, replace=False) + 1 for _ in truth])
        return (truth[:, None] + offsets) % self.vocab

    def propose(self, history: list[int], hidden: mx.array, sampling: SamplingParams) -> Candidates:
        n = min(len(history), len(self.reference))
        off = np.flatnonzero(np.array(history[:n]) != np.array(self.reference[:n]))
        if off.size:
            raise HybridError(f"token {off[0]} is not the oracle's reference: it drafts the target's greedy continuation only")
        self.pos = len(history) - 1
        d = self.draft(mx.array(history[-1:]), hidden)
        return Candidates(np.array(d.tokens), np.array(d.tree.parents).tolist(), tree=d.tree)


class OracleTree(Oracle):
    """Medusa-shaped: the tree's tokens from per-head top-k lists, as the heads' are
    (`MedusaTree.tokens`); the true token is head d's first, on the top-1 chain, where trained
    heads put it most often."""

    name = "medusa"

    def __init__(self, tree: MedusaTree, reference: list[int], start: int, profile, vocab: int, seed: int = 0):
        chain = max(len(p) for p in tree.paths if not any(p))
        super().__init__(reference, start, profile, vocab, tree.num_heads, chain, seed)
        self.tree, self.rows, self.top = tree, mx.array(tree.retrieve), max(tree.topk)

    def draft(self, root: mx.array, hidden: mx.array) -> Draft:
        truth, k = self._draw()
        top = self._wrong(truth, self.top)
        top[:k, 0] = truth[:k]
        return Draft(self.tree.tokens(root, mx.array(top, mx.int32)), self.tree.tree, self.rows)


class OracleBeams(Oracle):
    """ReDrafter-shaped: width beams of length tokens from the root, packed as the drafter's are
    (`pack_beams`); the first beam carries the true prefix, the others wrong tokens from depth 1."""

    name = "redrafter"

    def __init__(self, width: int, length: int, reference: list[int], start: int, profile, vocab: int, seed: int = 0):
        super().__init__(reference, start, profile, vocab, length - 1, length - 1, seed)
        self.width = width

    def draft(self, root: mx.array, hidden: mx.array) -> Draft:
        truth, k = self._draw()
        beams = self._wrong(truth, self.width).T  # (width, depth)
        beams[0, :k] = truth[:k]
        roots = mx.broadcast_to(root.reshape(1, 1).astype(mx.int32), (self.width, 1))
        packed = pack_beams(mx.concatenate([roots, mx.array(beams, mx.int32)], axis=1))
        return beam_draft(packed.tokens, packed.tree.parents, packed.tree.depths, packed.tree.mask, packed.node_of, packed.count)


class OracleDraft:
    """An oracle draft model for mlx-lm's `speculative_generate_step`: its k drafts a round are
    the reference's next tokens, depth d right with probability profile[d - 1] given d - 1 was
    (`Depths`, as `Oracle`'s), every other draft a wrong token, so that mlx-lm's draft-model
    decoding runs at the acceptance the oracle rows run at. It reads where it is from its cache's
    offset (the tokens it was fed, less what mlx-lm trimmed), and a round starts at each trim,
    which mlx-lm makes after every verification. Its logits cost one small array a call."""

    def __init__(self, reference: list[int], start: int, profile, vocab: int, seed: int = 0):
        """start: where the first generated token sits in reference (the prompt's length)."""
        self.reference, self.start, self.vocab, self.rng = list(reference), start, vocab, np.random.default_rng(seed)
        self.depths = Depths(profile, seed)
        self.cache = _DraftCache(self)
        self.round = None

    def make_cache(self) -> list:
        self.cache.offset, self.round = 0, None
        return [self.cache]

    def start_round(self):
        self.round = [0, self.depths()]  # calls made, depths right

    def __call__(self, inputs: mx.array, cache: list) -> mx.array:
        c = cache[0]
        c.offset += inputs.shape[1]
        at = c.offset  # the reference position this call predicts
        if at < self.start:  # the prompt's prefill: no draft
            return mx.zeros((1, inputs.shape[1], self.vocab))
        if self.round is None:
            self.start_round()
        self.round[0] += 1
        truth = self.reference[at] if at < len(self.reference) else 0
        token = truth if self.round[0] <= self.round[1] else (truth + 1 + int(self.rng.integers(self.vocab - 1))) % self.vocab
        logits = mx.where(mx.arange(self.vocab) == token, 30.0, 0.0)
        return mx.broadcast_to(logits, (1, inputs.shape[1], self.vocab))


class _DraftCache:
    """What mlx-lm asks of a draft's cache: an offset it can trim, and a state to evaluate."""

    def __init__(self, draft: OracleDraft):
        self.draft, self.offset, self.state = draft, 0, mx.zeros(1)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        self.offset -= n
        self.draft.round = None  # a verification happened: the next call starts a round
        return n


def measure(model_dir: Path, prompts: list[list[int]], gen_tokens: int, method: str = "redrafter",
            beam: tuple[int, int] | None = None) -> dict:
    """Run the model's own trained `method` greedily after each prompt and count the drafts each
    pass accepted: {"profile": (P(>= d | >= d - 1) for d = 1..depth), "tokens_per_pass", "passes"};
    beam: ReDrafter's (width, length) instead of its drafter's own."""
    from mlx_hybrid.loader import load_model
    from mlx_hybrid.profiles import Settings
    from mlx_hybrid.speculative.proposer import load_proposer
    from mlx_hybrid.speculative.steps import speculative_steps

    model = load_model(model_dir)
    proposer = load_proposer(method, model, model_dir, settings=Settings(*beam) if beam else None)
    accepted = []
    for prompt in prompts:
        made = 0
        for i, (new, _) in enumerate(speculative_steps(model, proposer, prompt, model.make_cache(), SamplingParams())):
            if i:  # the first pass reads the prompt and drafts nothing
                accepted.append(len(new) - 1)
            made += len(new)
            if made >= gen_tokens:
                break
    return {"profile": profile_of(accepted), "tokens_per_pass": float(np.mean(accepted)) + 1, "passes": len(accepted)}


def profile_of(accepted: list[int]) -> tuple[float, ...]:
    """Each pass's accepted drafts -> P(accepted >= d | accepted >= d - 1) for d = 1..the most
    accepted, to 3 places: the profile under which the oracle accepts as those passes did."""
    at_least = np.bincount(accepted)[::-1].cumsum()[::-1]  # passes that accepted d or more, d = 0..max
    return tuple(round(float(at_least[d] / at_least[d - 1]), 3) for d in range(1, len(at_least)))


def main(argv=None) -> int:
    from benchmarks.run import parse_beam
    from benchmarks.speculative import CHAT_PROMPTS
    from mlx_hybrid.chat import render_chat
    from mlx_hybrid.default_model import default_model_path
    from mlx_hybrid.loader import load_tokenizer

    p = argparse.ArgumentParser(description="The per-depth acceptance a model's trained drafter reaches on held-out chat.")
    p.add_argument("--model", type=Path, default=None, help="a model directory with its redrafter/ (default: the embedded default)")
    p.add_argument("--method", choices=("redrafter", "medusa"), default="redrafter")
    p.add_argument("--prompts", type=int, default=16, help="held-out chat questions (benchmarks/chat_prompts.txt)")
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--beam", default=None, help="redrafter: beam width x length, e.g. 2x5 (default: the drafter's own)")
    p.add_argument("--results", type=Path, default=None, help="also write the measurement into this directory")
    args = p.parse_args(argv)
    try:
        beam = parse_beam(args.beam) if args.beam else None
        if beam is not None and (min(beam) < 1 or args.method != "redrafter"):
            raise ValueError
    except ValueError:
        p.error(f"--beam takes WxL with --method redrafter, got {args.beam!r}")
    model_dir = args.model or default_model_path()
    tokenizer = load_tokenizer(model_dir)
    questions = CHAT_PROMPTS.read_text().splitlines()[: args.prompts]
    prompts = [render_chat(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    result = measure(model_dir, prompts, args.gen_tokens, args.method, beam)
    print(json.dumps(result))
    if args.results:
        import shlex, sys, time
        from benchmarks.run import device_description, slugify

        device = device_description()
        result |= dict(label=device["default_label"], device=device, model=model_dir.name, method=args.method, beam=args.beam,
                       prompts=f"each of {len(prompts)} held-out chat questions", gen_tokens=args.gen_tokens,
                       command="python -m benchmarks.oracle " + shlex.join(argv if argv is not None else sys.argv[1:]),
                       timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"))
        args.results.mkdir(parents=True, exist_ok=True)
        name = slugify(f"oracle-profile {args.model.name if args.model else 'default'} {args.beam or ''} {device['default_label']}")
        (args.results / f"{name}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
