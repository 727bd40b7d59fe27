"""Argument checks for the public API: Session(...), generate(...), batcher(...), add_request(...).

One pure function per argument kind: it returns the value normalized (numpy integers become
Python ints, token-id sequences become list[int]) or raises a typed error that names the
argument, the bad value and what to do. Every check runs before any work starts (no session
built, no state buffer touched), so a bad call leaves the Session as it was.
Session options raise ConfigurationError (ProviderError for the provider); request arguments
raise InputError.

Integers are Python or numpy integers, never bools (``k=True`` would read as k=1) and never
floats (``threads=1.5``), and fit 64 bits (numpy and ONNX Runtime take them as int64: a top_k of
2**63 used to overflow inside a step); a value beyond what the machine or the conversion can
serve is refused with the limit, not clamped. Real numbers (temperature, top_p) are finite as
float32, what the MTP head's sampling graph takes; text is valid Unicode (no unpaired surrogate).
"""

from __future__ import annotations

import difflib
import math
import os
from pathlib import Path

import numpy as np

from .errors import ConfigurationError, InputError, ModelDirError, OrtspecError, ProviderError
from .manifest import MAX_SPECULATIVE_TOKENS, graph_name, state_bytes
from .speculative.sampling import MIN_TEMPERATURE, SamplingParams

PROMPT_FORMS = ("token ids (a list or tuple of ints, or a 1-D numpy integer array), a batch of those "
                "(or a 2-D numpy integer array), or text (str or list[str])")
TOKEN_SEQUENCES = (list, tuple, np.ndarray)  # what a prompt of token ids may be
SESSION_OPTIONS = ("provider", "num_speculative_tokens", "commit", "threads", "cuda_graphs", "pipeline_stages",
                   "devices", "max_engines_per_batch_size", "exact", "exact_batch_size", "exact_k", "prefill_thread")
SAMPLING_ARGUMENTS = ("temperature", "top_k", "top_p", "seed", "min_p")
# The keywords each call takes (tests/test_redteam_api.py checks them against the signatures):
CALL_ARGUMENTS = {"generate": ("prompt", "max_new_tokens", "stop_tokens", *SAMPLING_ARGUMENTS, "stream", "stop"),
                  "batcher": ("max_batch_size",)}
REQUEST_ARGUMENTS = ("prompt", "max_new_tokens", "stop_tokens", *SAMPLING_ARGUMENTS, "stop", "logprobs",
                     "seed_index")  # of add_request
CALL_ARGUMENTS.update({"add_request": REQUEST_ARGUMENTS, "Session": ("model_dir", *SESSION_OPTIONS)})
# Decoder hooks that generate(...) and batcher(...) pass on (tests and exactness tools use them):
# make_drafts(mtp) -> DraftSource, on_commit(decoder, batch) after every commit, fixed_rows (run
# every row every step, as on CUDA), pipelined (the loop's depth: speculative/decoder.py), fused_verify
# (False: the MTP head never runs inside the verify's graph; speculative/step_kinds.py). Decoder's
# engine and stages belong to the Session.
DECODER_HOOKS = ("make_drafts", "on_commit", "fixed_rows", "pipelined", "fused_verify", "background_prefill")
INT64_MAX = 2**63 - 1  # the largest integer argument: numpy and ONNX Runtime take integers as int64
FLOAT32_MAX = float(np.finfo(np.float32).max)  # the largest real argument: the head's graph takes float32


