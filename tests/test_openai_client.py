"""ortspec serve through the official ``openai`` client, on loopback: completions and chat,
streamed and not, stop strings (one that spans tokens, streamed too), logprobs (equal to a
log-softmax of a forced decode's logits), n choices (equal to generate's rows for the seed),
echo, an unknown model (404 model_not_found), text parts, seeds; every answer's tokens equal
Session.generate's. Each test runs against the engine in a process of its own (what ortspec
serve runs) and in a thread beside uvicorn."""

from __future__ import annotations

import numpy as np
import pytest

from ortspec.runtime.model import TargetModel
from ortspec.serve import chat as chat_module
from ortspec.serve.engine_process import EngineProcess
from ortspec.serve.server import Server
from ortspec.speculative.logprobs import log_softmax
from tests.forced import forced_logits

openai = pytest.importorskip("openai", reason="the openai client is in the test extra: pip install -e '.[test]'")

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
PROMPT = "def main("


@pytest.fixture(scope="module", params=["process", "thread"])
def server(request, session):
    with pytest.MonkeyPatch.context() as patch:  # the fixture model has no chat template: give it one
        patch.setattr(chat_module.ChatTemplate, "from_model_dir", classmethod(lambda cls, _: cls(TEMPLATE)))
        options = dict(port=0, max_batch_size=4, model_name="tiny")
        with (Server.spawned(session.manifest.dir, dict(num_speculative_tokens=session.k), **options)
              if request.param == "process" else Server(session, **options)) as s:
            yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def chat_prompt(messages: list[dict]) -> str:
    return chat_module.ChatTemplate(TEMPLATE).render(messages)


def streamed(chunks) -> tuple[dict, dict, dict]:
    """(text, token ids, finish reason) per choice index of a stream's chunks."""
    text, ids, reasons = {}, {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            text[choice.index] = text.get(choice.index, "") + (piece or "")
            ids[choice.index] = ids.get(choice.index, []) + choice.token_ids
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return text, ids, reasons


def forced_logprobs(session, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """[len(tokens), V] log-softmax of the target's logits before each token, teacher-forced."""
    return log_softmax(forced_logits(session.graphs, prompt, tokens))


def test_models_and_an_unknown_model(client, server, session):
    assert [m.id for m in client.models.list()] == ["tiny"]
    for name in ("tiny", session.manifest.dir.name):  # the served name and the directory's
        assert client.completions.create(model=name, prompt=PROMPT, max_tokens=2).choices[0].text is not None
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
    assert caught.value.body["code"] == "model_not_found" and "gpt-4o" in caught.value.body["message"]


def test_completions_equal_generate_streamed_or_not(client, session):
    want = session.generate(PROMPT, max_new_tokens=12)
    ids = session.generate(session.tokenizer.encode(PROMPT).ids, max_new_tokens=12)
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12)
    text, token_ids, reasons = streamed(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12,
                                                                  stream=True))
    assert whole.choices[0].text == text[0] == want and whole.choices[0].token_ids == token_ids[0] == ids
    assert whole.usage.completion_tokens == len(ids) and whole.choices[0].finish_reason == reasons[0]


def test_chat_with_text_parts_equals_generate(client, session):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    joined = [messages[0], {"role": "user", "content": "h\ni"}]  # text parts join with newlines
    for sent, rendered in ((messages, messages), (parts, joined)):
        want = session.generate(chat_prompt(rendered), max_new_tokens=8)
        whole = client.chat.completions.create(model="tiny", messages=sent, max_tokens=8)
        text, _, _ = streamed(client.chat.completions.create(model="tiny", messages=sent, max_tokens=8, stream=True))
        assert whole.choices[0].message.content == text[0] == want
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    with pytest.raises(openai.BadRequestError, match=r"content\[0\] has type \"image_url\"; .* text parts only"):
        client.chat.completions.create(model="tiny", messages=image, max_tokens=2)


