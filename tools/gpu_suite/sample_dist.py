"""Exact speculative sampling on the device keeps the target's distribution (python3 tools/gpu.py sample_dist).

The graphs that sample on the device (``decode_sample``, ``verify_mtp_sample_k{k}``: the host
reads only token ids) are run through the runtime's entry points by a small loop of their own
(``continuations``: the graphs the Session's device steps run, without its scheduling), on a tiny model of 32 tokens
whose head agrees with the target about half of the time. Checks, each a chi-square test whose
false alarms over the whole run are at most 1e-3 (Bonferroni):

(1) acceptance: the acceptance alone, as ONNX ops (converter/sampling_graph.py) and as the
    portable graphs' ai.ortspec ops, over --samples rows of fixed p_0..p_k and q_1..q_k, k = 1..3:
    the emitted e_i, given a >= i, follows p_i for every i; and two planted wrong rules (accept
    with min(1, q/p); emit from p instead of the residual) are rejected;
(2) greedy rows: in a batch where every other row samples, the greedy rows' tokens are the greedy
    graphs' (decode, verify_mtp_k{k}), k = 0..3;
(3) model: per sampling configuration (temperature / top-k / top-p / min-p), --samples
    continuations of one prompt (prefilled once, forked into every row: StateSet.fork) at k = 0
    (decode_sample) and k = 1..3 (verify_mtp_sample_k{k}): the joint distribution of their first
    5 tokens agrees with k = 0's (two-sample test); a model converted with the planted rule
    min(1, q/p) (its portable graphs in ONNX ops: planted_rule) is rejected at k = 3;
(4) neighbours: through a batcher, seeded requests without top-k / top-p draw the same tokens
    alone as beside a row with top-p, k = 0 and 2.

Prints one line per check; exits 1 if one failed. tests/test_device_sampling.py runs the same
logic on the CPU with small counts.
"""

from __future__ import annotations

import collections
import contextlib
from pathlib import Path

import numpy as np

import ortspec
from ortspec.converter import sampling_graph
from ortspec.manifest import Manifest
from ortspec.runtime import custom_ops
from ortspec.runtime.graphs import GraphSet
from ortspec.runtime.model import MTPHead, TargetModel
from ortspec.runtime.sampling_inputs import SamplingInputs
from ortspec.runtime.states import Rows
from ortspec.speculative import sampling
from tools.make_tiny_checkpoint import make_checkpoint

from .common import Checks, write_json

SUMMARY = "exact speculative sampling on the device: chi-square tests of its distributions, planted rules caught"
ALPHA = 1e-3  # the chance that a correct sampler fails one run of the checks, at most
PROMPT = [3, 5]
NEW_TOKENS = 5
MIN_CELL = 10  # cells with fewer samples in both runs together are pooled (each expected count >= 5)
CONFIGS = (dict(temperature=4.0, top_k=8, top_p=0.95), dict(temperature=1.0), dict(temperature=2.0, top_p=0.8),
           dict(temperature=1.5, top_k=4), dict(temperature=3.0, min_p=0.05))


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="/tmp/ortspec_sample_dist", help="working directory (converted models)")
    parser.add_argument("--samples", type=int, default=20_000, help="continuations (or acceptance rows) per test")
    parser.add_argument("--provider", default="cuda", help="cuda or cpu")
    parser.add_argument("--parts", default="acceptance,greedy,model,planted,neighbours",
                        help="which checks run: acceptance (1), greedy (2), model (3), planted (3's planted model), "
                             "neighbours (4)")
    parser.add_argument("--configs", default=",".join(str(i) for i in range(len(CONFIGS))),
                        help="comma-separated indices of CONFIGS that (3) runs (a visit may split them; the "
                             "per-test bound counts them all)")