def is_integer(value) -> bool:
    """A Python or numpy integer; bools are not (True is an int to Python, never a count or id to us)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def integer(name: str, value, error: type[OrtspecError], minimum: int, why: str = "") -> int:
    """value as a Python int >= minimum, or `error` naming the argument, its value and type
    (and `why`, a reason in parentheses, when the bound needs one)."""
    if not is_integer(value):
        raise error(f"{name}={_short(value)} must be an integer >= {minimum}{why}; got {type(value).__name__}.")
    if value < minimum:
        raise error(f"{name}={_short(value)} must be an integer >= {minimum}{why}.")
    if value > INT64_MAX:
        raise error(f"{name}={_short(value)} exceeds {INT64_MAX} (2**63 - 1): integer arguments must fit 64 bits.")
    return int(value)


def finite(name: str, value, error: type[OrtspecError], expected: str) -> float:
    """value as a Python float that is finite in float32, or `error` saying it must be `expected`
    (a JSON integer such as 10**24 is a number too; 10**400 overflows float: not finite)."""
    if not is_real(value):
        raise error(f"{name}={_short(value)} must be {expected}; got {type(value).__name__}.")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or abs(number) > FLOAT32_MAX:
        raise error(f"{name}={_short(value)} must be {expected}, and finite as a float32 (|x| <= {FLOAT32_MAX:.4g}).")
    return number


# -- Session options --------------------------------------------------------------------------
def model_dir(value) -> Path:
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigurationError(f"model_dir={value!r} must be a path (str or pathlib.Path) to a directory "
                                 "written by ortspec convert.")
    return Path(value)


def provider(value) -> str:
    """The provider's name; whether this onnxruntime has it is runtime.graphs.check_provider's job."""
    if not isinstance(value, str):
        raise ProviderError(f"provider={value!r} must be a string: 'cpu' or 'cuda'.")
    return value


AUTO_K = "auto"


def num_speculative_tokens(value, manifest) -> int:
    """k: 0 (greedy) .. K of the conversion; k > K names a K the converter can write.
    "auto" -> K, the most drafts a step of auto k may verify (needs an MTP head and K >= 1)."""
    if value == AUTO_K:
        if not manifest.has_mtp or manifest.num_speculative_tokens < 1:
            why = ("its checkpoint has no mtp.* weights" if not manifest.has_mtp
                   else "it was converted with K=0 (no verify graphs); reconvert with --num-speculative-tokens 1 or more")
            raise ConfigurationError(f'num_speculative_tokens="auto" chooses k in 0..K per step, but {manifest.dir} '
                                     f"cannot speculate: {why}. Use num_speculative_tokens=0.")
        return manifest.num_speculative_tokens
    if isinstance(value, str):
        raise ConfigurationError(f'num_speculative_tokens={value!r} is not a count; use an integer 0..K or "auto".')
    k = integer("num_speculative_tokens", value, ConfigurationError, 0)
    if k > 0 and not manifest.has_mtp:
        raise ConfigurationError(
            f"num_speculative_tokens={k} needs an MTP head, but {manifest.dir} was converted from a checkpoint "
            "without mtp.* weights. Use num_speculative_tokens=0, or convert a checkpoint that has them."
        )
    if k > manifest.num_speculative_tokens:
        converted = manifest.num_speculative_tokens
        fix = f"use k <= {converted}"
        if converted < MAX_SPECULATIVE_TOKENS:
            fix += f" or reconvert with --num-speculative-tokens {min(k, MAX_SPECULATIVE_TOKENS)}"
        if k > MAX_SPECULATIVE_TOKENS:
            fix += f" (the converter writes at most K={MAX_SPECULATIVE_TOKENS})"
        raise ConfigurationError(f"num_speculative_tokens={k} exceeds K={converted} chosen at conversion; {fix}.")
    return k


def commit(value, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ConfigurationError(f"commit={value!r} is unknown; use one of {', '.join(map(repr, choices))}.")
    return value


def exact_shape(exact, batch_size, exact_k, k: int, manifest):
    """exact=True -> the ExactShape every post-prefill forward runs at (runtime.forward_shapes):
    exact_batch_size rows x (exact_k + 1) tokens, exact_k defaulting to the conversion's K;
    exact=False -> None. Both sizes are checked either way."""
    from .runtime.forward_shapes import ExactShape

    exact = flag("exact", exact, ConfigurationError)
    batch_size = integer("exact_batch_size", batch_size, ConfigurationError, 1)
    converted = manifest.num_speculative_tokens
    if exact_k is not None:
        exact_k = integer("exact_k", exact_k, ConfigurationError, 1, " (the fixed verify width of exact mode)")
        if exact_k > converted:
            raise ConfigurationError(f"exact_k={exact_k} exceeds K={converted} chosen at conversion (exact mode runs "
                                     f"verify_select_k{{exact_k}}); use exact_k <= {converted}.")
    if not exact:
        return None
    if converted < 1:
        fix = ("its checkpoint has no mtp.* weights, and such conversions write no verify graphs: exact mode is not "
               "available for this model" if not manifest.has_mtp else "reconvert with --num-speculative-tokens 1 "
               "or more")
        raise ConfigurationError(f"exact=True runs every forward as a verify graph, and {manifest.dir} was converted "
                                 f"with K=0 (no verify graphs); {fix}.")
    exact_k = converted if exact_k is None else exact_k
    if k > exact_k:
        raise ConfigurationError(f"num_speculative_tokens={k} exceeds exact_k={exact_k}: a verify of k+1 tokens must "
                                 f"fit exact mode's fixed width; use k <= {exact_k} or exact_k >= {k}.")
    return ExactShape(batch_size, exact_k)


def usable_cores() -> int:
    """Cores this process may run on: its affinity mask where the OS has one (taskset, containers),
    else os.cpu_count()."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads(value, cores: int | None = None) -> int | None:
    """Intra-op threads per graph session: None or 0 for ONNX Runtime's default, else 1..cores.
    More threads than cores is refused, not clamped: ONNX Runtime starts them all, one pool per
    graph session (threads=10000 started ~20,000 threads and never finished)."""
    if value is None:
        return None
    count = integer("threads", value, ConfigurationError, 0)
    cores = usable_cores() if cores is None else cores
    if count > cores:
        raise ConfigurationError(f"threads={count} exceeds the {cores} cores this process may use; use threads <= "
                                 f"{cores}, or threads=None for ONNX Runtime's default.")
    return count or None


