"""The sampling transform, draws and exact speculative acceptance in ONNX, so the host reads only
token ids: ``decode_sample``, ``verify_mtp_sample_k{k}`` and the MTP head's sampled drafts.

These are the steps of ``speculative.sampling`` (the numpy reference), in float32, over N rows
of B requests, each request with its own parameters (greedy rows, temperature 0, run at T = 1;
their draws are replaced by the argmax):

    z = logits / T                                                        [B, N, V]
    threshold: top-k, then top-p (kept while the mass before < top_p), ties with the last kept
               value kept; then min-p (z >= max z + ln min_p)                [B, N, 1]
    probs = Softmax(z) on the tokens with z >= threshold, renormalised      [B, N, V]
    token = inverse CDF at u (make_draw)

On the portable graphs the MTP head's drafts are drawn from Softmax(z) alone (draft_sampler says why).

The top-k / top-p threshold is one of the sorted values. Sorting all V (TopK(V)) is the costliest
op of a CPU step at Qwen3.5's vocabulary (tools/sampling_transform_cost.py), so the CPU graphs
find it among the largest C values (TopK(C), CANDIDATE_TIERS), which hold it unless the kept set
is wider; an ``If`` widens the candidates only for a batch where a row needs it, and sorts all V
only past the last tier; a batch with no top-k / top-p / min-p skips all of it. A captured CUDA
graph cannot branch, and ONNX Runtime's TopK over all V sorts row by row (BENCHMARKS.md,
"Sampling on the device"), so the portable graphs (``NATIVE``) find the threshold and make the draw with
ortspec's own ops, ai.ortspec.SamplingThreshold and ai.ortspec.Draw: one kernel per row, exact
integer sums (csrc/core/sampling_ops.h; runtime/custom_ops.py registers them). ``SORT`` builds the
same steps from ONNX ops alone (TopK over all V, blocked cumulative sums), kept to measure against.
All find the reference's threshold.
The target's own choices need no probabilities, only tokens: there the portable graphs run the
transform from the logits inside ortspec's ops, over weights exp(z - max z) they compute
themselves: a sampled decode as one op, ai.ortspec.SampleToken (make_sampled_tokens), a sampled
verify's acceptance as two, ai.ortspec.TransformRows (each row's max, threshold and kept mass)
and ai.ortspec.SpeculativeAccept (the accept length and the token after it). Only the MTP head's
drafts keep their probabilities q in the graph (the acceptance reads them), from the steps above.

Exact speculative sampling (speculative.sampling's docstring) over a verify's k+1 rows: accept
d_{i+1} while u_i q_{i+1}(d_{i+1}) < p_i(d_{i+1}); at the first rejection a draw from
norm(max(0, p_a - q_{a+1})) (from p_a where that is empty), after k accepts from p_k.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from onnx import TensorProto, helper

from .builder import CPU, ORTSPEC_DOMAIN, GraphBuilder

BOOL, F32, I64 = TensorProto.BOOL, TensorProto.FLOAT, TensorProto.INT64
SORT, CANDIDATES = "sort", "candidates"  # how the top-k / top-p threshold is found (module docstring)
NATIVE = "native"  # the portable graphs: the ai.ortspec ops, one kernel per row (module docstring)
CANDIDATE_TIERS = (256, 4096)  # TopK widths the CPU graphs try in turn before sorting all V
EXP_FLOOR = -64.0  # z - max z below this counts as this in the Softmax (_softmax says why)


@dataclasses.dataclass(frozen=True)
class RowParams:
    """The per-request sampling inputs of a graph, each [B]: temperature float (0: a greedy row),
    top_k int64 (0: off), top_p float (1: off), min_p float (0: off)."""

    temperature: str
    top_k: str
    top_p: str
    min_p: str
    derived: dict = dataclasses.field(default_factory=dict, compare=False)  # (id(graph), name) -> (graph, value)

    @classmethod
    def inputs(cls, g: GraphBuilder) -> "RowParams":
        return cls(g.input("temperature", F32, ["B"]), g.input("top_k", I64, ["B"]),
                   g.input("top_p", F32, ["B"]), g.input("min_p", F32, ["B"]))

    def once(self, g: GraphBuilder, name: str, make) -> str:
        """make(g), made once per graph: the head's k draft passes share one 1 / T, not k of them."""
        key = (id(g), name)
        if key not in self.derived:
            self.derived[key] = (g, make(g))  # the graph held: its id is not reused for another
        return self.derived[key][1]


