"""Speculative decoding on tiny random Llama targets (CPU, float32).

Exactness: at temperature 0 every method must give exactly the tokens of plain greedy decoding
(`mlx_hybrid.generate.generate_step`). Equality is only meaningful if no step is a near-tie, so
the reference's gap between its two best log-probabilities is checked to exceed 1e-3, two orders
above the 1e-5 by which a verification pass's logits differ from plain decoding's
(tests/test_speculative_tree.py checks those to 1e-4).

Distribution: at temperature > 0, draft-model and ReDrafter outputs must be distributed as
sampling from the target. Chi-square goodness-of-fit tests against the exact target
probabilities, at significance level 0.001, with fixed seeds (so each test is deterministic).
"""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from tests.helpers import cuda_emulator
from tests.helpers.factories import make_hf_model_dir, make_hybrid_dir, took_compiled_pass
from mlx.utils import tree_flatten, tree_map

from mlx_hybrid.errors import HybridError
from mlx_hybrid.decode import generate_step
from mlx_hybrid.generate import stream_generate
from mlx_hybrid.sampling import SamplingParams
from mlx_hybrid.loader import load, load_model
from mlx_hybrid.speculative import accept
from mlx_hybrid.speculative.accept import Candidates, Draft
from mlx_hybrid.speculative.draft import DraftProposer
from mlx_hybrid.speculative import load_proposer
from mlx_hybrid.speculative.steps import speculative_steps
from mlx_hybrid.speculative.medusa import MedusaConfig, MedusaHeads, MedusaProposer, calibrate, load_medusa
from mlx_hybrid.speculative.redrafter import Drafter, DrafterConfig, ReDrafterProposer, load_redrafter
from mlx_hybrid.speculative.tree import MedusaTree, cartesian_paths

ALPHA = 1e-3
GREEDY = SamplingParams()


def chi_square_pvalue(observed, expected) -> float:
    """P(chi2 >= statistic) with len - 1 degrees of freedom: the regularized upper incomplete
    gamma Q(df / 2, statistic / 2) (torch.special, as scipy is not a dependency)."""
    import torch

    observed, expected = np.asarray(observed, np.float64), np.asarray(expected, np.float64)
    stat = ((observed - expected) ** 2 / expected).sum()
    df = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_hf_model_dir(tmp_path_factory.mktemp("target") / "m", seed=0)
    model, tokenizer = load(path, "float32")
    return path, model, tokenizer


def noisy_copy(model: nn.Module, path, scale: float, seed: int) -> nn.Module:
    """The target with every weight perturbed: a draft that agrees with it often, not always."""
    draft = load_model(path, "float32")
    mx.random.seed(seed)
    draft.update(tree_map(lambda p: p + scale * mx.random.normal(p.shape), draft.parameters()))
    mx.eval(draft.parameters())
    return draft


def lm_head_weight(model) -> mx.array:
    return model.lm_head.weight


def medusa_like_target(model, heads: int = 4, seed: int = 0) -> MedusaHeads:
    """Heads initialized as Medusa does (ResBlocks near zero, LM head = the target's), plus noise:
    each guesses the target's next token, which is right whenever the text repeats itself."""
    H, V = model.args.hidden_size, model.args.vocab_size
    m = MedusaHeads(MedusaConfig(heads, 1, H, V))
    mx.random.seed(seed)
    for head in m.medusa_head:
        head[0].linear.weight = 0.01 * mx.random.normal((H, H))
        head[-1].weight = lm_head_weight(model) + 0.02 * mx.random.normal((V, H))
    mx.eval(m.parameters())
    return m


def drafter_like_target(model, seed: int = 0) -> Drafter:
    """A drafter whose LM head reads the target's LM head off h (plus noise and a little of s)."""
    H, V = model.args.hidden_size, model.args.vocab_size
    d = Drafter(DrafterConfig(H, V, 2 * H, 1, True))
    mx.random.seed(seed)
    d.lm_head[0].linear.weight = 0.01 * mx.random.normal((2 * H, 2 * H))
    d.lm_head[-1].weight = mx.concatenate(
        [lm_head_weight(model) + 0.02 * mx.random.normal((V, H)), 0.05 * mx.random.normal((V, H))], axis=1
    )
    mx.eval(d.parameters())
    return d


