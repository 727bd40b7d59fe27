"""Every bad argument of Session(...), generate(...), batcher(...) and add_request(...) gets an
OrtspecError subclass naming the argument, the value and what to do, raised before any work
starts; the Session generates correctly afterwards. Token ids may come as tuples, numpy integer
arrays and numpy integers, and give exactly the tokens of the equivalent list[int]."""

from __future__ import annotations

import numpy as np
import pytest

import ortspec
from ortspec import validation
from ortspec.speculative.requests import Request

PROMPT, BATCH, NEW = [3, 14, 15], [[3, 14, 15], [92, 65]], 6


@pytest.fixture(scope="module")
def model(tokenized_model):
    return tokenized_model


@pytest.fixture(scope="module")
def session(model):
    return ortspec.Session(model, num_speculative_tokens=2)


@pytest.fixture(scope="module")
def expected(model):
    """Greedy references from a Session no test has touched."""
    plain = ortspec.Session(model)
    return {"one": plain.generate(PROMPT, max_new_tokens=NEW), "batch": plain.generate(BATCH, max_new_tokens=NEW)}


def raises_before_work(session, error, match, call):
    """call() raises `error` matching `match` without prefilling or stepping anything, and the
    Session then still generates correctly."""
    before = {key: session.stats[key] for key in ("requests", "prompt_tokens", "steps")}
    with pytest.raises(error, match=match) as info:
        call()
    assert {key: session.stats[key] for key in before} == before, "work started before the error"
    return info.value


def assert_usable(session, expected):
    assert session.generate(PROMPT, max_new_tokens=NEW) == expected["one"]
    assert session.generate(BATCH, max_new_tokens=NEW) == expected["batch"]


# -- Session options --------------------------------------------------------------------------
@pytest.mark.parametrize("options,error,match", [
    (dict(threads=1.5), ortspec.ConfigurationError, r"threads=1.5 must be an integer >= 0; got float"),
    (dict(threads="2"), ortspec.ConfigurationError, r"threads='2' must be an integer >= 0; got str"),
    (dict(threads=True), ortspec.ConfigurationError, r"threads=True must be an integer >= 0; got bool"),
    (dict(threads=validation.usable_cores() + 1), ortspec.ConfigurationError,
     rf"exceeds the {validation.usable_cores()} cores this process may use; use threads <= "),
    (dict(num_speculative_tokens=True), ortspec.ConfigurationError, r"num_speculative_tokens=True .* got bool"),
    (dict(num_speculative_tokens=2.0), ortspec.ConfigurationError, r"num_speculative_tokens=2.0 .* got float"),
    (dict(pipeline_stages=True), ortspec.ConfigurationError, r"pipeline_stages=True .* got bool"),
    (dict(devices=[True]), ortspec.ConfigurationError, r"devices=\[True\] must be a list of device indices"),
    (dict(cuda_graphs="no"), ortspec.ConfigurationError, r"cuda_graphs='no' must be True or False"),
    (dict(commit=None), ortspec.ConfigurationError, r"commit=None is unknown; use one of 'select', 'readvance'"),
    (dict(provider=["cpu"]), ortspec.ProviderError, r"provider=\['cpu'\] must be a string"),
    (dict(exact="yes"), ortspec.ConfigurationError, r"exact='yes' must be True or False"),
    (dict(exact=True, exact_batch_size=0), ortspec.ConfigurationError, r"exact_batch_size=0 must be an integer >= 1"),
    (dict(exact=True, exact_batch_size=2.0), ortspec.ConfigurationError, r"exact_batch_size=2.0 .* got float"),
    (dict(exact=True, exact_k=4), ortspec.ConfigurationError, r"exact_k=4 exceeds K=3 .* use exact_k <= 3"),
    (dict(exact=True, exact_k=1, num_speculative_tokens=2), ortspec.ConfigurationError,
     r"num_speculative_tokens=2 exceeds exact_k=1: .* use k <= 1 or exact_k >= 2"),
])
def test_bad_session_options(model, session, expected, options, error, match):
    raises_before_work(session, error, match, lambda: ortspec.Session(model, **options))
    assert_usable(session, expected)