def flag(name: str, value, error: type[OrtspecError] = InputError) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise error(f"{name}={_short(value)} must be True or False.")
    return bool(value)


def prefill_thread(value) -> bool | None:
    if value is not None and not isinstance(value, (bool, np.bool_)):
        raise ConfigurationError(f"prefill_thread={_short(value)} must be True, False or None (None: a prefill on a "
                                 "thread of its own on CUDA, on the engine's thread on the CPU).")
    return None if value is None else bool(value)


def cuda_graphs(value) -> bool:
    return flag("cuda_graphs", value, ConfigurationError)


def pipeline_stages(value, manifest) -> int:
    stages = integer("pipeline_stages", value, ConfigurationError, 1)
    available = manifest.num_stages
    if stages > 1 and stages != available:
        raise ConfigurationError(
            f"pipeline_stages={stages}, but {manifest.dir} holds graphs for "
            f"{available if available > 1 else 'no'} pipeline stages; reconvert with --pipeline-stages {stages}."
        )
    return stages


def devices(value, stages: int, cuda_device_count: int | None = None) -> list[int]:
    """One device per stage (None: all on device 0). On the CPU the indices only place the stages'
    buffers apart; on CUDA (cuda_device_count given) each must be a GPU of this machine."""
    if value is None:
        return [0] * stages
    if isinstance(value, np.ndarray) and value.ndim == 1:
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not all(is_integer(d) and d >= 0 for d in value):
        raise ConfigurationError(f"devices={value!r} must be a list of device indices (ints >= 0), one per stage.")
    indices = [int(d) for d in value]
    if len(indices) != stages:
        raise ConfigurationError(f"devices={indices} must name one device per pipeline stage ({stages}); "
                                 f"e.g. devices={list(range(stages))}.")
    missing = [d for d in indices if cuda_device_count is not None and d >= cuda_device_count]
    if missing:
        count = cuda_device_count
        raise ConfigurationError(f"devices={indices} names cuda:{missing[0]}, but this machine has {count} CUDA "
                                 f"device{'s' if count != 1 else ''}; use indices below {count}.")
    return indices