def greedy_reference(model, prompt, n):
    tokens, gaps = [], []
    for t, logprobs in generate_step(mx.array(prompt), model, model.make_cache(), lambda x: mx.argmax(x, -1), max_tokens=n):
        top2 = mx.topk(logprobs[0], 2)
        gaps.append(abs(float(top2[0] - top2[1])))
        tokens.append(t)
    return tokens, min(gaps)


def run_steps(model, proposer, prompt, n, sampling=GREEDY):
    tokens, steps, accepted = [], 0, 0
    for new, acc in speculative_steps(model, proposer, prompt, model.make_cache(), sampling):
        tokens += new
        steps, accepted = steps + 1, accepted + acc
        if len(tokens) >= n:
            return tokens[:n], steps, accepted


class OracleProposer:
    """Knows the reference continuation (ref[0]: the first token after the prompt) and hides it in
    a Cartesian Medusa tree: the true tokens fill a random path down to a random depth, every other
    node a token that cannot be accepted. Accepted paths then vary in length and sit anywhere in
    the tree, so cache compaction really moves rows, and the target accepts exactly the true path."""

    name, drafts_on_device = "oracle", False

    def __init__(self, reference: list[int], vocab: int, seed: int, prompt_len: int = 0):
        self.ref, self.vocab, self.prompt_len = reference, vocab, prompt_len
        self.rng = np.random.default_rng(seed)
        self.tree = MedusaTree(cartesian_paths([3, 2, 2]))
        self.depth = 3

    def tokens(self, done: int) -> tuple[np.ndarray, int]:
        """A tree whose root is ref[done], and the depth of its true path."""
        ahead = self.ref[done:] + [None] * self.depth
        depth = int(min(self.rng.integers(0, self.depth + 1), max(0, len(self.ref) - 1 - done)))
        ranks = [self.rng.integers(0, k) for k in self.tree.topk]
        tokens = self.rng.integers(0, self.vocab, len(self.tree))
        tokens[0] = ahead[0]
        for node, path in enumerate(self.tree.paths, start=1):
            true = ahead[len(path)]
            if len(path) <= depth and path == ranks[: len(path)]:
                tokens[node] = true
            elif tokens[node] == true:
                tokens[node] = (true + 1) % self.vocab
        return tokens, depth

    def propose(self, history, hidden, sampling):
        tokens, _ = self.tokens(len(history) - self.prompt_len - 1)
        return Candidates(tokens, self.tree.parents, tree=self.tree.tree)


class OracleDrafts(OracleProposer):
    """The oracle for the greedy loop (`draft`): it knows where each pass leaves the target, the
    end of the true path, without reading the device."""

    drafts_on_device = True

    def __init__(self, reference: list[int], vocab: int, seed: int):
        super().__init__(reference, vocab, seed)
        self.done = 0  # ref[done]: the next pass's root
        self.rows = mx.array(self.tree.retrieve)

    def draft(self, root: mx.array, hidden: mx.array) -> Draft:
        tokens, depth = self.tokens(self.done)
        self.done += depth + 1
        return Draft(mx.array(tokens, mx.int32), self.tree.tree, self.rows)


N_TOKENS = 36


def tie_free_references(model, count: int, n: int = N_TOKENS, seed: int = 0) -> list:
    """count prompts of a seeded random pool whose n-token greedy continuation has no near-tie,
    each with that continuation."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < count:
        prompt = rng.integers(0, model.args.vocab_size, rng.integers(1, 7)).tolist()
        ref, gap = greedy_reference(model, prompt, n)
        if gap > 1e-3:
            out.append((prompt, ref))
    return out


@pytest.fixture(scope="module")
def references(target):
    return tie_free_references(target[1], 8)


def test_greedy_oracle_tree_equals_plain_greedy(target, references):
    _, model, _ = target
    for i, (prompt, ref) in enumerate(references):
        oracle = OracleProposer(ref, model.args.vocab_size, seed=i, prompt_len=len(prompt))
        got, steps, accepted = run_steps(model, oracle, prompt, N_TOKENS)
        assert got == ref, f"prompt {prompt}"
        assert accepted > 10  # deep paths were accepted, not just the root


def test_host_loop_passes_take_the_compiled_route(target, references):
    """The loop for proposers that draft on the host (a draft model; every method at temperature
    > 0) places each pass at the cache's offset, so the pass runs compiled, as greedy passes do,
    and the tokens stay plain greedy decoding's."""
    model = load_model(target[0], "float32")
    for i, (prompt, ref) in enumerate(references[:2]):
        oracle = OracleProposer(ref, model.args.vocab_size, seed=i, prompt_len=len(prompt))
        assert run_steps(model, oracle, prompt, N_TOKENS)[0] == ref
    assert took_compiled_pass(model)