def method_for(g: GraphBuilder) -> str:
    """The threshold search a graph of this target runs: candidates with branches on the CPU, the
    native op where graphs are captured (module docstring)."""
    return CANDIDATES if g.target == CPU else NATIVE


def per_row(g: GraphBuilder, value: str) -> str:
    """[B] -> [B, 1, 1], to broadcast over [B, N, V]."""
    return g.op("Unsqueeze", [value, g.const([1, 2])])


def make_scaled_logits(g: GraphBuilder, logits: str, params: RowParams) -> str:
    """z = logits * (1 / T) [B, N, V] (T = 1 on greedy rows, whose draws are not used); a product,
    not a quotient: ONNX Runtime's CPU Mul is the faster kernel."""
    def inverse(g: GraphBuilder) -> str:
        t = per_row(g, params.temperature)
        t = g.op("Where", [g.op("Greater", [t, g.const(0.0, "float32")]), t, g.const(1.0, "float32")])  # [B, 1, 1]
        return g.op("Reciprocal", [t])

    return g.op("Mul", [logits, params.once(g, "1/T", inverse)], hint="scaled")


def make_sampling_probs(g: GraphBuilder, logits: str, params: RowParams, vocab: int, method: str | None = None) -> str:
    """logits [B, N, V] -> the transformed distributions [B, N, V] (float32, each row sums to 1):
    Softmax(z) over the kept tokens, renormalised. The CPU graphs skip the masking (an If) for a
    batch whose rows keep every token."""
    method = method or method_for(g)
    z = make_scaled_logits(g, logits, params)

    def masked(sub: GraphBuilder) -> list[str]:
        top = row_max(sub, z)
        probs = _softmax(sub, z, top)  # [B, N, V]: every token
        threshold = make_threshold(sub, z, probs, params, vocab, method, top)
        weights = sub.op("Where", [sub.op("GreaterOrEqual", [z, threshold]), probs, sub.const(0.0, "float32")])
        return [sub.op("Div", [weights, sub.op("ReduceSum", [weights, sub.const([-1])])], hint="probs")]

    if method in (SORT, NATIVE):
        return masked(g)[0]

    def thresholded(sub: GraphBuilder) -> list[str]:
        width = min(CANDIDATE_TIERS[0], vocab)
        inside = _all(sub, sub.op("LessOrEqual", [_kept_by_k(sub, params, vocab), sub.const(width)]))
        return [sub.if_else(inside, lambda s: [_candidate_probs(s, z, params, vocab, width, masked)], masked, [F32])]

    masks = g.op("Not", [_keeps_all(g, params, vocab, with_min_p=True)])  # [B, 1, 1]
    # each branch makes its own Softmax: a branch output that is a value from outside is copied
    return g.if_else(_any(g, masks), thresholded, lambda sub: [_softmax(sub, z)], [F32])


def _candidate_probs(g: GraphBuilder, z: str, params: RowParams, vocab: int, width: int, masked) -> str:
    """(CPU, a batch whose rows' top-k sets all lie within the largest ``width`` values) The
    distributions from those candidates alone, scattered into zeros: no op over all V but the
    TopK and the scatter. Where a row's kept value ties past the candidates (the last candidate
    is kept), masked(g) instead: the masks over all V."""
    ordered, index = g.op("TopK", [z, g.const([width])], num_outputs=2, axis=-1, largest=1, sorted=1)  # [B, N, C]
    top = g.op("Slice", [ordered, g.const([0]), g.const([1]), g.const([-1])])  # [B, N, 1]: max z
    e = g.op("Exp", [g.op("Max", [g.op("Sub", [ordered, top]), g.const(EXP_FLOOR, "float32")])])  # as _softmax's
    in_k = _in_top_k(g, width, _kept_by_k(g, params, vocab))  # [B, 1, C]
    mass = g.op("Mul", [e, g.op("Cast", [in_k], to=F32)])
    mass = g.op("Div", [mass, g.op("ReduceSum", [mass, g.const([-1])])])  # [B, N, C]: over the top-k set
    threshold, _ = _kept_in_sorted(g, ordered, mass, in_k, params.top_p, width)
    threshold = g.op("Max", [threshold, g.op("Add", [top, g.op("Log", [per_row(g, params.min_p)])])])  # min-p
    kept = g.op("Mul", [e, g.op("Cast", [g.op("GreaterOrEqual", [ordered, threshold])], to=F32)])  # [B, N, C]
    last = g.op("Slice", [ordered, g.const([width - 1]), g.const([width]), g.const([-1])])  # [B, N, 1]
    spills = _any(g, g.op("GreaterOrEqual", [last, threshold])) if width < vocab else g.const(False, bool)

    def scattered(sub: GraphBuilder) -> list[str]:
        probs = sub.op("Div", [kept, sub.op("ReduceSum", [kept, sub.const([-1])])])  # [B, N, C]
        zeros = sub.op("ConstantOfShape", [sub.op("Shape", [z])], value=_float_zero())  # [B, N, V]
        return [sub.op("ScatterElements", [zeros, index, probs], axis=-1, hint="probs")]

    return g.if_else(spills, masked, scattered, [F32])