def model_dtype(manifest, provider_name: str) -> str:
    if manifest.dtype == "bfloat16" and provider_name != "cuda":
        raise ConfigurationError(
            f"{manifest.dir} was converted with dtype bfloat16, which runs on provider='cuda' only "
            "(ONNX Runtime's CPU has no bfloat16 MatMul); convert with --dtype float16 or float32 for the CPU."
        )
    return manifest.dtype


# -- request arguments ------------------------------------------------------------------------
def max_new_tokens(value, minimum: int = 0) -> int:
    """generate allows 0 (returns empty outputs); add_request needs >= 1 (a request must run)."""
    why = " (a request must generate at least one token)" if minimum > 0 else ""
    return integer("max_new_tokens", value, InputError, minimum, why)


def text_prompts(prompt) -> list[str] | None:
    """The texts when the prompt is text (a str, or a list/tuple of str), else None.
    A list mixing text and token ids, or an empty text, is refused."""
    if isinstance(prompt, str):
        texts = [prompt]
    elif isinstance(prompt, (list, tuple)) and any(isinstance(p, str) for p in prompt):
        texts = list(prompt)
        mixed = next((i for i, p in enumerate(texts) if not isinstance(p, str)), None)
        if mixed is not None:
            raise InputError(f"the prompt mixes text and token ids (element {mixed} is {texts[mixed]!r}); "
                             "pass all text (list[str]) or all token ids.")
    else:
        return None
    empty = next((i for i, t in enumerate(texts) if not t), None)
    if empty is not None:
        raise InputError(f"{_prompt_name(empty, len(texts))} is an empty string; give some text to continue.")
    for i, text in enumerate(texts):
        unicode_text(_prompt_name(i, len(texts)), text)
    return texts