def test_model_dir_must_be_a_path(session, expected):
    raises_before_work(session, ortspec.ConfigurationError, r"model_dir=5 must be a path",
                       lambda: ortspec.Session(5))
    assert_usable(session, expected)


def test_k_beyond_the_converter_names_a_k_it_accepts(model, session):
    """K=3 here: k=5 may be reconverted for; k=9 may not (the converter stops at 8)."""
    from ortspec.converter import MAX_SPECULATIVE_TOKENS

    with pytest.raises(ortspec.ConfigurationError, match=r"reconvert with --num-speculative-tokens 5\."):
        ortspec.Session(model, num_speculative_tokens=5)
    error = raises_before_work(session, ortspec.ConfigurationError, r"exceeds K=3",
                               lambda: ortspec.Session(model, num_speculative_tokens=MAX_SPECULATIVE_TOKENS + 1))
    assert f"--num-speculative-tokens {MAX_SPECULATIVE_TOKENS} " in str(error)
    assert f"--num-speculative-tokens {MAX_SPECULATIVE_TOKENS + 1}" not in str(error)


def test_numpy_integer_options_equal_python_ints(model, expected):
    session = ortspec.Session(model, num_speculative_tokens=np.int64(2), threads=np.int32(1),
                              pipeline_stages=np.int64(1), devices=np.array([0]))
    assert session.k == 2 and type(session.k) is int
    assert_usable(session, expected)


def test_threads_bound_is_the_affinity_mask():
    assert validation.threads(None) is None and validation.threads(0) is None
    assert validation.threads(2, cores=2) == 2
    with pytest.raises(ortspec.ConfigurationError, match=r"threads=10000 exceeds the 2 cores .* threads <= 2"):
        validation.threads(10000, cores=2)


# -- generate ---------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", [
    tuple(PROMPT), np.array(PROMPT), np.array(PROMPT, np.int32), np.array(PROMPT, np.uint16),
    [np.int64(t) for t in PROMPT], [np.int32(3), 14, np.uint8(15)],
], ids=["tuple", "int64-array", "int32-array", "uint16-array", "list-of-np.int64", "mixed-ints"])
def test_numpy_and_tuple_prompts_equal_lists(session, expected, prompt):
    out = session.generate(prompt, max_new_tokens=NEW)
    assert out == expected["one"] and all(type(t) is int for t in out)


@pytest.mark.parametrize("batch", [
    [np.array([3, 14, 15]), (92, 65)], ((3, 14, 15), [92, 65]),
    [np.array([3, 14, 15], np.int32), np.array([92, 65], np.uint64)],
], ids=["array-and-tuple", "tuple-of-sequences", "list-of-arrays"])
def test_numpy_and_tuple_batches_equal_lists(session, expected, batch):
    assert session.generate(batch, max_new_tokens=NEW) == expected["batch"]


def test_a_2d_array_is_a_batch_of_its_rows(session):
    rows = np.array([[15, 14, 3], [92, 65, 35], [7, 7, 7]])
    lists = rows.tolist()
    assert session.generate(rows, max_new_tokens=NEW) == session.generate(lists, max_new_tokens=NEW)
    flipped = rows[::-1, ::2]  # a strided view, not contiguous
    assert session.generate(flipped, max_new_tokens=NEW) == session.generate(flipped.tolist(), max_new_tokens=NEW)