def _float_zero():
    return helper.make_tensor("zero", F32, [1], [0.0])


def _softmax(g: GraphBuilder, z: str, top: str | None = None) -> str:
    """Softmax(max(z, max z + EXP_FLOOR)) [B, N, V]: no exponent of a token is subnormal. Wide logits
    (a random model's: most tokens 100+ below the largest) made the CPU's Softmax several times
    slower in subnormal arithmetic; a floored token's probability, at least e^-64 times the
    largest's, is below float32 rounding of every other's (V e^-64 << 2^-24), so the others keep
    their bits, and the mask still reads z itself. top: row_max(z), where the caller has it."""
    floor = g.op("Add", [top or row_max(g, z), g.const(EXP_FLOOR, "float32")])  # [B, N, 1]
    return g.op("Softmax", [g.op("Max", [z, floor])], axis=-1)


def row_max(g: GraphBuilder, z: str) -> str:
    """[B, N, 1]: the largest of z [B, N, V]. The portable graphs take the value at the ArgMax:
    ONNX Runtime's CUDA ReduceMax over more than one row costs many times its ArgMax, more the
    wider the row (BENCHMARKS.md, "Sampling on the device"); the CPU's ReduceMax is one op."""
    if g.target == CPU:
        return g.op("ReduceMax", [z, g.const([-1])])
    return g.op("GatherElements", [z, g.op("ArgMax", [z], axis=-1, keepdims=1)], axis=-1)


def _keeps_all(g: GraphBuilder, params: RowParams, vocab: int, with_min_p: bool) -> str:
    """bool [B, 1, 1]: rows whose top-k and top-p (and min-p) keep every token."""
    k, p = per_row(g, params.top_k), per_row(g, params.top_p)
    no_k = g.op("Or", [g.op("LessOrEqual", [k, g.const(0)]), g.op("GreaterOrEqual", [k, g.const(vocab)])])
    keeps = g.op("And", [no_k, g.op("GreaterOrEqual", [p, g.const(1.0, "float32")])])
    if with_min_p:
        keeps = g.op("And", [keeps, g.op("LessOrEqual", [per_row(g, params.min_p), g.const(0.0, "float32")])])
    return keeps


def make_threshold(g: GraphBuilder, z: str, probs: str, params: RowParams, vocab: int, method: str, top: str) -> str:
    """threshold [B, N, 1]: the kept tokens are those with z >= threshold (module docstring);
    probs [B, N, V]: Softmax(z), the mass of every token; top: row_max(z)."""
    min_p = g.op("Add", [top, g.op("Log", [per_row(g, params.min_p)])])  # -inf: off
    if method == NATIVE:
        top_kp = g.op("SamplingThreshold", [z, probs, params.top_k, params.top_p], domain=ORTSPEC_DOMAIN)
        return g.op("Max", [top_kp, min_p], hint="threshold")
    kept_by_k = _kept_by_k(g, params, vocab)
    if method == SORT:
        top_kp, _ = _sorted_threshold(g, z, probs, vocab, kept_by_k, params.top_p, None)
    else:
        top_kp = _candidate_threshold(g, z, probs, params, kept_by_k, vocab)
    return g.op("Max", [top_kp, min_p], hint="threshold")


def _kept_by_k(g: GraphBuilder, params: RowParams, vocab: int) -> str:
    """[B, 1, 1] int64: how many of the sorted values top-k keeps (V when off)."""
    k = per_row(g, params.top_k)
    return g.op("Where", [g.op("Greater", [k, g.const(0)]), g.op("Min", [k, g.const(vocab)]), g.const(vocab)])