def unicode_text(where: str, text: str) -> str:
    """Refuses an unpaired surrogate ("\\ud800" from JSON, or Python text decoded with
    surrogateescape), which no tokenizer can encode; names its position."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"{where} holds an unpaired surrogate U+{ord(text[exc.start]):04X} at character {exc.start}; "
                         "text must be valid Unicode (a surrogate pair is one character).") from None
    return text


def token_prompts(prompt, vocab_size: int) -> tuple[list[list[int]], bool]:
    """(prompts as lists of Python ints, single): one prompt of token ids, or a batch of them.

    One prompt: a list or tuple of ints / numpy integers, or a 1-D numpy integer array.
    A batch: a list or tuple of such prompts, or a 2-D numpy integer array (one row each).
    Floats, bools, None, nested junk and ids outside [0, vocab_size) are refused, naming the
    prompt and the position."""
    if isinstance(prompt, np.ndarray):
        if prompt.ndim not in (1, 2):
            raise InputError(f"a prompt array must be 1-D (one prompt) or 2-D (a batch, one row each); "
                             f"got shape {prompt.shape}.")
        single = prompt.ndim == 1
    elif isinstance(prompt, (list, tuple)):
        nested = [issubclass(kind, TOKEN_SEQUENCES) for kind in set(map(type, prompt))]  # per type: fast
        single = not any(nested)
        if not single and not all(nested):
            bad = next(i for i, p in enumerate(prompt) if not isinstance(p, TOKEN_SEQUENCES))
            raise InputError(f"the batch mixes prompts and single values (element {bad} is {prompt[bad]!r}); "
                             f"pass one prompt of token ids, or a list of prompts.")
    else:
        raise InputError(f"prompt={_short(prompt)} ({type(prompt).__name__}) is not a prompt; pass {PROMPT_FORMS}.")
    prompts = [prompt] if single else list(prompt)
    if not prompts:
        raise InputError(f"the batch is empty; pass at least one prompt: {PROMPT_FORMS}.")
    return [_token_ids(p, _prompt_name(n, len(prompts)), vocab_size) for n, p in enumerate(prompts)], single


def _token_ids(prompt, where: str, vocab_size: int) -> list[int]:
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
            raise InputError(f"{where} is a numpy {prompt.dtype} array of shape {prompt.shape}; token ids must be "
                             "a 1-D integer array (cast with .astype(np.int64)).")
        prompt = prompt.tolist()  # Python ints
    if len(prompt) == 0:
        raise InputError(f"{where} is empty; give at least one token id.")
    if set(map(type, prompt)) != {int}:  # numpy integers or junk: look at each value (bool is not int here)
        for i, t in enumerate(prompt):
            if not is_integer(t):
                raise InputError(f"{where} must hold Python ints or numpy integers (token ids); got {_short(t)} "
                                 f"({type(t).__name__}) at position {i}.")
        prompt = [int(t) for t in prompt]
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        i, t = next((i, t) for i, t in enumerate(prompt) if not 0 <= t < vocab_size)
        raise InputError(f"{where} has token id {t} outside the vocabulary [0, {vocab_size}) at position {i}; "
                         "check that the tokenizer matches the model.")
    return list(prompt)


def single_prompt(prompts: list[list[int]], single: bool, caller: str = "add_request",
                  instead: str = "call add_request once per prompt") -> list[int]:
    """add_request (and a streamed generate) take one prompt; a batch is refused rather than split."""
    if not single:
        raise InputError(f"{caller} takes one prompt, got a batch of {len(prompts)}; {instead}.")
    return prompts[0]


def prompts_fit(prompts: list[list[int]], max_new: int, max_length: int, reserved: int = 0) -> None:
    """Prompt + generated tokens must fit the state buffers sized at conversion, less the
    ``reserved`` last positions (exact mode's pads: its every forward spans exact_k + 1 positions)."""
    usable = max_length - reserved
    for n, p in enumerate(prompts):
        if len(p) + max_new > usable:
            limit = (f"max_length={max_length} of this conversion less the {reserved} positions exact mode reserves "
                     f"for its fixed-shape forwards (exact_k={reserved}) = {usable}" if reserved else
                     f"max_length={max_length} of this conversion")
            raise InputError(
                f"{_prompt_name(n, len(prompts))} has {len(p)} token{'s' if len(p) != 1 else ''}; with "
                f"max_new_tokens={max_new} that is "
                f"{len(p) + max_new} > {limit}. Shorten the prompt, lower max_new_tokens, or reconvert with "
                f"--max-length {len(p) + max_new + reserved}."
            )


def stop_tokens(value, vocab_size: int, default) -> frozenset[int]:
    """None: the model's eos ids. Else one token id, or a list / tuple / set / 1-D array of them
    ([] stops at max_new_tokens only). Text is refused: stop strings go to stop=."""
    if value is None:
        return frozenset(default)
    if is_integer(value):
        values = [value]
    elif isinstance(value, range) and value and not (0 <= min(value[0], value[-1]) and max(value[0], value[-1])
                                                     < vocab_size):  # ends only: range(10**30) would not fit memory
        bad = value[0] if not 0 <= value[0] < vocab_size else value[-1]
        raise InputError(f"stop_tokens={_short(value)} holds {bad}; each stop token must be an integer token id in "
                         f"[0, {vocab_size}).")
    elif isinstance(value, (list, tuple, set, frozenset, range, np.ndarray)):
        values = np.atleast_1d(value).tolist() if isinstance(value, np.ndarray) else list(value)
    else:
        hint = " (stop strings go to stop=, which matches them on the generated text)" if isinstance(
            value, (str, bytes)) else ""
        raise InputError(f"stop_tokens={_short(value)} must be a token id or a list of token ids{hint}.")
    for t in values:
        if not is_integer(t) or not 0 <= t < vocab_size:
            raise InputError(f"stop_tokens={_short(value)} holds {_short(t)} ({type(t).__name__}); each stop token "
                             f"must be an integer token id in [0, {vocab_size}).")
    return frozenset(int(t) for t in values)


def stop_strings(value) -> tuple[str, ...]:
    """None (or [] or ""): no stop strings; else one string or a list of non-empty strings, matched
    on the generated text."""
    if value is None or (isinstance(value, (list, tuple)) and not value) or (isinstance(value, str) and not value):
        return ()
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, (list, tuple)) or not all(isinstance(s, str) and s for s in values):
        raise InputError(f"stop={_short(value)} must be a string or a list of non-empty strings (text that ends "
                         "the completion; stop_tokens takes token ids).")
    return tuple(unicode_text("stop", s) for s in values)