@pytest.mark.parametrize("method", ["medusa", "redrafter", "draft", "hybrid_draft"])
def test_greedy_equals_plain_greedy(target, references, tmp_path_factory, method):
    path, model, _ = target
    if method == "medusa":
        proposer = MedusaProposer(medusa_like_target(model))
    elif method == "redrafter":
        proposer = ReDrafterProposer(drafter_like_target(model), model, beam_width=3, beam_length=4)
    elif method == "draft":
        proposer = DraftProposer(noisy_copy(model, path, 0.01, seed=1), model, k=4)
    else:  # recurrent layers cannot be trimmed: restored from a snapshot, accepted tokens re-read
        draft_dir, _ = make_hybrid_dir(tmp_path_factory.mktemp("hd") / "d", ["attention", "mamba"], seed=5)
        proposer = DraftProposer(load_model(draft_dir, "float32"), model, k=3)
    total_steps = total_tokens = total_accepted = 0
    for prompt, ref in references:
        got, steps, accepted = run_steps(model, proposer, prompt, N_TOKENS)
        assert got == ref, f"{method}, prompt {prompt}"
        total_steps, total_tokens, total_accepted = total_steps + steps, total_tokens + len(got), total_accepted + accepted
    if method != "hybrid_draft":  # random hybrid drafts agree with nothing; the others must
        assert total_accepted > 0.1 * total_steps, f"{method}: too few accepted drafts to test anything"


def test_hybrid_draft_re_reads_only_the_last_step(target, references, tmp_path):
    """A recurrent draft the target keeps rejecting returns each step to its state after the
    target's tokens, so it re-reads that step's accepted drafts and new token (at most k + 1), not
    every token since its last step accepted whole."""
    _, model, _ = target
    draft_dir, _ = make_hybrid_dir(tmp_path / "d", ["attention", "mamba"], seed=5)
    proposer = DraftProposer(load_model(draft_dir, "float32"), model, k=3)
    reads, logits_of = [], proposer._logits
    proposer._logits = lambda x: reads.append(x.shape[0]) or logits_of(x)
    prompt, ref = references[0]
    assert run_steps(model, proposer, prompt, N_TOKENS)[0] == ref
    assert len(reads) > 3 * proposer.k and max(reads) <= proposer.k + 1


@pytest.mark.parametrize("layers", [None, ["attention", "mamba", "mamba2"]])
def test_draft_reads_several_tokens_as_a_plain_forward_does(target, tmp_path, layers):
    """The tokens a draft re-reads after a step (at most k + 1) go in as a chain of tree nodes:
    the logits, and the cache the next token sees, are a plain forward's."""
    path, model, _ = target
    draft = load_model(path if layers is None else make_hybrid_dir(tmp_path / "d", layers, seed=4)[0], "float32")
    proposer = DraftProposer(draft, model, k=2)
    prompt, reread = mx.array([list(range(3, 40))]), [50, 61, 72]
    plain = draft.make_cache()
    draft(prompt, plain)
    draft(prompt, proposer.cache)
    want = draft(mx.array([reread]), plain)[0, -1]
    got = proposer._logits(mx.array(reread))
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4)
    assert [c.offset for c in proposer.cache] == [c.offset for c in plain]
    want, got = draft(mx.array([[5]]), plain)[0, -1], proposer._logits(mx.array([5]))
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4)