def run(args) -> int:
    checks, results = Checks(), {}
    out = Path(args.out)
    comparisons = 3 * len(CONFIGS) + 2 + 2 * (2 + 3 + 4)  # (3): k = 1..3 per config; (1): e_0..e_k, k = 1..3, twice
    alpha = ALPHA / comparisons
    parts = set(args.parts.split(","))
    for native, k in ([(n, k) for n in (False, True) for k in (1, 2, 3)] if "acceptance" in parts else ()):
        values = acceptance_p_values(args.samples, k, seed=k + 10 * native, provider=args.provider, native=native)
        label = f"acceptance{' (ai.ortspec ops)' if native else ''} k={k}"
        results[label] = values
        print(f"{label}: p-values of e_i | a >= i against p_i: {[f'{v:.3g}' for v in values]}", flush=True)
        checks.record(label, min(values) > alpha, values)
    for name, planted in (PLANTED.items() if "acceptance" in parts else ()):
        with planted_rule(planted):
            value = acceptance_p_values(args.samples, 3, seed=7, provider=args.provider)[0]
        print(f"planted {name}: p-value of e_0 {value:.3g} (must be < {alpha:.2g})", flush=True)
        checks.record(f"planted {name}", value < alpha, value)
    model = distribution_model(out / "model")
    for k in ((0, 1, 2, 3) if "greedy" in parts else ()):
        same = greedy_rows_match(model, k, provider=args.provider)
        print(f"greedy rows beside sampled ones, k={k}: the greedy graphs' tokens: {same}", flush=True)
        checks.record(f"greedy rows k={k}", same)
    for config in ([CONFIGS[int(i)] for i in args.configs.split(",")] if "model" in parts else ()):
        plain = continuations(model, 0, args.samples, config, seed=100, provider=args.provider)
        for k in (1, 2, 3):
            value = homogeneity_p_value(plain, continuations(model, k, args.samples, config, seed=100 + k,
                                                             provider=args.provider))
            label = f"{config} k={k} vs k=0"
            print(f"{label}: p = {value:.3g}", flush=True)
            checks.record(label, value > alpha, value)
    if "planted" in parts:
        with planted_rule(PLANTED["accept min(1, q/p)"]):
            planted = distribution_model(out / "planted")
        config = CONFIGS[0]
        value = homogeneity_p_value(continuations(model, 0, args.samples, config, seed=300, provider=args.provider),
                                    continuations(planted, 3, args.samples, config, seed=301, provider=args.provider))
        print(f"planted model, accept min(1, q/p), k=3 vs k=0: p = {value:.3g} (must be < {alpha:.2g})")
        checks.record("planted model", value < alpha, value)
    for k in ((0, 2) if "neighbours" in parts else ()):
        same = alone_as_beside_a_top_p_row(model, k, args.provider)
        print(f"neighbours, k={k}: tokens alone equal tokens beside a top-p row: {same}", flush=True)
        checks.record(f"neighbours k={k}", same)
    write_json(args.json, {"checks": checks.results, "alpha_per_test": alpha, "samples": args.samples})
    return checks.exit_status()


# -- (1) the acceptance graph alone --------------------------------------------------------------

PLANTED = {
    "accept min(1, q/p)": ("accept_drafts", lambda g, u, p, q: g.op("Less", [g.op("Mul", [u, p]), q])),
    "emit from p": ("residual_weights", lambda g, p_row, q_row: g.op("Identity", [p_row])),
}


@contextlib.contextmanager
def planted_rule(planted):
    """converter/sampling_graph.py with one of its acceptance functions replaced (PLANTED), for
    the graphs built inside the block; the portable graphs then take those functions too (SORT
    where they would call ortspec's ops, whose rule is C++)."""
    name, rule = planted
    original, method_for = getattr(sampling_graph, name), sampling_graph.method_for
    setattr(sampling_graph, name, rule)
    sampling_graph.method_for = lambda g: sampling_graph.SORT if method_for(g) == sampling_graph.NATIVE else method_for(g)
    try:
        yield
    finally:
        setattr(sampling_graph, name, original)
        sampling_graph.method_for = method_for