@pytest.mark.parametrize("prompt,match", [
    (np.array([3.0, 14.0]), r"the prompt is a numpy float64 array .*cast with \.astype\(np\.int64\)"),
    (np.array([True, False]), r"the prompt is a numpy bool array"),
    ([3, True], r"the prompt must hold Python ints or numpy integers .* got True \(bool\) at position 1"),
    ([3, np.float32(1)], r"must hold Python ints .* \(float32\) at position 1"),
    ([3, None], r"got None \(NoneType\) at position 1"),
    ([[3, 4], [5, [6]]], r"prompt 1 must hold .* got \[6\] \(list\) at position 1"),
    ([3, [4]], r"the batch mixes prompts and single values \(element 0 is 3\)"),
    (np.array([[3, -4]]), r"the prompt has token id -4 outside the vocabulary \[0, 512\) at position 1"),
    ([[3], np.array([5, 10_000])], r"prompt 1 has token id 10000 outside the vocabulary"),
    (np.zeros((2, 2, 2), np.int64), r"must be 1-D \(one prompt\) or 2-D \(a batch"),
    (np.zeros((0, 3), np.int64), r"the batch is empty"),
    (5, r"prompt=5 \(int\) is not a prompt; pass token ids"),
    ({3, 14}, r"\(set\) is not a prompt"),
    (None, r"prompt=None \(NoneType\) is not a prompt"),
    ("", r"the prompt is an empty string"),
    (["def f():", 3], r"mixes text and token ids \(element 1 is 3\)"),
])
def test_bad_prompts(session, expected, prompt, match):
    raises_before_work(session, ortspec.InputError, match, lambda: session.generate(prompt, max_new_tokens=NEW))
    assert_usable(session, expected)


def test_stop_tokens_accept_one_id_and_collections(session):
    full = session.generate(PROMPT, max_new_tokens=12)
    stop = full[4]
    cut = full[: full.index(stop) + 1]
    for form in (stop, np.int64(stop), (stop,), {stop}, np.array([stop])):
        assert session.generate(PROMPT, max_new_tokens=12, stop_tokens=form) == cut, form
    assert session.generate(PROMPT, max_new_tokens=12, stop_tokens=[]) == full


@pytest.mark.parametrize("stop_tokens,match", [
    ([[1]], r"stop_tokens=\[\[1\]\] holds \[1\] \(list\); each stop token must be an integer token id"),
    ("abc", r"stop_tokens='abc' .*stop strings go to stop="),
    ([None], r"stop_tokens=\[None\] holds None"),
    ([True], r"holds True \(bool\)"),
    ([-1], r"holds -1 \(int\); .* in \[0, 512\)"),
    ([512], r"holds 512 \(int\)"),
    (2.0, r"stop_tokens=2.0 must be a token id or a list of token ids"),
])
def test_bad_stop_tokens(session, expected, stop_tokens, match):
    raises_before_work(session, ortspec.InputError, match,
                       lambda: session.generate(PROMPT, max_new_tokens=NEW, stop_tokens=stop_tokens))
    assert_usable(session, expected)


@pytest.mark.parametrize("keywords,match", [
    (dict(k=2), r"unknown keyword 'k'; it takes prompt, max_new_tokens, stop_tokens, temperature, top_k, top_p, "
                r"seed, min_p, stream, stop and the decoder hooks make_drafts, on_commit, fixed_rows, pipelined, "
                r"fused_verify, background_prefill\. "
                r"num_speculative_tokens is a Session option"),
    (dict(max_tokens=4), r"unknown keyword 'max_tokens'.* Did you mean 'max_new_tokens'\?"),
    (dict(engine=None), r"unknown keyword 'engine'"),
    (dict(max_new_tokens=True), r"max_new_tokens=True must be an integer >= 0; got bool"),
    (dict(max_new_tokens=4.0), r"max_new_tokens=4.0 .* got float"),
    (dict(on_commit=5), r"on_commit=5 must be a callable"),
    (dict(fixed_rows="yes"), r"fixed_rows='yes' must be True, False or None"),
    (dict(pipelined=1), r"pipelined=1 must be True, False or None"),
    (dict(background_prefill="no"), r"background_prefill='no' must be True, False or None"),
    (dict(fused_verify=None), r"fused_verify=None must be True .* or False"),
])
def test_bad_generate_keywords(session, expected, keywords, match):
    raises_before_work(session, ortspec.InputError, match,
                       lambda: session.generate(PROMPT, **{"max_new_tokens": NEW, **keywords}))
    assert_usable(session, expected)