def test_rejection_sampling_matches_target_synthetic():
    """Multi-draft rejection on two levels with made-up p and q (vocabulary 5, 3 drafts per
    level): the first token must follow p1, and the second, after an accepted first, p2."""
    rng = np.random.default_rng(0)
    V, width, n = 5, 3, 30000
    p1, q1 = rng.dirichlet(np.ones(V)), rng.dirichlet(np.ones(V))
    p2, q2 = rng.dirichlet(np.ones(V), V), rng.dirichlet(np.ones(V), V)
    firsts, seconds = np.zeros(V), np.zeros((V, V))
    from mlx_hybrid.speculative.tree import pack_beams

    packs = {}  # the packed tree of each draw of beams: a few thousand distinct among the n draws
    for _ in range(n):
        x = rng.choice(V, width, p=q1)
        y = np.array([rng.choice(V, p=q2[a]) for a in x])
        key = (x.tobytes(), y.tobytes())
        if key not in packs:
            packed = pack_beams(np.stack([np.full(width, 9), x, y], axis=1))
            T = packed.count.item()
            packs[key] = np.array(packed.tokens)[:T], packed.tree.parents[:T].tolist(), np.array(packed.node_of)
        tokens, parents, node_of = packs[key]
        T = len(tokens)
        q, p = np.zeros((T, V + 10)), np.zeros((T, V + 10))
        drafts = {}
        for b in range(width):
            for l in range(2):
                drafts.setdefault(int(node_of[b, l]), []).append(int(node_of[b, l + 1]))
        for t in range(T):
            depth = 0 if t == 0 else (1 if parents[t] == 0 else 2)
            tok = tokens[t]
            if depth == 0:
                p[t, :V], q[t, :V] = p1, q1
            elif depth == 1:
                p[t, :V], q[t, :V] = p2[tok], q2[tok]
            else:
                p[t, :V] = 1.0 / V
        path, nxt = accept.rejection(Candidates(tokens.copy(), list(parents), drafts=drafts, q=q), p, rng)
        emitted = [int(tokens[t]) for t in path[1:]] + [nxt]
        firsts[emitted[0]] += 1
        if len(emitted) >= 2:
            seconds[emitted[0], emitted[1]] += 1
    assert chi_square_pvalue(firsts, p1 * n) > ALPHA
    for a in range(V):
        m = seconds[a].sum()
        if m > 500:
            assert chi_square_pvalue(seconds[a], p2[a] * m) > ALPHA, f"second token after {a}"


def exact_joint(model, prompt, sampling):
    """P(first token, second token) under the target's sampling distribution."""
    logits = model(mx.array([prompt]))[0, -1]
    p1 = np.exp(np.array(accept.target_logprobs(logits, sampling), np.float64))
    joint = np.zeros((len(p1), len(p1)))
    for a in np.flatnonzero(p1 > 0):
        logits2 = model(mx.array([prompt + [int(a)]]))[0, -1]
        joint[a] = p1[a] * np.exp(np.array(accept.target_logprobs(logits2, sampling), np.float64))
    return joint


@pytest.mark.parametrize("method", ["draft", "redrafter"])
def test_rejection_sampling_preserves_target_distribution(target, method):
    """The first two tokens of sampled speculative decoding against the target's exact joint
    distribution (top-k 3 keeps it at 9 cells)."""
    path, model, _ = target
    prompt = [5, 17, 60]
    sampling = SamplingParams(temp=1.5, top_k=3)
    joint = exact_joint(model, prompt, sampling)
    if method == "draft":
        proposer = DraftProposer(noisy_copy(model, path, 0.02, seed=2), model, k=2)
    else:
        proposer = ReDrafterProposer(drafter_like_target(model), model, beam_width=3, beam_length=3)
    counts, n, accepted = np.zeros_like(joint), 1500, 0
    for i in range(n):
        mx.random.seed(i)
        s = SamplingParams(temp=1.5, top_k=3, seed=i)
        steps = speculative_steps(model, proposer, prompt, model.make_cache(), s)
        first, _ = next(steps)
        second, acc = next(steps)
        counts[first[0], second[0]] += 1
        accepted += acc > 0
    cells = joint > 0
    assert counts[~cells].sum() == 0
    assert 0.1 * n < accepted < 0.95 * n, f"{accepted} of {n} steps accepted a draft: both branches must be tested"
    assert chi_square_pvalue(counts[cells], joint[cells] * n) > ALPHA


def test_typical_acceptance_rule():
    """Medusa's rule on a hand-made chain: accept while p(candidate) > min(eps, delta exp(-H))."""
    # Node 0's distribution is confident (low entropy), node 1's is flat.
    probs = np.array([[0.85, 0.05, 0.05, 0.05], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]])
    logprobs = mx.array(np.log(probs), mx.float32)
    parents = [-1, 0, 1]
    retrieve = np.array([[0, 1, 2]])
    rng = np.random.default_rng(0)
    # Candidate 1 (token 0, p .85) passes; candidate 2 (p .25 < eps = .3 ... vs delta * exp(-H)):
    # H(flat) = ln 4, delta exp(-H) = 0.5 / 4 = .125 < .25 -> passes with eps .3.
    path, _ = accept.typical(Candidates(np.array([1, 0, 3]), parents), retrieve, logprobs, 0.3, 0.5, rng)
    assert path == [0, 1, 2]
    # With delta 1.2 the threshold at node 1 is min(.3, .3) = .3 > .25: candidate 2 is rejected.
    path, _ = accept.typical(Candidates(np.array([1, 0, 3]), parents), retrieve, logprobs, 0.3, 1.2, rng)
    assert path == [0, 1]
    # A low-probability first candidate stops everything.
    path, _ = accept.typical(Candidates(np.array([1, 2, 3]), parents), retrieve, logprobs, 0.3, 0.5, rng)
    assert path == [0]