def _sorted_threshold(g: GraphBuilder, z: str, probs: str, width: int, kept_by_k: str, top_p: str,
                      k_inside: str) -> tuple[str, str]:
    """The reference's top-k / top-p threshold among the largest ``width`` values of z: the
    smallest kept one [B, N, 1], and the count of ranks kept [B, N, 1] (>= 1: rank 0 always is).
    k_inside [B, 1, 1] (None: every row): rows whose top-k set lies within them, whose mass is
    renormalised over it; the others' (top-k off) is the mass over all V, as probs has it."""
    ordered, index = g.op("TopK", [z, g.const([width])], num_outputs=2, axis=-1, largest=1, sorted=1)  # [B, N, W]
    in_k = _in_top_k(g, width, kept_by_k)
    mass = g.op("Where", [in_k, g.op("GatherElements", [probs, index], axis=-1), g.const(0.0, "float32")])
    total = g.op("ReduceSum", [mass, g.const([-1])])  # [B, N, 1]
    if k_inside is not None:
        total = g.op("Where", [k_inside, total, g.const(1.0, "float32")])
    return _kept_in_sorted(g, ordered, g.op("Div", [mass, total]), in_k, top_p, width)


def _in_top_k(g: GraphBuilder, width: int, kept_by_k: str) -> str:
    """bool [B, 1, W]: the ranks 0..W-1 inside the top-k set."""
    return g.op("Less", [g.const(range(width), hint="rank"), kept_by_k])


def _kept_in_sorted(g: GraphBuilder, ordered: str, mass: str, in_k: str, top_p: str, width: int) -> tuple[str, str]:
    """(the smallest kept value [B, N, 1], the count of ranks kept [B, N, 1]) of sorted values
    ordered [B, N, W] (W = width) with their mass [B, N, W], in_k the ranks inside the top-k set: top-k, then
    top-p (kept while the mass before a rank is < top_p)."""
    before = prefix_sums(g, mass, width, exclusive=True)  # mass ahead of each rank
    p = per_row(g, top_p)
    within_p = g.op("Or", [g.op("Less", [before, p]), g.op("GreaterOrEqual", [p, g.const(1.0, "float32")])])
    count = g.op("Cast", [_count(g, g.op("And", [in_k, within_p]))], to=I64)  # [B, N, 1]
    return g.op("GatherElements", [ordered, g.op("Sub", [count, g.const(1)])], axis=-1), count


def _candidate_threshold(g: GraphBuilder, z: str, probs: str, params: RowParams, kept_by_k: str, vocab: int) -> str:
    """The top-k / top-p threshold from the largest C values (CANDIDATES: the module docstring), or
    -inf for a batch whose rows keep every token (then nothing is sorted at all)."""
    keeps_all = _keeps_all(g, params, vocab, with_min_p=False)  # [B, 1, 1]
    minus_inf = g.const(np.full((1, 1, 1), -np.inf), "float32")
    tiers = [c for c in CANDIDATE_TIERS if c < vocab]

    def search(sub: GraphBuilder) -> list[str]:
        threshold = _tiered_threshold(sub, z, probs, params, kept_by_k, keeps_all, vocab, tiers)
        return [sub.op("Where", [keeps_all, minus_inf, threshold])]

    return g.if_else(_any(g, g.op("Not", [keeps_all])), search, lambda sub: [minus_inf], [F32])


def _tiered_threshold(g: GraphBuilder, z: str, probs: str, params: RowParams, kept_by_k: str, keeps_all: str,
                      vocab: int, tiers: list[int]) -> str:
    """The threshold among the largest tiers[0] values where that holds it for every row of the
    batch that needs one (not keeps_all), else among the next tier's (an If per tier), else over
    all V sorted. Among C candidates a row's threshold is exact when its top-k set lies within them
    (k <= C: the mass is theirs), or when top-k is off and top-p stops inside them (the mass over
    all V is probs'). Ties past the candidates are kept all the same: the mask reads all V."""
    if not tiers:
        return _sorted_threshold(g, z, probs, vocab, kept_by_k, params.top_p, None)[0]
    width = tiers[0]
    k_inside = g.op("LessOrEqual", [kept_by_k, g.const(width)])  # [B, 1, 1]
    threshold, count = _sorted_threshold(g, z, probs, width, kept_by_k, params.top_p, k_inside)
    past = g.op("And", [g.op("Not", [g.op("Or", [k_inside, keeps_all])]), g.op("Or", [
        g.op("Less", [kept_by_k, g.const(vocab)]),  # a top-k set wider than C: its mass is not known here
        g.op("GreaterOrEqual", [count, g.const(width)])])])  # top-p kept every candidate: it may go on
    return g.if_else(_any(g, past), lambda sub: [_tiered_threshold(sub, z, probs, params, kept_by_k, keeps_all, vocab,
                                                                   tiers[1:])],
                     lambda sub: [threshold], [F32])