MAX_LOGPROBS = 20  # the most alternatives a token's log-probabilities may list (OpenAI's top_logprobs bound)


def logprobs(value) -> int | None:
    """None: none; else the number of most probable alternatives to list with each token's log-probability."""
    if value is None:
        return None
    if not is_integer(value) or not 0 <= value <= MAX_LOGPROBS:
        raise InputError(f"logprobs={_short(value)} must be None or an integer in [0, {MAX_LOGPROBS}]: the "
                         "alternatives to list beside each token's log-probability.")
    return int(value)


def seed_index(value) -> int:
    return integer("seed_index", value, InputError, 0, " (which of the seed's random streams: generate's prompt i "
                   "draws stream i)")


def per_prompt_seeds(value) -> bool:
    """Whether generate's seed is given one per prompt (a list, tuple or 1-D array)."""
    return isinstance(value, (list, tuple)) or (isinstance(value, np.ndarray) and value.ndim == 1)


def seeds(value, prompts: int) -> list[int]:
    """generate's seed given one per prompt (``per_prompt_seeds``): as many as prompts, each an
    integer 0..2**63-1."""
    value = value.tolist() if isinstance(value, np.ndarray) else list(value)
    if len(value) != prompts:
        raise InputError(f"seed has {len(value)} entries for {prompts} prompt{'s' if prompts != 1 else ''}; pass one "
                         "seed per prompt, or one int for the whole call (prompt i then draws stream i of it).")
    return [integer(f"seed[{i}]", v, InputError, 0) for i, v in enumerate(value)]


