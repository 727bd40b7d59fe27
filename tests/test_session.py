"""Session API: prompt forms, text in/out, and clear errors that leave the Session usable."""

from __future__ import annotations

import pytest

import ortspec
from tools.make_tiny_checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def model(tokenized_model):
    return tokenized_model


def test_prompt_forms(model):
    s = ortspec.Session(model, num_speculative_tokens=2)
    single = s.generate([1, 2, 3], max_new_tokens=5)
    assert isinstance(single, list) and len(single) == 5 and all(isinstance(t, int) for t in single)
    batch = s.generate([[1, 2, 3], [4]], max_new_tokens=5)
    assert batch[0] == single and len(batch[1]) == 5
    assert s.generate([1, 2, 3], max_new_tokens=0) == []
    text = s.generate("def main():", max_new_tokens=6)
    assert isinstance(text, str)
    assert s.generate(["def main():", "x"], max_new_tokens=6)[0] == text
    assert text == ortspec.Session(model).generate("def main():", max_new_tokens=6)


def test_stop_tokens_end_a_request_early(model):
    s = ortspec.Session(model, num_speculative_tokens=2)
    full = s.generate([5, 6, 7], max_new_tokens=12)
    stop = full[4]
    cut = s.generate([5, 6, 7], max_new_tokens=12, stop_tokens=[stop])
    assert cut == full[: full.index(stop) + 1]


@pytest.mark.parametrize("prompt,max_new,match", [
    ([], 4, "the prompt is empty"),
    ([[1, 2], []], 4, "prompt 1 is empty"),
    ([1, 2, 10_000], 4, "token id 10000 outside the vocabulary"),
    ([1, -3], 4, "token id -3 outside the vocabulary"),
    ([1, 2.5], 4, "must hold Python ints"),
    ([1] * 40, 9, "49 > max_length=48"),
    ([1, 2], -1, "max_new_tokens=-1"),
])
def test_bad_prompts(model, prompt, max_new, match):
    s = ortspec.Session(model, num_speculative_tokens=2)
    before = s.generate([9, 8, 7], max_new_tokens=6)
    with pytest.raises(ortspec.InputError, match=match):
        s.generate(prompt, max_new_tokens=max_new)
    assert s.generate([9, 8, 7], max_new_tokens=6) == before  # still usable, nothing corrupted


def test_generation_up_to_max_length(model):
    """Speculation near the end of the cache falls back to plain steps; still exact."""
    prompt = list(range(1, 41))
    greedy = ortspec.Session(model).generate(prompt, max_new_tokens=8)
    assert ortspec.Session(model, num_speculative_tokens=3).generate(prompt, max_new_tokens=8) == greedy


def test_model_dir_and_provider_errors(model, tmp_path):
    with pytest.raises(ortspec.ModelDirError, match="no manifest.json"):
        ortspec.Session(tmp_path)
    with pytest.raises(ortspec.ProviderError, match="provider 'tpu' is unknown"):
        ortspec.Session(model, provider="tpu")
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(ortspec.ProviderError, match="onnxruntime-gpu"):
            ortspec.Session(model, provider="cuda")
    with pytest.raises(ortspec.ConfigurationError, match="must be an integer >= 0"):
        ortspec.Session(model, num_speculative_tokens=-1)


def test_text_prompt_without_tokenizer(tmp_path):
    make_checkpoint(tmp_path / "ck", seed=32)
    ortspec.convert(tmp_path / "ck", tmp_path / "out", num_speculative_tokens=1, max_length=32, progress=False)
    s = ortspec.Session(tmp_path / "out")
    with pytest.raises(ortspec.InputError, match="no tokenizer.json"):
        s.generate("hello", max_new_tokens=3)
    assert len(s.generate([1, 2], max_new_tokens=3)) == 3


def test_cpu_sessions_do_not_spin(models):
    """A speculative step alternates between sessions; a CPU pool left spinning after its Run
    starves the next session's Run (2 threads: k=3 fell to 0.75-0.86x greedy). Every CPU
    session is made with spinning off."""
    from ortspec.runtime.graphs import NO_SPINNING

    session = ortspec.Session(models.converted("base"), num_speculative_tokens=2, threads=1)
    runners = [session.graphs[name] for name in ("decode", "verify_select_k2", "mtp_propose_k2")]
    assert all(r.session.get_session_options().get_session_config_entry(NO_SPINNING) == "0" for r in runners)


def test_cuda_sessions_run_their_cpu_nodes_on_the_calling_thread(models):
    """On CUDA a graph's CPU nodes are shape arithmetic: its session gets one intra-op thread
    unless threads are asked for (a pool per session spinning after each Run kept cores busy),
    where the CPU keeps ONNX Runtime's default."""
    import types

    from ortspec.runtime.graphs import SharedWeights

    session = ortspec.Session(models.converted("base"))
    weights = SharedWeights(session.manifest, session.graphs.arrays)
    assert weights.session_options([], None).intra_op_num_threads == 0  # the CPU: ONNX Runtime's default
    weights.arrays = types.SimpleNamespace(device="cuda", synchronize=lambda: None)
    assert weights.session_options([], None).intra_op_num_threads == 1
    assert weights.session_options([], 3).intra_op_num_threads == 3