def _any(g: GraphBuilder, flags: str) -> str:
    """A bool scalar: any of flags (bool, any shape)."""
    return g.op("Cast", [g.op("ReduceMax", [g.op("Cast", [flags], to=I64)], keepdims=0)], to=BOOL)


def _all(g: GraphBuilder, flags: str) -> str:
    """A bool scalar: all of flags (bool, any shape)."""
    return g.op("Cast", [g.op("ReduceMin", [g.op("Cast", [flags], to=I64)], keepdims=0)], to=BOOL)


def make_draw(g: GraphBuilder, weights: str, u: str, vocab: int, method: str | None = None) -> str:
    """Inverse-CDF draws [B, N] int64 from weights [B, N, V] in [0, 1] (need not sum to 1) with
    uniforms u [B, N] in [0, 1): speculative.sampling.draw. The CPU graphs draw in two levels
    (_two_level_draw: no op over all V but one sum, where each costs), the portable ones with the
    native op (one kernel per row), or (method SORT: the ONNX-only graphs) over the blocked
    cumulative sum of all V (_blocked_draw)."""
    method = method or method_for(g)
    if method == CANDIDATES:
        return _two_level_draw(g, weights, u, vocab)
    if method == SORT:
        return _blocked_draw(g, weights, u, vocab)
    return g.op("Draw", [weights, u], domain=ORTSPEC_DOMAIN, hint="drawn")


def _blocked_draw(g: GraphBuilder, weights: str, u: str, vocab: int) -> str:
    """#{cdf <= u cdf_V} over the blocked cumulative sum of all V (prefix_sums), at most the last
    positive weight's index, as the reference."""
    cdf = prefix_sums(g, weights, vocab, exclusive=False)  # [B, N, V]
    total = g.op("Slice", [cdf, g.const([vocab - 1]), g.const([vocab]), g.const([-1])])  # [B, N, 1]
    target = g.op("Mul", [g.op("Unsqueeze", [u, g.const([2])]), total])  # [B, N, 1]
    return g.op("Squeeze", [_index_at(g, weights, cdf, target, vocab), g.const([2])], hint="drawn")


