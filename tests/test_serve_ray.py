"""Scale-out on Ray Serve (``ortspec.serve.ray``): two CPU replicas of the tiny model on this
machine, one core each, behind Serve's router. Concurrent clients (streamed and not, through
the openai client) spread over both replicas (each response names its replica), and every
answer equals Session.generate's. Bounded: Ray and two replicas start and stop in seconds."""

from __future__ import annotations

import concurrent.futures
import os
import socket
from pathlib import Path

import pytest

import ortspec
from ortspec.errors import ConfigurationError

pytest.importorskip("ray.serve", reason="Ray Serve is in the test extra: pip install -e '.[test]'")
openai = pytest.importorskip("openai", reason="the openai client is in the test extra: pip install -e '.[test]'")

from ortspec.serve.ray import deploy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def main(", "the cache", "import os", "class A:"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_replicas_share_the_load_and_answer_as_generate(tokenized_model, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))  # Ray's
    # workers import this tree's ortspec
    with ortspec.Session(tokenized_model, num_speculative_tokens=2) as session:
        want = {p: session.generate(p, max_new_tokens=10) for p in PROMPTS}
        sampled = session.generate(PROMPTS[0], max_new_tokens=10, temperature=1.2, seed=3)
    with deploy(tokenized_model, replicas=2, port=free_port(), threads=1, num_speculative_tokens=2,
                max_batch_size=4) as served, \
            openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0) as client:

        def ask(i: int) -> tuple[str, str, str]:
            prompt, stream = PROMPTS[i % len(PROMPTS)], i % 3 == 0
            reply = client.completions.with_raw_response.create(model=session.manifest.dir.name, prompt=prompt,
                                                                max_tokens=10, stream=stream)
            replica, body = reply.headers["x-ortspec-replica"], reply.parse()
            text = "".join(c.choices[0].text for c in body if c.choices) if stream else body.choices[0].text
            return replica, prompt, text

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(ask, range(32)))
        assert all(text == want[prompt] for _, prompt, text in replies)
        answered = {replica: sum(r == replica for r, _, _ in replies) for replica, _, _ in replies}
        assert len(answered) == 2, answered  # both replicas served some of them
        seeded = client.completions.create(model=session.manifest.dir.name, prompt=PROMPTS[0], max_tokens=10,
                                           temperature=1.2, seed=3)
        assert seeded.choices[0].text == sampled  # the same on every replica


def test_a_deployment_the_machine_cannot_place_is_refused(tokenized_model):
    from ortspec.serve.ray import _check_resources

    with pytest.raises(ConfigurationError, match=r"3 replicas of 2 CPUs each need 6, and the Ray cluster has 2"):
        _check_resources({"CPU": 2.0}, 3, "cpu", 2)
    with pytest.raises(ConfigurationError, match=r"2 replicas of 1 GPU each need 2, and the Ray cluster has 0"):
        _check_resources({"CPU": 8.0}, 2, "cuda", 1)
    with pytest.raises(ConfigurationError, match=r"replicas=0 must be an integer >= 1"):
        deploy(tokenized_model, replicas=0)


def test_the_serve_command_checks_replicas_before_ray_starts(tokenized_model, capsys):
    from ortspec import cli

    assert cli.main(["serve", str(tokenized_model), "--replicas", "0"]) == 2
    assert "replicas=0 must be an integer >= 1" in capsys.readouterr().err
    assert cli.main(["serve", str(tokenized_model), "--replicas", "2", "--max-queue", "0"]) == 2
    assert "max_queue=0 must be an integer >= 1" in capsys.readouterr().err


def test_a_connection_cap_is_refused_with_replicas_before_ray_starts(tokenized_model, capsys):
    from ortspec import cli

    assert cli.main(["serve", str(tokenized_model), "--replicas", "2", "--max-connections", "8"]) == 2
    assert "Ray Serve's proxy holds the connections; leave --max-connections out" in capsys.readouterr().err