def a_stop_across_tokens(session, prompt: str, n: int) -> tuple[str, int]:
    """A stop string spanning two of generate's tokens, and how many tokens end with the one that completes it."""
    ids = session.generate(session.tokenizer.encode(prompt).ids, max_new_tokens=n, stop_tokens=[])
    pieces = [session.tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    for i in range(3, len(ids)):  # tokens i-1 and i, each of printable text, with no earlier occurrence
        before, token = pieces[i][len(pieces[i - 1]):], pieces[i + 1][len(pieces[i]):]
        stop = before[-1:] + token[:1]
        if len(stop) == 2 and stop.isprintable() and stop not in pieces[i] and "\ufffd" not in pieces[i + 1]:
            return stop, i + 1
    pytest.fail(f"no stop string across two tokens in {pieces[-1]!r}")


def test_a_stop_string_across_tokens_ends_the_text_before_it(client, session):
    stop, count = a_stop_across_tokens(session, PROMPT, 30)
    full = session.generate(PROMPT, max_new_tokens=30, stop_tokens=[])
    ids = session.generate(session.tokenizer.encode(PROMPT).ids, max_new_tokens=30, stop_tokens=[])
    assert session.generate(PROMPT, max_new_tokens=30, stop_tokens=[], stop=[stop]) == full[: full.index(stop)]
    body = dict(model="tiny", prompt=PROMPT, max_tokens=30, stop=["never there", stop])
    whole = client.completions.create(**body).choices[0]
    text, token_ids, reasons = streamed(client.completions.create(**body, stream=True))
    assert whole.text == text[0] == full[: full.index(stop)] and whole.finish_reason == reasons[0] == "stop"
    assert whole.token_ids == token_ids[0] == ids[:count]  # up to the token that completed the stop string
    messages = [{"role": "user", "content": "hi"}]
    full = session.generate(chat_prompt(messages), max_new_tokens=20)
    stop = full[5:8]  # a bare string, as chat clients send it
    body = dict(model="tiny", messages=messages, max_tokens=20, stop=stop)
    text, _, reasons = streamed(client.chat.completions.create(**body, stream=True))
    assert client.chat.completions.create(**body).choices[0].message.content == text[0] == full[: full.index(stop)]
    assert reasons[0] == "stop"


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_logprobs_are_the_log_softmax_of_a_forced_decode(client, session, temperature):
    prompt = session.tokenizer.encode(PROMPT).ids
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, logprobs=3, temperature=temperature,
                                      seed=5).choices[0]
    want = forced_logprobs(session, prompt, reply.token_ids)  # [10, V]
    at = np.arange(len(reply.token_ids))
    np.testing.assert_allclose(reply.logprobs.token_logprobs, want[at, reply.token_ids], atol=1e-4)
    for row, top in zip(want, reply.logprobs.top_logprobs):  # {text: logprob}: two tokens may share a text
        best = np.sort(row)[::-1][:3]
        assert 1 <= len(top) <= 3 and all(np.isclose(best, value, atol=1e-4).any() for value in top.values())
    assert reply.logprobs.text_offset[0] == 0 and reply.logprobs.text_offset == sorted(reply.logprobs.text_offset)
    assert reply.token_ids == session.generate(prompt, max_new_tokens=10, temperature=temperature, seed=5)

    chat = [{"role": "user", "content": "hi"}]
    answer = client.chat.completions.create(model="tiny", messages=chat, max_tokens=6, logprobs=True, top_logprobs=2,
                                            temperature=temperature, seed=5).choices[0]
    entries = answer.logprobs.content
    want = forced_logprobs(session, session.tokenizer.encode(chat_prompt(chat)).ids, answer.token_ids)
    np.testing.assert_allclose([e.logprob for e in entries], want[np.arange(6), answer.token_ids], atol=1e-4)
    for entry, row in zip(entries, want):  # the two most probable tokens of each row, in order
        np.testing.assert_allclose([t.logprob for t in entry.top_logprobs], np.sort(row)[::-1][:2], atol=1e-4)
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace") == answer.message.content


def test_streamed_logprobs_equal_the_whole_ones(client):
    body = dict(model="tiny", prompt=PROMPT, max_tokens=10, logprobs=2)
    whole = client.completions.create(**body).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in client.completions.create(**body, stream=True)
              if c.choices and c.choices[0].logprobs]
    assert sum((c.token_logprobs for c in chunks), []) == whole.token_logprobs
    assert sum((c.text_offset for c in chunks), []) == whole.text_offset


def test_n_choices_equal_generate_rows_for_the_seed(client, session):
    prompt = session.tokenizer.encode(PROMPT).ids
    want = session.generate([prompt] * 3, max_new_tokens=10, temperature=1.3, top_p=0.9, seed=7)
    body = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=1.3, top_p=0.9, seed=7, n=3)
    whole = client.completions.create(**body)
    _, token_ids, reasons = streamed(client.completions.create(**body, stream=True))
    assert [c.index for c in whole.choices] == [0, 1, 2] and len(reasons) == 3
    assert [c.token_ids for c in whole.choices] == [token_ids[i] for i in range(3)] == want
    assert whole.usage.prompt_tokens == len(prompt) and whole.usage.completion_tokens == sum(map(len, want))
    assert len({tuple(w) for w in want}) > 1  # the choices draw different streams
    with pytest.raises(openai.BadRequestError, match=r"n=5 must be an integer in \[1, 4\]"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=5)


def test_n_choices_share_one_prefill(client, server, session, monkeypatch):
    """A request's n choices are admitted together and prefilled once (their rows start from
    copies of its states; counted where the engine runs in this process), with the tokens of n
    separate rows."""
    prompt, prefilled, prefill = session.tokenizer.encode(PROMPT).ids, [], TargetModel.prefill
    monkeypatch.setattr(TargetModel, "prefill", lambda self, rows, ids, positions, **options: (
        prefilled.extend(map(tuple, ids.tolist())), prefill(self, rows, ids, positions, **options))[1])
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.9, seed=3, n=4)
    assert prefilled.count(tuple(prompt)) == (0 if isinstance(server.engine, EngineProcess) else 1)
    monkeypatch.undo()
    assert [c.token_ids for c in whole.choices] == session.generate([prompt] * 4, max_new_tokens=8, temperature=0.9,
                                                                    seed=3)


def test_a_seed_reproduces_a_sampled_answer(client, session):
    body = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.1, seed=123)
    first, second = (client.completions.create(**body).choices[0] for _ in range(2))
    other = client.completions.create(**{**body, "seed": 124}).choices[0]
    assert first.token_ids == second.token_ids == session.generate(session.tokenizer.encode(PROMPT).ids,
                                                                   max_new_tokens=12, temperature=1.1, seed=123)
    assert other.token_ids != first.token_ids


def test_echo_puts_the_prompt_before_the_completion(client, session):
    want = session.generate(PROMPT, max_new_tokens=6)
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, echo=True).choices[0].text == \
        PROMPT + want
    text, _, _ = streamed(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, echo=True, stream=True))
    assert text[0] == PROMPT + want
    with pytest.raises(openai.BadRequestError, match="echo with logprobs"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, echo=True, logprobs=1)