def acceptance_session(vocab: int, k: int, provider: str, native: bool = False):
    """The acceptance alone: p [B, k+1, V], q [B, k, V], drafts [B, k], u [B, k+1] -> accepted [B],
    emitted [B]: make_speculative_acceptance (the ONNX ops over p), or (native) the portable
    graphs' ai.ortspec.TransformRows and SpeculativeAccept over logits log p at temperature 1."""
    import onnxruntime as ort
    from onnx import TensorProto

    from ortspec.converter.builder import ORTSPEC_DOMAIN, GraphBuilder, WeightStore

    F32, I64 = TensorProto.FLOAT, TensorProto.INT64
    g = GraphBuilder("acceptance", WeightStore())
    p, q = g.input("p", F32, ["B", k + 1, vocab]), g.input("q", F32, ["B", k, vocab])
    drafts, u = g.input("drafts", I64, ["B", k]), g.input("u", F32, ["B", k + 1])
    if native:
        logits, ones = g.op("Log", [p]), g.input("ones", F32, ["B"])
        zeros, none = g.input("zeros", F32, ["B"]), g.input("none", I64, ["B"])
        stats = g.op("TransformRows", [logits, ones, none, ones, zeros], domain=ORTSPEC_DOMAIN)
        accepted, emitted = g.op("SpeculativeAccept", [logits, stats, drafts, q, ones, zeros, u, none, none],
                                 domain=ORTSPEC_DOMAIN, num_outputs=2)
    else:
        accepted, emitted = sampling_graph.make_speculative_acceptance(g, p, q, drafts, u, k, vocab)
    g.output(accepted, "accepted", I64, ["B"])
    g.output(emitted, "emitted", I64, ["B"])
    providers = ["CUDAExecutionProvider"] if provider == "cuda" else ["CPUExecutionProvider"]
    return ort.InferenceSession(g.build({}).SerializeToString(), custom_ops.session_options(), providers=providers)


def acceptance_rows(samples: int, k: int, seed: int, vocab: int = 6) -> dict:
    """One batch of the acceptance graph's inputs: fixed p_0..p_k and q_1..q_k (Dirichlet, shared by
    every row), drafts drawn from q, fresh uniforms per row."""
    rng = np.random.default_rng(seed)
    p, q = rng.dirichlet(np.ones(vocab), k + 1), rng.dirichlet(np.ones(vocab), k)
    drafts = np.stack([sampling.draw(np.broadcast_to(q[i], (samples, vocab)), rng.random(samples))
                       for i in range(k)], axis=1)  # [B, k]
    return {"p": np.broadcast_to(p, (samples, k + 1, vocab)).astype(np.float32),
            "q": np.broadcast_to(q, (samples, k, vocab)).astype(np.float32), "drafts": drafts,
            "u": rng.random((samples, k + 1), dtype=np.float32)}


def acceptance_p_values(samples: int, k: int, seed: int, provider: str = "cpu", native: bool = False) -> list[float]:
    """Goodness-of-fit p-values of e_i given a >= i against p_i, i = 0..k (e_i = d_{i+1} for i < a,
    the emitted token at i = a; exact speculative sampling makes each follow p_i)."""
    feeds = acceptance_rows(samples, k, seed)
    if native:
        feeds.update(ones=np.ones(samples, np.float32), zeros=np.zeros(samples, np.float32),
                     none=np.zeros(samples, np.int64))
    accepted, emitted = acceptance_session(feeds["p"].shape[2], k, provider, native).run(None, feeds)
    tokens = np.concatenate([feeds["drafts"], np.zeros((samples, 1), np.int64)], axis=1)  # [B, k+1]: d_1..d_k, pad
    tokens[np.arange(samples), accepted] = emitted
    values = []
    for i in range(k + 1):
        reached = accepted >= i
        counts = np.bincount(tokens[reached, i], minlength=feeds["p"].shape[2])
        values.append(fit_p_value(counts, feeds["p"][0, i].astype(np.float64)))
    return values


# -- (2) the model's continuations ---------------------------------------------------------------

def distribution_model(out: Path) -> Path:
    """Vocabulary 32, hidden 32, two layers, K = 3, max_length 32: a forward of 20,000 rows costs
    milliseconds; the head's drafts agree with the target about half of the time."""
    make_checkpoint(out.parent / f"{out.name}_ck", seed=5, vocab_size=32, hidden_size=32, intermediate_size=64,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=1,
                    linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                    layer_types=("linear_attention", "full_attention"), draft_agreement=10.0)
    return ortspec.convert(out.parent / f"{out.name}_ck", out, num_speculative_tokens=3, max_length=32,
                           overwrite=True, progress=False)


