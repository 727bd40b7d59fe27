"""LARGE with drafts that agree with the target at a set rate: what speculation gains when the
step costs what it does at 1B and acceptance is a real model's (issue 11; tools/gpu.py agree).

With random weights LARGE's MTP head almost never drafts the target's next token, so its
speculative runs show only a step's cost. Here the drafts are scripted
(ortspec.speculative.drafts.ScriptedDrafts): draft i is the target's own greedy token with
probability --p (0.8: the per-position agreement published for Qwen3.5's MTP heads), else that
token + 1, each draw independent. The MTP head still runs every catch-up as in production, so a
step costs what it would with a trained head; only the proposed ids are replaced. The truth is
an oracle: plain greedy over each prompt at the same batch size (fp16 greedy at batch 16 may
differ from batch 1), --new-tokens + K tokens long (K: the conversion's largest k) so the
last step's drafts have it too.

Order: LARGE (or with --preset qwen35-0.8b a random model of Qwen3.5-0.8B's shape, vocabulary
248,320: its draft head's lm_head is a third of a decode's weights) built and converted as
`scale` builds it (scale.build_large; or --model DIR), one
Session per k (greedy and --ks), the held-out prompts of exact_prompts.token_prompts, the
oracles, a warm-up call per (k, batch), then --rounds rounds, each running every (k, batch) as
generate calls of `batch` prompts, in an order rotated every round. Per (k, batch): tokens/s
(median of the rounds), speed-up over greedy (median of the rounds' paired ratios), tokens per
step measured and expected ((1 - p^(k+1)) / (1 - p)) with the z-score between them, efficiency
= speed-up / measured tokens per step (issue 11's targets: >= 0.85 at batch 1, >= 0.75 at batch
16), ms per step by phase (Session stats: propose / verify / commit, or decode for greedy) and
the requests whose output differs from greedy. JSON with --json; the table last.

Exit status 1: an output differing from greedy where ortspec guarantees identity (the CPU,
float32); acceptance off the script (|z| > 5 while every output equals greedy: the drafts
were not the scripted ones); CUDA-graph fallbacks or invalidations. In float16/bfloat16 a
differing request is reported, not failed (the default mode's tokens may depend on how many
rows a product has: README); its drafts lose their truth after the difference, which its
row's tokens per step and z-score then show.

--budget-s counts from the start (build included); a round starts only while the time spent
plus the last round's fits in it. Estimated from BENCHMARKS.md's LARGE step times (H200, fp16;
not yet run there): build + convert ~25 s, five Sessions and the oracles ~30-60 s, one round of
the defaults (16 prompts x 128 tokens, batch 1 and 16, k = 0..4) ~20 s, so the defaults need
about 2-2.5 minutes; --preset qwen35-0.8b adds ~15 s to write its checkpoint
(tools/stream_checkpoint.py) and its conversion (~1 minute on a 2-core CPU). --provider cpu --model TINY_DIR runs the same logic on the CPU
(tests/test_gpu_tools.py).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from pathlib import Path

import ortspec
from ortspec.bench import scripted_drafts
from ortspec.cli import parse_draft_vocab
from ortspec.errors import OrtspecError
from ortspec.speculative.stats import PHASES

from .common import STREAMED, Budget, Checks, graph_faults, markdown_table, write_json
from .exact_prompts import token_prompts
from .scale import build_large

SUMMARY = "LARGE with drafts right with probability p (0.8): speed-up, tokens/step and efficiency, k=1..4, batch 1/16"
TARGETS = {1: 0.85, 16: 0.75}  # issue 11: efficiency (speed-up / tokens per step) at batch 1 and 16
MAX_Z = 5.0  # tokens per step this many standard errors from the script's expectation: not the script
AUTO = "auto"  # num_speculative_tokens="auto": a row once Session takes it (the lead's work); refused until then
COUNTERS = ("steps", "decode_steps", "speculative_steps", "speculative_row_steps", "drafted", "accepted")


def _ks(text: str) -> list:
    return [AUTO if x == AUTO else int(x) for x in text.split(",")]


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="a converted model directory (default: build --preset in --out)")
    parser.add_argument("--preset", choices=["large", *STREAMED], default="large",
                        help="the random model built when --model is not given: LARGE (1.0B, vocabulary 32,768) or "
                             "qwen35-0.8b (Qwen3.5-0.8B's shape: 24 layers, vocabulary 248,320; tools/stream_checkpoint.py)")
    parser.add_argument("--draft-vocab", type=parse_draft_vocab, default="auto",
                        help="convert --draft-vocab for the model built: auto (32768 tokens for qwen35-0.8b, none for "
                             "LARGE), N, or 0 for the full-vocabulary draft head")
    parser.add_argument("--out", default="/tmp/ortspec_gpu_agree", help="working directory (LARGE's checkpoint "
                                                                         "and conversion)")
    parser.add_argument("--provider", choices=["cuda", "cpu"], default="cuda", help="cpu: the logic, tiny sizes")
    parser.add_argument("--p", type=float, default=0.8, help="probability that each draft is the target's token")
    parser.add_argument("--ks", type=_ks, default=[1, 2, 3, 4],
                        help=f"speculative k values; '{AUTO}' adds num_speculative_tokens='{AUTO}' where "
                             "Session takes it (a refused row until then)")
    parser.add_argument("--batches", type=lambda t: [int(x) for x in t.split(",")], default=[1, 16],
                        help="batch sizes (each must divide --prompts)")
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts (token ids for LARGE)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (each runs every (k, batch))")
    parser.add_argument("--commit", choices=["select", "readvance"], default="select", help="the commit strategy")
    parser.add_argument("--budget-s", type=float, default=200, help="start no round that would end past this "
                                                                    "many seconds from the start (0: no limit)")


@dataclasses.dataclass
class Tally:
    """What the rounds measured for one (k, batch): tokens/s per round, the Session's counters
    and phase seconds summed over the rounds, and requests whose output differs from greedy."""

    rates: list = dataclasses.field(default_factory=list)
    counters: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    seconds: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    requests: int = 0
    differ: int = 0

    def add(self, tokens: int, seconds: float, stats: dict, outputs, greedy) -> None:
        self.rates.append(tokens / seconds)
        for name in COUNTERS:
            self.counters[name] += stats[name]
        for phase in PHASES:
            self.seconds[phase] += stats["seconds"][phase]
        self.requests += len(outputs)
        self.differ += sum(o != g for o, g in zip(outputs, greedy))


def run(args) -> int:
    check_arguments(args)
    budget, clock = Budget(args.budget_s), {}
    model = Path(args.model) if args.model else timed(clock, "build", build_large, Path(args.out), "float16",
                                                      args.preset, args.draft_vocab)
    sessions, refused = timed(clock, "sessions", open_sessions, model, args)
    prompts = token_prompts(sessions[0], args.prompts)
    oracles = timed(clock, "oracles", lambda: {b: greedy_oracle(sessions[0], prompts, b, args) for b in args.batches})
    timed(clock, "warm_up", warm_up, sessions, prompts, args.batches)
    tallies, clock["rounds"] = run_rounds(sessions, prompts, oracles, args, budget)
    clock["total"] = budget.elapsed()
    rows = [summarize(key, tally, tallies[(0, key[1])], args.p) for key, tally in tallies.items()]
    checks = check_rows(rows, sessions, args.provider == "cpu" or sessions[0].manifest.dtype == "float32")
    results = {"settings": {k: v for k, v in vars(args).items() if k != "run"}, "model": str(model),
               "dtype": sessions[0].manifest.dtype, "seconds": clock, "rows": rows, "refused": refused,
               "checks": checks.results}
    write_json(args.json, results)
    status = checks.exit_status()
    report(results)
    return status


def check_arguments(args) -> None:
    if not 0 <= args.p <= 1 or args.prompts < 1 or args.new_tokens < 1 or args.rounds < 1:
        raise SystemExit("--p must be in [0, 1]; --prompts, --new-tokens and --rounds must be >= 1")
    if any(b < 1 or args.prompts % b for b in args.batches):
        raise SystemExit(f"every batch size must divide --prompts {args.prompts} (got --batches {args.batches})")


def timed(clock: dict, name: str, work, *arguments):
    """work(*arguments), its wall seconds kept in clock[name] (printed as it goes)."""
    start = time.perf_counter()
    result = work(*arguments)
    clock[name] = time.perf_counter() - start
    print(f"{name}: {clock[name]:.1f} s", flush=True)
    return result


def open_sessions(model: Path, args) -> tuple[dict, dict]:
    """({k: Session} for greedy (0) and --ks, {k: why a Session refused it}): a k this Session
    does not take (e.g. 'auto' before it exists) is left out with the reason, not fatal."""
    sessions, refused = {}, {}
    for k in [0, *args.ks]:
        try:
            sessions[k] = ortspec.Session(model, provider=args.provider, num_speculative_tokens=k, commit=args.commit)
        except OrtspecError as error:
            refused[str(k)] = f"{type(error).__name__}: {error}"
    return sessions, refused


def groups(prompts: list, batch: int) -> list[list]:
    return [prompts[i: i + batch] for i in range(0, len(prompts), batch)]


def greedy_oracle(greedy, prompts, batch: int, args) -> list[list[int]]:
    """Per prompt: prompt + its plain-greedy continuation at this batch size, new_tokens + K
    tokens long (K: the conversion's largest k; a request's last step drafts up to k - 1 tokens
    past its end)."""
    longest = greedy.manifest.num_speculative_tokens
    outputs = [out for group in groups(prompts, batch)
               for out in greedy.generate(group, max_new_tokens=args.new_tokens + longest, stop_tokens=[])]
    return [list(p) + out for p, out in zip(prompts, outputs)]


def warm_up(sessions: dict, prompts, batches) -> None:
    """A short call per (k, batch): sessions initialised and CUDA graphs captured before timing."""
    for session in sessions.values():
        for b in batches:
            session.generate(prompts[:b], max_new_tokens=8, stop_tokens=[])


def run_cell(session, prompts, oracle, batch: int, args, seed: int) -> tuple[list[list[int]], float, dict]:
    """One (k, batch) of a round: generate calls of `batch` prompts (k > 0: scripted drafts)
    -> (outputs, seconds inside generate, the Session's stats for these calls)."""
    session.reset_stats()
    outputs, seconds, vocab = [], 0.0, session.manifest.spec.vocab_size
    for g, (group, truths) in enumerate(zip(groups(prompts, batch), groups(oracle, batch))):
        options = {} if session.k == 0 else {"make_drafts": scripted_drafts(truths, vocab, args.p, seed + g)}
        start = time.perf_counter()
        outputs += session.generate(group, max_new_tokens=args.new_tokens, stop_tokens=[], **options)
        seconds += time.perf_counter() - start
    return outputs, seconds, session.stats


def run_rounds(sessions, prompts, oracles, args, budget: Budget) -> tuple[dict, float]:
    """Every (k, batch) once per round, the order rotated each round; stops before a round that
    would pass the budget. -> ({(k, batch): Tally}, seconds)."""
    cells = [(k, b) for b in args.batches for k in sessions]
    tallies, start, last = {cell: Tally() for cell in cells}, budget.elapsed(), 0.0
    for r in range(args.rounds):
        if budget.spent(reserve=last):
            print(f"--budget-s {args.budget_s}: stopped after {r} rounds", flush=True)
            break
        began = budget.elapsed()
        for k, b in cells[r % len(cells):] + cells[: r % len(cells)]:
            greedy = [o[len(p): len(p) + args.new_tokens] for p, o in zip(prompts, oracles[b])]
            outputs, seconds, stats = run_cell(sessions[k], prompts, oracles[b], b, args, seed=1000 * r)
            tallies[(k, b)].add(len(prompts) * args.new_tokens, seconds, stats, outputs, greedy)
        last = budget.elapsed() - began
        print(f"round {r + 1}: {last:.1f} s", flush=True)
    return tallies, budget.elapsed() - start


def expected_tokens_per_step(p: float, k: int) -> float:
    """E[a + 1] when draft i is right with probability p independently and a is the first wrong
    one: sum_{i=0..k} p^i = (1 - p^(k+1)) / (1 - p)."""
    return float(sum(p**i for i in range(k + 1)))


def tokens_per_step_sd(p: float, k: int) -> float:
    """Standard deviation of one row-step's tokens (a + 1): P(a = i) = p^i (1 - p) for i < k, P(a = k) = p^k."""
    probs = [p**i * (1 - p) for i in range(k)] + [p**k]
    mean = sum(q * (i + 1) for i, q in enumerate(probs))
    return math.sqrt(max(0.0, sum(q * (i + 1) ** 2 for i, q in enumerate(probs)) - mean**2))


def z_score(measured: float, p: float, k: int, row_steps: int) -> float:
    """How many standard errors the measured mean tokens per step lies from the script's."""
    expected, sd = expected_tokens_per_step(p, k), tokens_per_step_sd(p, k)
    if sd == 0 or row_steps == 0:
        return 0.0 if math.isclose(measured, expected) else math.inf
    return (measured - expected) / (sd / math.sqrt(row_steps))


def per_step_ms(tally: Tally) -> dict:
    """ms per step by phase: propose / verify / commit per speculative step, decode per decode step."""
    c, s = tally.counters, tally.seconds
    spec, decode = c["speculative_steps"], c["decode_steps"]
    out = {phase: 1000 * s[phase] / spec if spec else None for phase in ("propose", "verify", "commit")}
    out["decode"] = 1000 * s["decode"] / decode if decode else None
    out["step"] = 1000 * sum(s[p] for p in PHASES if p != "prefill") / c["steps"] if c["steps"] else None
    return out


def summarize(key, tally: Tally, greedy: Tally, p: float) -> dict:
    """One (k, batch) row of the JSON and the table."""
    k, batch = key
    c = tally.counters
    row_steps = c["speculative_row_steps"]
    measured = (c["accepted"] + row_steps) / row_steps if row_steps else 1.0
    row = {"k": k, "batch": batch, "rounds": len(tally.rates), "requests": tally.requests, "differ": tally.differ,
           "tokens_per_second": statistics.median(tally.rates) if tally.rates else None,
           "tokens_per_second_range": [min(tally.rates), max(tally.rates)] if tally.rates else None,
           "speedup": statistics.median(r / g for r, g in zip(tally.rates, greedy.rates)) if tally.rates else None,
           "tokens_per_step": measured, "expected_tokens_per_step": None, "z": None,
           "acceptance_rate": c["accepted"] / c["drafted"] if c["drafted"] else None,
           "row_steps": row_steps, "step_ms": per_step_ms(tally), "counters": dict(c)}
    if isinstance(k, int) and k > 0:
        row["expected_tokens_per_step"] = expected_tokens_per_step(p, k)
        row["z"] = z_score(measured, p, k, row_steps) if row_steps else None
    row["efficiency"] = row["speedup"] / measured if row["speedup"] and k != 0 else None
    return row


def check_rows(rows: list[dict], sessions: dict, identity_guaranteed: bool) -> Checks:
    """Identity where guaranteed, acceptance on the script where identity held, graph faults 0."""
    checks = Checks()
    for r in rows:
        name = f"k={r['k']} batch {r['batch']}"
        if identity_guaranteed:
            checks.record(f"{name}: requests differing from greedy", r["differ"] == 0, r["differ"])
        if r["z"] is not None and r["differ"] == 0:
            checks.record(f"{name}: tokens per step, z against the script", abs(r["z"]) <= MAX_Z, r["z"])
    faults = {str(k): graph_faults(s) for k, s in sessions.items()}
    checks.record("graph faults", not any(faults.values()), faults)
    return checks


def target_cell(row: dict) -> str:
    if row["efficiency"] is None or row["batch"] not in TARGETS:
        return "-"
    return f"{'met' if row['efficiency'] >= TARGETS[row['batch']] else 'missed'} (>= {TARGETS[row['batch']]})"


def tokens_per_step_cell(row: dict) -> str:
    if row["expected_tokens_per_step"] is None:
        return f"{row['tokens_per_step']:.2f}"
    return f"{row['tokens_per_step']:.2f} ({row['expected_tokens_per_step']:.2f}, z {_f(row['z'], '.1f')})"


def _f(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(results: dict) -> None:
    seconds = results["seconds"]
    print("seconds: " + ", ".join(f"{name} {value:.1f}" for name, value in seconds.items()))
    for k, why in results["refused"].items():
        print(f"k={k}: no row, the Session refused it ({why})")
    print(f"\n### {results['model']} ({results['dtype']}, {results['settings']['provider']}): drafts right with "
          f"p = {results['settings']['p']}, {results['settings']['prompts']} held-out prompts x "
          f"{results['settings']['new_tokens']} tokens, {results['rows'][0]['rounds']} rounds\n")
    header = ["k", "batch", "tokens/s", "speed-up", "tokens/step (expected, z)", "efficiency", "issue 11 target",
              "propose / verify / commit ms", "step ms", "differ from greedy (same batch)"]
    lines = []
    for r in results["rows"]:
        ms = r["step_ms"]
        phases = " / ".join(_f(ms[p], ".3f") for p in ("propose", "verify", "commit")) if r["k"] else \
            f"decode {_f(ms['decode'], '.3f')}"
        lines.append([r["k"], r["batch"], _f(r["tokens_per_second"], ".0f"), _f(r["speedup"], ".2f"),
                      tokens_per_step_cell(r),
                      _f(r["efficiency"], ".2f"), target_cell(r), phases, _f(ms["step"], ".3f"),
                      f"{r['differ']} of {r['requests']}"])
    print(markdown_table(header, lines))