def test_text_prompts_still_work(session):
    assert session.generate(("def f():", "x = "), max_new_tokens=4) == [
        session.generate("def f():", max_new_tokens=4), session.generate("x = ", max_new_tokens=4)]


# -- batcher ----------------------------------------------------------------------------------
@pytest.mark.parametrize("options,match", [
    (dict(max_batch_size=True), r"max_batch_size=True must be an integer >= 1; got bool"),
    (dict(max_batch_size=2.0), r"max_batch_size=2.0 .* got float"),
    (dict(max_batch_size=10**9), r"a batch of 1000000000 requests needs .* of state buffers .* run at most"),
    (dict(max_new_tokens=4), r"batcher\(\) got an unknown keyword 'max_new_tokens'.* batcher\.add_request"),
])
def test_bad_batcher_options(session, expected, options, match):
    raises_before_work(session, ortspec.InputError, match, lambda: session.batcher(**options))
    assert_usable(session, expected)


def test_bad_requests_leave_the_batcher_usable(session, expected):
    batcher = session.batcher(max_batch_size=2)
    for call, match in [
        (lambda: batcher.add_request([[3], [4]]), r"add_request takes one prompt, got a batch of 2"),
        (lambda: batcher.add_request(PROMPT, max_new_tokens=0), r"max_new_tokens=0 must be an integer >= 1 \(a "),
        (lambda: batcher.add_request(PROMPT, stop_tokens="abc"), r"stop strings go to stop="),
        (lambda: batcher.add_request((3, 2.5)), r"got 2.5 \(float\) at position 1"),
        (lambda: batcher.result([0]), r"request_id=\[0\] must be an integer id returned by add_request"),
    ]:
        raises_before_work(session, ortspec.InputError, match, call)
    rid = batcher.add_request(np.array(PROMPT), max_new_tokens=NEW)
    while batcher.pending:
        batcher.step()
    assert batcher.result(np.int64(rid)) == expected["one"]
    assert_usable(session, expected)


def test_add_request_encodes_text(session):
    """A str prompt is encoded with the model's tokenizer; result() gives token ids."""
    text = "def main():"
    batcher = session.batcher(max_batch_size=1)
    rid = batcher.add_request(text, max_new_tokens=NEW)
    while batcher.pending:
        batcher.step()
    ids = session.tokenizer.encode(text).ids
    assert batcher.result(rid) == session.generate(ids, max_new_tokens=NEW)
    assert session.tokenizer.decode(batcher.result(rid)) == session.generate(text, max_new_tokens=NEW)


def test_batch_memory_bound_names_the_need():
    states = {"s": {"shape": ["B", 256, 1024], "dtype": "float32"}}  # 1 MiB per request
    validation.batch_fits_memory(64, states, "cpu", memory=64 << 20)
    with pytest.raises(ortspec.InputError, match=r"65 requests needs 65.0 MiB .* \(1.0 MiB each\), more than .* "
                                                  r"64.0 MiB of memory; run at most 64 requests at once"):
        validation.batch_fits_memory(65, states, "cpu", memory=64 << 20)
    validation.batch_fits_memory(65, states, "cuda:0", memory=64 << 20)  # device memory: not the host's


def test_planted_work_before_the_check_is_caught(session, monkeypatch):
    """Planted bug: generate prefills a request before checking its arguments. The 'before any
    work' check of these tests must see it."""
    check = session.prompts.token_prompts

    def late_check(prompt):
        session._generate_requests([Request(row=0, prompt=[1], max_new_tokens=1)], {})  # work first
        return check(prompt)

    monkeypatch.setattr(session.prompts, "token_prompts", late_check)
    with pytest.raises(AssertionError, match="work started before the error"):
        raises_before_work(session, ortspec.InputError, "empty string", lambda: session.generate("", max_new_tokens=2))