def test_medusa_sampling_runs_and_respects_support(target):
    _, model, _ = target
    proposer = MedusaProposer(medusa_like_target(model))
    sampling = SamplingParams(temp=0.7, top_k=5, seed=0)
    tokens, steps, _ = run_steps(model, proposer, [5, 17, 60], 30, sampling)
    assert len(tokens) == 30 and steps <= 30


# ---- the on-disk layout (docs/formats/speculative-heads.md) against PyTorch modules written like the reference code ----


def _torch_medusa(H, V, K, L):
    import torch

    class ResBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(H, H)

        def forward(self, x):
            return x + torch.nn.functional.silu(self.linear(x))

    class Heads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.medusa_head = torch.nn.ModuleList(
                [torch.nn.Sequential(*[ResBlock() for _ in range(L)], torch.nn.Linear(H, V, bias=False)) for _ in range(K)]
            )

    return Heads()


def _torch_drafter(H, V, E, n):
    import torch

    class ResBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(E, E)

        def forward(self, x):
            return x + torch.nn.functional.silu(self.linear(x))

    class Drafter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            if E != 2 * H:
                self.input_proj = torch.nn.Linear(2 * H, E)
            self.lm_head = torch.nn.Sequential(*[ResBlock() for _ in range(n)], torch.nn.Linear(E, V, bias=False))
            self.rnn_u = torch.nn.Linear(H, H, bias=True)
            self.rnn_w = torch.nn.Linear(H, H, bias=False)

        def forward(self, h, state, emb):
            state = torch.nn.functional.silu(self.rnn_w(emb) + self.rnn_u(state))
            x = torch.cat([h, state], dim=-1)
            if hasattr(self, "input_proj"):
                x = self.input_proj(x)
            return self.lm_head(x), state

    return Drafter()


def _save(module, path, config):
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.1)
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))


def test_medusa_layout_matches_pytorch_reference(target, tmp_path, exact_float32):
    import torch

    _, model, _ = target
    H, V = model.args.hidden_size, model.args.vocab_size
    ref = _torch_medusa(H, V, 3, 2)
    config = dict(model_type="medusa", medusa_num_heads=3, medusa_num_layers=2, hidden_size=H, vocab_size=V)
    _save(ref, tmp_path / "medusa", config)
    heads = load_medusa(tmp_path / "medusa", model, "float32")
    assert heads._stacks  # loaded heads run stacked (`fuse`): five rows as matmuls, one as matrix-vector products
    for h in (np.random.default_rng(0).standard_normal((5, H)).astype(np.float32), np.ones((1, H), np.float32)):
        with torch.no_grad():
            want = np.stack([head(torch.from_numpy(h)).numpy() for head in ref.medusa_head])
        np.testing.assert_allclose(np.array(heads(mx.array(h))), want, atol=1e-5)
        np.testing.assert_allclose(np.array(heads(mx.array(h[0]))), want[:, 0], atol=1e-5)


def _tied_medusa_pair(model, tmp_path, K=3, L=2):
    """The same random heads saved twice: with tied_lm_head (ResBlocks only) and in the plain
    layout with a copy of the target's LM head as each head's own (the reference)."""
    from safetensors.numpy import save_file

    H, V = model.args.hidden_size, model.args.vocab_size
    rng = np.random.default_rng(7)
    blocks = {f"medusa_head.{i}.{j}.linear.{p}": rng.normal(0, 0.1, (H, H) if p == "weight" else H).astype(np.float32)
              for i in range(K) for j in range(L) for p in ("weight", "bias")}
    lm = np.array(lm_head_weight(model))
    config = dict(model_type="medusa", medusa_num_heads=K, medusa_num_layers=L, hidden_size=H, vocab_size=V)
    for name, tensors, extra in [("tied", blocks, dict(tied_lm_head=True)),
                                 ("copies", blocks | {f"medusa_head.{i}.{L}.weight": lm for i in range(K)}, {})]:
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
        (tmp_path / name / "config.json").write_text(json.dumps(config | extra))
    return tmp_path / "tied", tmp_path / "copies"