def continuations(model: Path, k: int, samples: int, config: dict, seed: int, provider: str = "cpu",
                  prompt=PROMPT, new_tokens: int = NEW_TOKENS, sampled: bool = True) -> list[list[int]]:
    """``samples`` sampled continuations of one prompt, new_tokens each: the prompt prefilled once
    in row 0 and forked into every row; the first token drawn on the host from the prefill's
    logits (speculative.sampling), every later one by decode_sample (k = 0) or
    verify_mtp_sample_k{k}, committed as the fused greedy step commits. A row done keeps
    stepping (parked at the last position k + 1 tokens fit), its tokens dropped. config's values
    are one per configuration or one per row (temperature 0: a greedy row). sampled=False: the
    greedy graphs (decode, verify_mtp_k{k}) instead, every row greedy."""
    graphs = GraphSet(Manifest.load(model), provider=provider)
    target, rows = TargetModel(graphs, samples), Rows(range(samples))
    head = MTPHead(graphs, samples, k) if k else None
    rng = np.random.default_rng(seed)
    first, hidden = _prefill_and_fork(target, rows, prompt, config, rng)
    tokens = [[int(t)] for t in first]
    n, last_start = len(prompt), graphs.manifest.max_length - k - 1
    T, pending = np.full(samples, n, np.int64), first
    if head is not None:
        next_ids = np.concatenate([np.tile(prompt[1:], (samples, 1)), first[:, None]], axis=1)  # [B, n]
        positions = np.tile(np.arange(n), (samples, 1))
        drafts, _ = head.catch_up_sampled(rows, np.repeat(hidden, samples, axis=0), next_ids, positions,
                                          np.full(samples, n - 1, np.int64), k, _inputs(config, samples, k, rng),
                                          graphed=False, on_device=True)
    while min(map(len, tokens)) < new_tokens:
        live = np.array([len(t) < new_tokens for t in tokens])
        T = np.where(live, T, np.minimum(T, last_start))
        if head is None:
            out = (target.decode_sampled(rows, pending[:, None], T[:, None], _inputs(config, samples, 1, rng))
                   if sampled else target.decode(rows, pending[:, None], T[:, None]))
            emitted, accepted = out.tokens, np.zeros(samples, np.int64)  # [B, 1], [B]
        else:
            positions = T[:, None] + np.arange(k + 1)
            ids = np.concatenate([pending[:, None], drafts], axis=1)
            out, accepted, drafts = (
                target.verify_with_head_sampled(rows, ids, positions, head, _inputs(config, samples, 2 * k + 1, rng))
                if sampled else target.verify_with_head(rows, ids, positions, head))
            target.select(out, rows, positions, accepted)
            head.write_entries(out, rows, positions, accepted)
            emitted = out.tokens  # [B, k+1]: e_0..e_k, e_i for i <= a emitted
        for j in np.flatnonzero(live):
            tokens[j].extend(int(t) for t in emitted[j, : accepted[j] + 1])
        T, pending = T + accepted + 1, emitted[np.arange(samples), accepted]
    return [t[:new_tokens] for t in tokens]


def alone_as_beside_a_top_p_row(model: Path, k: int, provider: str = "cpu", seeds=range(8)) -> bool:
    """(4) every seed's tokens alone equal its tokens beside a top-p row."""
    session = ortspec.Session(model, provider=provider, num_speculative_tokens=k)
    same, options = True, dict(max_new_tokens=24, stop_tokens=[])
    with session.batcher(max_batch_size=2) as batcher:
        for seed in seeds:
            plain = dict(temperature=1.5, seed=seed, min_p=0.02 if seed % 2 else 0.0, **options)
            alone = batcher.add_request(PROMPT, **plain)
            while batcher.pending:
                batcher.step()
            beside = batcher.add_requests([dict(prompt=PROMPT, **plain),
                                           dict(prompt=PROMPT, temperature=1.5, top_p=0.7, seed=99, **options)])
            while batcher.pending:
                batcher.step()
            same &= batcher.result(alone) == batcher.result(beside[0])
            for rid in [alone, *beside]:
                batcher.forget(rid)
    session.close()
    return same