def is_real(value) -> bool:
    """A Python or numpy int or float (never a bool)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def sampling(temperature, top_k, top_p, seed, min_p=0.0) -> SamplingParams:
    """temperature 0 (greedy) or >= MIN_TEMPERATURE, finite as a float32; top_k 0..2**63-1 (0: off;
    a top_k of the vocabulary or more keeps every token, as 0 does: not refused, since the
    sampler and the head's graph take min(top_k, vocabulary)); 0 < top_p <= 1 (1: off), nonzero
    as a float32; 0 <= min_p <= 1 (0: off); seed None (OS entropy) or an integer 0..2**63-1. Every
    value is one the sampler's int64 / float32 arrays hold exactly, so a request that passes
    cannot fail there."""
    wanted = "a finite number >= 0 (0 = greedy, the default; 1 = the model's own distribution)"
    temperature = finite("temperature", temperature, InputError, wanted)
    if temperature < 0:
        raise InputError(f"temperature={_short(temperature)} must be {wanted}.")
    if 0 < temperature < MIN_TEMPERATURE:
        raise InputError(f"temperature={temperature!r} is below {MIN_TEMPERATURE} (logits / temperature would "
                         "overflow float32); use temperature=0 for greedy decoding.")
    top_k = integer("top_k", top_k, InputError, 0, " (0 keeps every token)")
    top_p_range = "a number in (0, 1] (1 keeps every token)"
    if not is_real(top_p) or not 0 < top_p <= 1:
        raise InputError(f"top_p={_short(top_p)} must be {top_p_range}.")
    top_p = float(top_p)
    if np.float32(top_p) == 0:
        raise InputError(f"top_p={top_p!r} rounds to 0 in float32 (the MTP head's graph); use top_p >= "
                         f"{float(np.finfo(np.float32).smallest_subnormal):.3g}.")
    if not is_real(min_p) or not 0 <= min_p <= 1:
        raise InputError(f"min_p={_short(min_p)} must be a number in [0, 1]: tokens less probable than min_p "
                         "times the most probable one are cut (0 keeps every token).")
    if seed is not None:
        seed = integer("seed", seed, InputError, 0, " or None")
    return SamplingParams(temperature, top_k, top_p, seed, float(min_p))


def sampling_graphs(manifest, k: int, params: SamplingParams, auto: bool = False) -> None:
    """Sampling with MTP drafts needs the head's sampling graph (auto k: every k's), written by
    conversions since it existed."""
    missing = [graph_name("mtp_sample", n) for n in (range(1, k + 1) if auto else [k])
               if n > 0 and graph_name("mtp_sample", n) not in manifest.graphs]
    name = missing[0] if missing else None
    if k > 0 and not params.greedy and missing:
        raise ModelDirError(
            f"{manifest.dir} was converted before sampled drafts existed (no {name}.onnx), so "
            f"temperature={params.temperature} cannot run with num_speculative_tokens={k}. Reconvert it: "
            f"ortspec convert {manifest.source.get('checkpoint') or 'CHECKPOINT_DIR'} {manifest.dir} --overwrite; "
            "or sample with num_speculative_tokens=0 (greedy still runs speculatively on this directory).")


def decoder_options(options: dict, caller: str) -> dict:
    """The keywords generate(...) / batcher(...) pass on to the Decoder: DECODER_HOOKS only.
    An unknown keyword names the valid ones and, where it can tell, what was meant."""
    for name in options:
        if name not in DECODER_HOOKS:
            raise InputError(unknown_keyword(name, caller))
    if not callable(options.get("make_drafts", callable)):
        raise InputError(f"make_drafts={options['make_drafts']!r} must be a callable: make_drafts(mtp) -> drafts.")
    if options.get("on_commit") is not None and not callable(options["on_commit"]):
        raise InputError(f"on_commit={options['on_commit']!r} must be a callable on_commit(decoder, batch) or None.")
    for flag in ("fixed_rows", "pipelined", "background_prefill"):
        if options.get(flag) is not None and not isinstance(options[flag], (bool, np.bool_)):
            raise InputError(f"{flag}={options[flag]!r} must be True, False or None.")
    if not isinstance(options.get("fused_verify", True), (bool, np.bool_)):
        raise InputError(f"fused_verify={options['fused_verify']!r} must be True (one Run per greedy speculative "
                         "step where the model has the graph) or False (the MTP head in a Run of its own).")
    return dict(options)


def request_arguments(requests) -> list[dict]:
    """add_requests' list: each entry a dict of add_request's keywords, with a prompt."""
    if isinstance(requests, (str, bytes, dict)) or not hasattr(requests, "__iter__"):
        raise InputError(f"requests={_short(requests)} must be a list of dicts, each holding add_request's keyword "
                         "arguments: [{\"prompt\": [3, 14], \"max_new_tokens\": 8}, ...].")
    requests = list(requests)
    for i, arguments in enumerate(requests):
        if not isinstance(arguments, dict):
            raise InputError(f"requests[{i}]={_short(arguments)} must be a dict of add_request's keyword arguments, "
                             "such as {\"prompt\": [3, 14], \"max_new_tokens\": 8}.")
        for name in arguments:
            if name not in REQUEST_ARGUMENTS:
                raise InputError(f"requests[{i}]: " + unknown_keyword(name, "add_request"))
        if "prompt" not in arguments:
            raise InputError(f"requests[{i}] has no 'prompt'; each request needs the token ids (or text) to continue.")
    return requests


def unknown_keyword(name, caller: str) -> str:
    """The message for a keyword `caller` (generate, batcher, add_request, Session) does not take."""
    own, hooked = CALL_ARGUMENTS[caller], caller in ("generate", "batcher")  # these pass DECODER_HOOKS on
    hooks = f" and the decoder hooks {', '.join(DECODER_HOOKS)}" if hooked else ""
    message = f"{caller}() got an unknown keyword {_short(name)}; it takes {', '.join(own)}{hooks}."
    if not isinstance(name, str):
        return message
    if caller == "Session" and name == "k":
        return message + " Did you mean 'num_speculative_tokens'?"
    if caller == "Session" and name in CALL_ARGUMENTS["generate"] + REQUEST_ARGUMENTS:
        return message + f" {name} belongs to each call: session.generate(prompt, {name}=...) or add_request."
    if name in SESSION_OPTIONS or name == "k":
        option = "num_speculative_tokens" if name == "k" else name
        return message + f" {option} is a Session option: ortspec.Session(model_dir, {option}=...)."
    if caller == "batcher" and name in REQUEST_ARGUMENTS:
        return message + f" {name} belongs to each request: batcher.add_request(prompt, {name}=...)."
    close = difflib.get_close_matches(name, own + (DECODER_HOOKS if hooked else ()), n=1)
    return message + (f" Did you mean {close[0]!r}?" if close else "")


def max_engines_per_batch_size(value) -> int:
    return integer("max_engines_per_batch_size", value, ConfigurationError, 1,
                   " (state buffer sets per batch size that concurrent callers lease)")


def max_batch_size(value) -> int:
    return integer("max_batch_size", value, InputError, 1)


def request_id(value) -> int:
    if not is_integer(value):
        raise InputError(f"request_id={_short(value)} must be an integer id returned by add_request.")
    return int(value)


# -- memory -----------------------------------------------------------------------------------
def machine_memory_bytes() -> int | None:
    """Physical memory, or a smaller cgroup (container) limit; None where it cannot be read."""
    try:
        sizes = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    except (AttributeError, ValueError, OSError):  # not POSIX
        return None
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            sizes.append(int(Path(limit_file).read_text().strip()))
        except (OSError, ValueError):  # absent, or "max" (no limit)
            pass
    return min(sizes)


def batch_fits_memory(rows: int, states: dict, device: str, memory: int | None = None) -> None:
    """Refuses a batch whose state buffers alone exceed the host's memory (a lower bound of what
    the batch needs: they are allocated up front, and an allocation the OS over-commits would be
    killed later, mid-decode). Host buffers only: on CUDA the states live in device memory."""
    if device != "cpu":
        return
    per_row, memory = state_bytes(states), machine_memory_bytes() if memory is None else memory
    if memory is not None and rows * per_row > memory:
        raise InputError(f"a batch of {rows} requests needs {_size(rows * per_row)} of state buffers "
                         f"({_size(per_row)} each), more than this machine's {_size(memory)} of memory; "
                         f"run at most {memory // per_row} requests at once.")


# -- message helpers --------------------------------------------------------------------------
def _prompt_name(index: int, count: int) -> str:
    return f"prompt {index}" if count > 1 else "the prompt"


def _short(value, limit: int = 60) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int of more than sys.get_int_max_str_digits() digits
        return f"<an integer of {value.bit_length()} bits>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _size(num_bytes: int) -> str:
    unit = next(u for u in (3, 2, 1, 0) if num_bytes >= 1024**u or u == 0)
    return f"{num_bytes / 1024**unit:.1f} {('bytes', 'KiB', 'MiB', 'GiB')[unit]}"