def test_tied_medusa_heads_end_with_the_target_lm_head(target, references, tmp_path, exact_float32):
    """Heads with tied_lm_head give what the same ResBlocks followed by a copy of the target's LM
    head each give, stacked (as loaded) and not, for several rows and one; their greedy
    speculation decodes plain greedy decoding's tokens."""
    _, model, _ = target
    tied_dir, copies_dir = _tied_medusa_pair(model, tmp_path)
    tied, copies = load_medusa(tied_dir, model, "float32"), load_medusa(copies_dir, model, "float32")
    assert tied._stacks and not any(k.endswith(".2.weight") for k, _ in tree_flatten(tied.parameters()))
    unstacked = MedusaHeads(tied.config, model._logits)
    unstacked.update(tied.parameters())
    H = model.args.hidden_size
    for h in (mx.random.normal((5, H), key=mx.random.key(1)), mx.random.normal((H,), key=mx.random.key(2))):
        want = np.array(copies(h))
        np.testing.assert_allclose(np.array(tied(h)), want, atol=1e-5)
        np.testing.assert_allclose(np.array(unstacked(h)), want, atol=1e-5)
    proposer = load_proposer("medusa", model, path=tied_dir)
    for prompt, ref in references[:3]:
        assert run_steps(model, proposer, prompt, N_TOKENS)[0] == ref


def test_tied_medusa_heads_refuse_what_does_not_fit(target, tmp_path):
    _, model, _ = target
    tied_dir, copies_dir = _tied_medusa_pair(model, tmp_path)
    config = json.loads((copies_dir / "config.json").read_text())  # no tied_lm_head
    (tied_dir / "config.json").write_text(json.dumps(config | dict(tied_lm_head="yes")))
    with pytest.raises(HybridError, match="'tied_lm_head' must be true or false, got 'yes'"):
        load_medusa(tied_dir, model)
    (copies_dir / "config.json").write_text(json.dumps(config | dict(tied_lm_head=True)))  # its files hold LM heads too
    with pytest.raises(HybridError, match="medusa_num_layers"):
        load_medusa(copies_dir, model)
    (tied_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(HybridError, match="medusa_num_layers"):  # without the flag its files lack the LM heads
        load_medusa(tied_dir, model)
    (tied_dir / "config.json").write_text(json.dumps(config | dict(tied_lm_head=True)))
    with pytest.raises(HybridError, match="give the target"):
        MedusaProposer(load_medusa(tied_dir, model))


@pytest.mark.parametrize("exit_dim", [None, 48])
def test_redrafter_layout_matches_pytorch_reference(target, tmp_path, exit_dim, exact_float32):
    import torch

    _, model, _ = target
    H, V = model.args.hidden_size, model.args.vocab_size
    E = exit_dim or 2 * H
    ref = _torch_drafter(H, V, E, 2)
    config = dict(model_type="recurrent_drafting_drafter", hidden_size=H, vocab_size=V, exit_dim=E, num_draft_layers=2, rnn=True)
    _save(ref, tmp_path / "redrafter", config)
    drafter = load_redrafter(tmp_path / "redrafter", model, "float32")
    rng = np.random.default_rng(1)
    h, s, e = (rng.standard_normal((3, H)).astype(np.float32) for _ in range(3))
    with torch.no_grad():
        want_logits, want_state = ref(torch.from_numpy(h), torch.from_numpy(s), torch.from_numpy(e))
    state = drafter.step(mx.array(s), mx.array(e))
    np.testing.assert_allclose(np.array(state), want_state.numpy(), atol=1e-5)
    np.testing.assert_allclose(np.array(drafter.logits(mx.array(h), state)), want_logits.numpy(), atol=1e-5)


def test_heads_run_in_the_target_dtype(target, tmp_path):
    """Heads saved in float32 (as train_cuda/ saves them) load in the target's dtype unless asked
    otherwise: a float32 Medusa head set on a half-precision target would read twice the bytes."""
    path, _, _ = target
    half = load_model(path, "bfloat16")
    H, V = half.args.hidden_size, half.args.vocab_size
    _save(_torch_medusa(H, V, 2, 1), tmp_path / "medusa", dict(model_type="medusa", medusa_num_heads=2, medusa_num_layers=1, hidden_size=H, vocab_size=V))
    E = 2 * H
    _save(_torch_drafter(H, V, E, 1), tmp_path / "redrafter",
          dict(model_type="recurrent_drafting_drafter", hidden_size=H, vocab_size=V, exit_dim=E, num_draft_layers=1, rnn=True))
    for module in (load_medusa(tmp_path / "medusa", half), load_redrafter(tmp_path / "redrafter", half)):
        assert {p.dtype for _, p in tree_flatten(module.parameters())} == {mx.bfloat16}
    asked = load_medusa(tmp_path / "medusa", half, "float32")
    assert {p.dtype for _, p in tree_flatten(asked.parameters())} == {mx.float32}
    drafter = load_proposer("redrafter", half, tmp_path, heads_dtype="float32").drafter  # the benchmark's --heads-dtype
    assert {p.dtype for _, p in tree_flatten(drafter.parameters())} == {mx.float32}


def test_bad_heads_directories(target, tmp_path):
    path, model, _ = target
    with pytest.raises(HybridError, match="directory not found"):
        load_medusa(tmp_path / "nope", model)
    bad = tmp_path / "medusa"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(dict(model_type="medusa", medusa_num_heads=2, medusa_num_layers=1, hidden_size=7, vocab_size=model.args.vocab_size)))
    with pytest.raises(HybridError, match="hidden_size is 7"):
        load_medusa(bad, model)
    (bad / "config.json").write_text(json.dumps(dict(model_type="medusa", medusa_num_heads=2)))
    with pytest.raises(HybridError, match="lacks the field"):
        load_medusa(bad, model)
    with pytest.raises(HybridError, match="no medusa/ directory"):
        load_proposer("medusa", model, model_dir=path)
    with pytest.raises(HybridError, match="unknown speculative method"):
        load_proposer("eagle", model, model_dir=path)