def _two_level_draw(g: GraphBuilder, weights: str, u: str, vocab: int) -> str:
    """The draw in two levels, so no op runs a cumulative sum over all V (on the CPU one costs as
    much as the rest of a draw):

        weights [B, N, nb, bs] ─ ReduceSum ─ CumSum ─ block j: #{cdf <= u total} ─┐
        weights of block j [B, N, bs] ─ CumSum ─ #{cdf <= u total - before j} ─────┴─ j bs + i

    Each level stops at its last positive entry, so a weight of 0 is never drawn."""
    size, padded = block_size(vocab)
    if padded > vocab:
        weights = g.op("Pad", [weights, g.const([0, 0, 0, 0, 0, padded - vocab])])
    blocks = g.op("Reshape", [weights, g.const([0, 0, padded // size, size])])  # [B, N, nb, bs]
    sums = g.op("ReduceSum", [blocks, g.const([-1])], keepdims=0)  # [B, N, nb]
    target = g.op("Mul", [g.op("Unsqueeze", [u, g.const([2])]), g.op("ReduceSum", [sums, g.const([-1])])])  # [B, N, 1]
    block, before = _inverse_cdf(g, sums, target, padded // size)  # [B, N, 1] each
    row = g.op("GatherND", [blocks, block], batch_dims=2)  # [B, N, bs]
    within, _ = _inverse_cdf(g, row, g.op("Sub", [target, before]), size)
    token = g.op("Add", [g.op("Mul", [block, g.const(size)]), within])  # [B, N, 1]
    return g.op("Squeeze", [token, g.const([2])], hint="drawn")


def _inverse_cdf(g: GraphBuilder, weights: str, target: str, width: int) -> tuple[str, str]:
    """(index [B, N, 1]: #{cdf <= target}, at most the last positive weight; the cdf before it)."""
    cdf = g.op("CumSum", [weights, g.const(-1)])  # [B, N, W]
    index = _index_at(g, weights, cdf, target, width)
    before = g.op("GatherElements", [g.op("Sub", [cdf, weights]), index], axis=-1)  # exclusive cdf at index
    return index, before


def _index_at(g: GraphBuilder, weights: str, cdf: str, target: str, width: int) -> str:
    """[B, N, 1]: #{cdf <= target} over weights [B, N, W] and their cdf, at most the index of the
    last positive weight (rounding cannot push a draw past it)."""
    below = g.op("Cast", [_count(g, g.op("LessOrEqual", [cdf, target]))], to=I64)
    positive = g.op("Where", [g.op("Greater", [weights, g.const(0.0, "float32")]), g.const(range(width), "float32"),
                              g.const(-1.0, "float32")])  # each positive weight's index, else -1
    return g.op("Min", [below, g.op("ArgMax", [positive], axis=-1, keepdims=1)])  # ArgMax: see row_max


def _count(g: GraphBuilder, flags: str) -> str:
    """float [B, N, 1]: how many of flags [B, N, W] hold, counted in float32 (exact below 2^24):
    ONNX Runtime's CUDA reductions over int64 are far slower per element than the float ones
    (BENCHMARKS.md, "Sampling on the device")."""
    return g.op("ReduceSum", [g.op("Cast", [flags], to=F32), g.const([-1])], keepdims=1)


def prefix_sums(g: GraphBuilder, x: str, width: int, exclusive: bool) -> str:
    """Cumulative sums of x [B, N, W] along W (exclusive: of the entries before each). ONNX
    Runtime's CUDA CumSum sums every output's whole prefix, quadratic in W, so the portable graphs
    sum within blocks of about sqrt(W) (block_size) and add to each the sum of the blocks before
    it; the CPU's CumSum is linear and runs as one op."""
    size, padded = block_size(width)
    if g.target == CPU or size >= width:
        return g.op("CumSum", [x, g.const(-1)], exclusive=int(exclusive))
    if padded > width:
        x = g.op("Pad", [x, g.const([0, 0, 0, 0, 0, padded - width])])
    blocks = g.op("Reshape", [x, g.const([0, 0, padded // size, size])])  # [B, N, nb, bs]
    within = g.op("CumSum", [blocks, g.const(-1)], exclusive=int(exclusive))
    before = g.op("CumSum", [g.op("ReduceSum", [blocks, g.const([-1])], keepdims=1), g.const(-2)], exclusive=1)
    sums = g.op("Reshape", [g.op("Add", [within, before]), g.const([0, 0, padded])])  # [B, N, W']
    return sums if padded == width else g.op("Slice", [sums, g.const([0]), g.const([width]), g.const([-1])])


def block_size(vocab: int) -> tuple[int, int]:
    """(bs, V'): blocks of bs entries over V' >= V (V' - V zero weights padded): the divisor of V
    nearest sqrt(V) where one lies within a factor 4 of it, else blocks of ceil(sqrt(V))."""
    root = np.sqrt(vocab)
    near = [d for d in range(max(1, int(root / 4)), int(root * 4) + 1) if vocab % d == 0]
    if near:
        return min(near, key=lambda d: abs(np.log(d / root))), vocab
    size = int(np.ceil(root))
    return size, -(-vocab // size) * size


def make_token_choice(g: GraphBuilder, logits: str, params: RowParams, u: str, vocab: int,
                      truncated: bool = True, method: str | None = None) -> tuple[str, str]:
    """One token per row of logits [B, N, V]: drawn where temperature > 0, else the argmax.
    u [B, N]. Returns (tokens int64 [B, N], probs [B, N, V] the draws came from): the sampling
    transform's, or (truncated False) Softmax(logits / T) alone. The CPU graphs skip the argmax
    (an If) where no row is greedy."""
    probs = make_sampling_probs(g, logits, params, vocab, method) if truncated else _softmax(
        g, make_scaled_logits(g, logits, params))
    drawn = make_draw(g, probs, u, vocab, SORT if method == SORT else None)
    greedy_rows = params.once(g, "greedy", lambda g: g.op("LessOrEqual", [params.temperature,
                                                                       g.const(0.0, "float32")]))  # [B]

    def argmax(sub: GraphBuilder) -> list[str]:
        return [sub.op("ArgMax", [logits], axis=-1, keepdims=0)]  # [B, N]

    greedy = (argmax(g)[0] if method_for(g) != CANDIDATES else
              g.if_else(_any(g, greedy_rows), argmax, lambda sub: [drawn], [I64]))
    return g.op("Where", [g.op("Unsqueeze", [greedy_rows, g.const([1])]), greedy, drawn]), probs


def make_sampled_tokens(g: GraphBuilder, logits: str, params: RowParams, u: str, vocab: int,
                        method: str | None = None) -> str:
    """make_token_choice's tokens [B, N] where nothing needs the probabilities (a sampled decode):
    on the portable graphs one op, ai.ortspec.SampleToken, the whole transform and draw from the
    logits in one kernel per row (the greedy rows' ArgMax beside it, decode's own op); the CPU
    graphs and SORT build the steps."""
    method = method or method_for(g)
    if method != NATIVE:
        return make_token_choice(g, logits, params, u, vocab, method=method)[0]
    greedy = g.op("ArgMax", [logits], axis=-1, keepdims=0)  # [B, N]
    return g.op("SampleToken", [logits, greedy, params.temperature, params.top_k, params.top_p, params.min_p, u],
                domain=ORTSPEC_DOMAIN, hint="drawn")


# -- exact speculative sampling over a verify's rows -------------------------------------------

def accept_drafts(g: GraphBuilder, u: str, p_draft: str, q_draft: str) -> str:
    """bool [B, k]: d_{i+1} accepted, u < p_i(d)/q_{i+1}(d), i.e. with probability min(1, p/q)."""
    return g.op("Less", [g.op("Mul", [u, q_draft]), p_draft])


def residual_weights(g: GraphBuilder, p_row: str, q_row: str) -> str:
    """[B, V]: max(0, p_a - q_{a+1}), what the token after a rejection is drawn from (q_row is 0
    after k accepts: then p_k itself)."""
    return g.op("Relu", [g.op("Sub", [p_row, q_row])])


def make_speculative_acceptance(g: GraphBuilder, p: str, q: str, drafts: str, u: str, k: int,
                                vocab: int) -> tuple[str, str]:
    """p [B, k+1, V] the target's transformed distributions after verify rows 0..k, q [B, k, V]
    the ones drafts [B, k] were drawn from, u [B, k+1] (k acceptances, then the emitted token's)
    -> (a int64 [B], the token emitted after the a accepted drafts [B]):
    speculative.sampling.speculative_accept."""
    index = g.op("Unsqueeze", [drafts, g.const([2])])  # [B, k, 1]
    p_rows = g.op("Slice", [p, g.const([0]), g.const([k]), g.const([1])])  # [B, k, V]: p_0..p_{k-1}
    p_draft = g.op("Squeeze", [g.op("GatherElements", [p_rows, index], axis=2), g.const([2])])  # [B, k]
    q_draft = g.op("Squeeze", [g.op("GatherElements", [q, index], axis=2), g.const([2])])  # [B, k]
    u_accept = g.op("Slice", [u, g.const([0]), g.const([k]), g.const([1])])  # [B, k]
    rejected = g.op("Cast", [g.op("Not", [accept_drafts(g, u_accept, p_draft, q_draft)])], to=I64)
    before_first = g.op("Equal", [g.op("CumSum", [rejected, g.const(1)]), g.const(0)])  # [B, k]
    accepted = g.op("ReduceSum", [g.op("Cast", [before_first], to=I64), g.const([1])], keepdims=0)  # [B]
    at = g.op("Unsqueeze", [accepted, g.const([1])])  # [B, 1]
    p_row = g.op("GatherND", [p, at], batch_dims=1)  # [B, V]: p_a
    q_row = g.op("Mul", [g.op("GatherND", [q, g.op("Min", [at, g.const(k - 1)])], batch_dims=1),
                         g.op("Cast", [g.op("Less", [at, g.const(k)])], to=F32)])  # [B, V]: q_{a+1}, 0 at a = k
    residual = residual_weights(g, p_row, q_row)
    empty = g.op("Cast", [g.op("LessOrEqual", [g.op("ReduceSum", [residual, g.const([1])]),
                                               g.const(0.0, "float32")])], to=F32)  # [B, 1]: p_a == q_{a+1}
    weights = g.op("Add", [residual, g.op("Mul", [p_row, empty])])  # [B, V]
    u_emit = g.op("Slice", [u, g.const([k]), g.const([k + 1]), g.const([1])])  # [B, 1]
    emitted = make_draw(g, g.op("Unsqueeze", [weights, g.const([1])]), u_emit, vocab)  # [B, 1]
    return accepted, g.op("Squeeze", [emitted, g.const([1])])


def make_sampled_step_ids(g: GraphBuilder, ids: str, tokens: str, logits: str, params: RowParams, q: str, u: str,
                          greedy_accepted: str, k: int, vocab: int, method: str | None = None) -> tuple[str, str]:
    """A verify's emitted tokens e [B, k+1] and accept lengths a [B]: sampled rows by exact
    speculative sampling over ids [B, k+1] = (x_T, d_1..d_k), greedy rows by the greedy rule
    (greedy_accepted) with e = the argmaxes tokens [B, k+1], bit for bit verify_mtp_k{k}'s.
    e_i = d_{i+1} for i < a and e_a the emitted token, so e_a is the next pending token; for
    greedy rows that is g_a, and for i <= a e_i = g_i (the accepted drafts equal the argmaxes)."""
    drafts = g.op("Slice", [ids, g.const([1]), g.const([k + 1]), g.const([1])])  # [B, k]
    greedy_token = g.op("Squeeze", [g.op("GatherElements", [tokens, g.op("Unsqueeze", [greedy_accepted, g.const([1])])],
                                         axis=1), g.const([1])])  # [B]: g_a
    if (method or method_for(g)) == NATIVE:  # the transform and the acceptance as two ops (module docstring)
        stats = g.op("TransformRows", [logits, params.temperature, params.top_k, params.top_p, params.min_p],
                     domain=ORTSPEC_DOMAIN)  # [B, k+1, 3]
        u_step = g.op("Slice", [u, g.const([0]), g.const([k + 1]), g.const([1])])  # [B, k+1]: k accepts, the emit
        accepted, token = g.op("SpeculativeAccept", [logits, stats, drafts, q, params.temperature, params.min_p,
                                                     u_step, greedy_accepted, greedy_token], domain=ORTSPEC_DOMAIN,
                               num_outputs=2)
    else:
        p = make_sampling_probs(g, logits, params, vocab, method)  # [B, k+1, V]
        sampled_a, sampled_token = make_speculative_acceptance(g, p, q, drafts, u, k, vocab)
        samples = g.op("Greater", [params.temperature, g.const(0.0, "float32")])  # [B]
        accepted = g.op("Where", [samples, sampled_a, greedy_accepted])  # [B]
        token = g.op("Where", [samples, sampled_token, greedy_token])
    emitted = g.op("Unsqueeze", [token, g.const([1])])  # [B, 1]
    shifted = g.op("Concat", [drafts, g.op("Slice", [tokens, g.const([k]), g.const([k + 1]), g.const([1])])],
                   axis=1)  # [B, k+1]: d_1..d_k, then any token (column k is never < a)
    column, at = g.const(range(k + 1), hint="column"), g.op("Unsqueeze", [accepted, g.const([1])])  # [k+1], [B, 1]
    tail = g.op("Where", [g.op("Equal", [column, at]), emitted, tokens])  # [B, k+1]
    return g.op("Where", [g.op("Less", [column, at]), shifted, tail], hint="emitted"), accepted


def draft_sampler(g: GraphBuilder, params: RowParams, uniforms: str, first: int, vocab: int):
    """(logits [B, 1, V], pass j) -> (draft [B, 1], probs [B, 1, V]) drawn with uniforms[:, first + j]
    (argmax on greedy rows): the MTP head's sampled drafts. Any q keeps the output exact (the
    acceptance reads the q a draft came from), so q follows the cost of truncating on each target:
    the CPU graphs draw from the head's distribution transformed as the target's (top-k / top-p /
    min-p among candidates: cheap, and an int4 head's drafts are accepted far more often so), the
    portable ones from Softmax(z / T) alone, which spares every draft pass a sort of all V
    (BENCHMARKS.md, "Sampling on the device")."""
    truncated = method_for(g) == CANDIDATES

    def choose(logits, j):
        u = g.op("Slice", [uniforms, g.const([first + j]), g.const([first + j + 1]), g.const([1])])  # [B, 1]
        return make_token_choice(g, logits, params, u, vocab, truncated=truncated)

    return choose