def greedy_rows_match(model: Path, k: int, rows: int = 16, provider: str = "cpu") -> bool:
    """Rows 0, 2, 4, ... greedy and the others sampling: the greedy rows' continuations are the
    greedy graphs' continuation of the same prompt, token for token."""
    config = dict(CONFIGS[0], temperature=np.where(np.arange(rows) % 2, CONFIGS[0]["temperature"], 0.0))
    mixed = continuations(model, k, rows, config, seed=1, provider=provider, new_tokens=12)
    greedy = continuations(model, k, 1, {"temperature": 0.0}, seed=1, provider=provider, new_tokens=12, sampled=False)
    return all(tokens == greedy[0] for tokens in mixed[::2])


def _prefill_and_fork(target: TargetModel, rows: Rows, prompt, config: dict, rng):
    """The prompt prefilled in row 0, its states forked into every other row; each row's first
    token drawn from the prefill's last logits. Returns (first tokens [B], the prefill's hiddens
    [1, n, H], host)."""
    n, samples = len(prompt), len(rows)
    target.reset(rows)
    out = target.prefill(Rows([0]), np.array([prompt], np.int64), np.arange(n, dtype=np.int64)[None])
    target.fork(0, Rows(range(1, samples)))
    logits = out.logits(np.array([out.tokens.shape[1] - 1]))  # [1, V]: the prompt's last row
    temperature, top_k, top_p, min_p = _params(config, samples)
    greedy = temperature == 0
    probs = sampling.transform(np.repeat(logits, samples, axis=0), np.where(greedy, 1.0, temperature), top_k,
                               top_p.astype(np.float64), min_p.astype(np.float64))  # [B, V]
    first = np.where(greedy, logits.argmax(axis=1), sampling.draw(probs, rng.random(samples)))
    return first, target.graphs.arrays.download(out["hidden"])


def _params(config: dict, rows: int) -> tuple:
    """(temperature, top_k, top_p, min_p) [rows] of one configuration (a value, or one per row)."""
    fields = (("temperature", 1.0, np.float32), ("top_k", 0, np.int64), ("top_p", 1.0, np.float32),
              ("min_p", 0.0, np.float32))
    return tuple(np.broadcast_to(np.asarray(config.get(name, default), dtype), (rows,)).copy()
                 for name, default, dtype in fields)


def _inputs(config: dict, rows: int, draws: int, rng) -> SamplingInputs:
    return SamplingInputs(*_params(config, rows), rng.random((rows, draws), dtype=np.float32))


# -- statistics -------------------------------------------------------------------------------------

def chi_square_survival(statistic: float, dof: int) -> float:
    import torch

    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def fit_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit of counts [V] to probs [V]: tokens of expected count < 5 pooled."""
    expected = probs * counts.sum()
    rare = expected < 5
    observed = np.append(counts[~rare], counts[rare].sum())
    expected = np.append(expected[~rare], expected[rare].sum())
    keep = expected > 0
    statistic = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return chi_square_survival(statistic, int(keep.sum()) - 1)


def homogeneity_p_value(a: list[list[int]], b: list[list[int]]) -> float:
    """Two-sample chi-square test that two samples of token sequences share one distribution:
    cells are the distinct sequences, those under MIN_CELL in both together pooled into one."""
    count_a, count_b = collections.Counter(map(tuple, a)), collections.Counter(map(tuple, b))
    cells = set(count_a) | set(count_b)
    rare = [c for c in cells if count_a[c] + count_b[c] < MIN_CELL]
    table = np.array([[count_a[c], count_b[c]] for c in cells - set(rare)]
                     + [[sum(count_a[c] for c in rare), sum(count_b[c] for c in rare)]], float)
    table = table[table.sum(axis=1) > 0]  # [cells, 2]
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    statistic = float(((table - expected) ** 2 / expected).sum())
    return chi_square_survival(statistic, len(table) - 1)