def test_calibrate_writes_greedy_tree(target, references, tmp_path):
    _, model, _ = target
    heads = medusa_like_target(model, heads=3)
    d = tmp_path / "medusa"
    d.mkdir()
    mx.save_safetensors(str(d / "model.safetensors"), dict(tree_flatten(heads.parameters())))
    H, V = model.args.hidden_size, model.args.vocab_size
    (d / "config.json").write_text(json.dumps(dict(model_type="medusa", medusa_num_heads=3, medusa_num_layers=1, hidden_size=H, vocab_size=V)))
    result = calibrate(model, d, [p for p, _ in references[:3]], num_nodes=12, new_tokens=24, topk=4)
    acc = np.array(result["head_accuracies"])
    assert acc.shape == (3, 4) and (acc >= 0).all() and (acc.sum(axis=1) <= 1 + 1e-9).all()
    loaded = load_medusa(d, model)
    tree = loaded.default_tree()
    assert len(tree) == 13 and sorted(tree.paths) == sorted(result["medusa_choices"])


def test_speculative_stream_generate_matches_plain(target, exact_float32):
    """Same text, tokens and finish reasons with a speculator as without, stop strings and max
    tokens included; only speculative responses carry the method and steps of several tokens."""
    path, model, tokenizer = target
    proposer = DraftProposer(noisy_copy(model, path, 0.01, seed=3), model, k=3)
    for prompt, kw in [("The quick brown", dict(max_tokens=25)), ("Once upon", dict(max_tokens=40, stop=["o"]))]:
        want = list(stream_generate(model, tokenizer, prompt, **kw))
        got = list(stream_generate(model, tokenizer, prompt, speculator=proposer, **kw))
        assert [r.token for r in got] == [r.token for r in want]
        assert "".join(r.text for r in got) == "".join(r.text for r in want)
        assert got[-1].finish_reason == want[-1].finish_reason
        assert got[-1].method == "draft" and got[-1].steps >= 1 and got[-1].tokens_per_step > 1
        assert want[-1].method is None and want[-1].tokens_per_step == 1 and want[-1].steps == len(want) - 1
    with pytest.raises(HybridError, match="repetition penalty"):
        list(stream_generate(model, tokenizer, "hi", speculator=proposer, sampling=SamplingParams(repetition_penalty=1.1)))


def test_hybrid_target_greedy_equals_plain_greedy(tmp_path):
    """A hybrid target (attention, Mamba, Mamba2, DSLA layers) verifies through the same loop:
    recurrent layers scan the tree from each node's parent and keep the accepted path's state."""
    path, _ = make_hybrid_dir(tmp_path / "h", ["attention", "mamba", "mamba2", "dsla"], seed=2)
    model = load_model(path, "float32")
    references = tie_free_references(model, 4)
    proposers = [
        MedusaProposer(medusa_like_target(model)),
        ReDrafterProposer(drafter_like_target(model), model, beam_width=3, beam_length=4),
        DraftProposer(noisy_copy(model, path, 0.01, seed=1), model, k=4),
    ]
    for i, (prompt, ref) in enumerate(references):
        oracle = OracleProposer(ref, model.args.vocab_size, seed=i, prompt_len=len(prompt))
        for proposer in [oracle] + proposers:
            got, _, accepted = run_steps(model, proposer, prompt, N_TOKENS)
            assert got == ref, f"{type(proposer).__name__}, prompt {prompt}"
            if proposer is oracle:
                assert accepted > 10


def test_greedy_passes_leave_the_caches_at_the_last_pass_yielded(tmp_path):
    """Greedy passes run a pass ahead of the host: when the consumer stops, the caches hold what
    the yielded tokens need (KV offsets and rows, recurrent states), and plain decoding goes on
    exactly."""
    path, _ = make_hybrid_dir(tmp_path / "h", ["attention", "mamba", "mamba2", "dsla"], seed=2)
    model = load_model(path, "float32")
    for i, (prompt, ref) in enumerate(tie_free_references(model, 2)):
        cache = model.make_cache()
        steps = speculative_steps(model, OracleDrafts(ref, model.args.vocab_size, seed=i), prompt, cache, GREEDY)
        tokens, passes = [], 0
        for new, _ in steps:
            tokens, passes = tokens + new, passes + 1
            if len(tokens) >= 20:
                break
        steps.close()
        assert passes < len(tokens) - 5  # deep paths were accepted
        assert [c.offset for c in cache] == [len(prompt) + len(tokens) - 1] * len(cache)
        while len(tokens) < N_TOKENS:
            tokens.append(int(mx.argmax(model(mx.array([tokens[-1:]]), cache)[0, -1]).item()))
        assert tokens == ref, f"prompt {prompt}"


def emulate_gpu_kernels(monkeypatch):
    """Send the model code down its GPU path, every kernel run by its CUDA body on the CPU
    (tests/helpers/cuda_emulator.py), drafts uncompiled (the emulator needs real arrays) and packed beams
    kept at their padded size, as on a GPU."""
    from mlx_hybrid import dsla_step, scan, tree_attention
    from mlx_hybrid.models import hybrid
    from mlx_hybrid.speculative import redrafter, topk, tree, verify

    for module in (scan, dsla_step, tree_attention, accept, tree, topk):
        monkeypatch.setattr(module, "load_kernel", cuda_emulator.load_kernel)
    for module in (scan, tree_attention, hybrid, accept, tree, topk, verify):
        monkeypatch.setattr(module, "kernel_backend", lambda: "cuda")
    monkeypatch.setattr(redrafter, "trims_padding", lambda: False)
    mx.disable_compile()


@pytest.mark.skipif(not cuda_emulator.AVAILABLE, reason="g++ not found: the CUDA bodies cannot be run on the CPU")
@pytest.mark.parametrize("kind,method", [("llama", "medusa"), ("llama", "redrafter"), ("hybrid", "redrafter")])
def test_greedy_on_emulated_gpu_kernels_equals_plain_greedy(target, tmp_path, monkeypatch, kind, method):
    """The GPU path end to end, on any machine: tree attention, the tree `ssm_step`, `beam_topk_*`,
    `pack_beams` and `greedy_accept` all run as kernels (emulated), on a Llama and on a hybrid
    target (attention, Mamba, Mamba2); the tokens must be plain greedy decoding's."""
    if kind == "llama":
        model = target[1]
    else:
        model = load_model(make_hybrid_dir(tmp_path / "h", ["attention", "mamba", "mamba2"], seed=3)[0], "float32")
    references = tie_free_references(model, 2, n=14, seed=1)
    if method == "medusa":
        proposer = MedusaProposer(medusa_like_target(model), MedusaTree(cartesian_paths([2, 2, 1])))
    else:
        proposer = ReDrafterProposer(drafter_like_target(model), model, beam_width=3, beam_length=4)
    emulate_gpu_kernels(monkeypatch)
    try:
        for prompt, ref in references:
            got, steps, _ = run_steps(model, proposer, prompt, 14)
            assert got == ref, f"{kind} {method}, prompt {prompt}"
        assert took_compiled_pass(model)  # the passes took the compiled route (run uncompiled here)
    finally:
        mx.enable_compile()
