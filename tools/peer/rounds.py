"""Interleaved timed rounds over every configuration, and the token comparisons.

A round runs every live configuration over every prompt (batch 1), prompt by prompt (each
prompt through every configuration before the next), the configuration order rotated by one
each round so that no configuration always runs first (warm caches, clocks). Each round keeps
wall and process CPU time: on a shared machine other processes move the first, barely the second.
A configuration that raises is marked failed with its message and left out of later rounds:
one broken peer configuration never stops the others. Rounds stop early when the time budget
would be exceeded (estimated from the first round), but at least one round always runs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from .progress import say


@dataclass
class ConfigRun:
    """What one configuration did over the rounds."""

    name: str
    side: str
    round_seconds: list[float] = field(default_factory=list)
    round_cpu_seconds: list[float] = field(default_factory=list)  # process CPU time: what other processes barely move
    round_tokens: list[int] = field(default_factory=list)
    outputs: dict[int, list[int]] = field(default_factory=dict)  # prompt index -> first round's tokens
    unstable: set[int] = field(default_factory=set)  # prompts whose tokens changed between rounds
    error: str | None = None

    def record(self, index: int, tokens: list[int]) -> None:
        if index not in self.outputs:
            self.outputs[index] = tokens
        elif self.outputs[index] != tokens:
            self.unstable.add(index)

    def summary(self) -> dict:
        """tok/s and ms/token as the median over rounds, with the spread (min, max) over rounds."""
        rates = [t / s for t, s in zip(self.round_tokens, self.round_seconds) if s > 0]
        out = {"name": self.name, "side": self.side, "rounds": len(rates), "error": self.error,
               "unstable_prompts": len(self.unstable)}
        if rates:
            out.update(tokens_per_second=statistics.median(rates), tokens_per_second_min=min(rates),
                       tokens_per_second_max=max(rates),
                       ms_per_token=statistics.median(1000 / r for r in rates))
        cpu_rates = [t / s for t, s in zip(self.round_tokens, self.round_cpu_seconds) if s > 0]
        if cpu_rates:
            out["tokens_per_cpu_second"] = statistics.median(cpu_rates)
        return out


def prompt_key(prompt) -> int:
    """Outputs are keyed by prompt: code prompts 0.., held-out prompts 1000.."""
    return prompt.index if prompt.set == "code" else 1000 + prompt.index


def fail(run: ConfigRun, where: str, err: BaseException) -> None:
    run.error = f"{where}: {type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    say(f"{run.name} failed ({run.error}); continuing without it")


def warm_up(runners: dict, runs: dict[str, ConfigRun], prompt: list[int], max_new_tokens: int) -> None:
    """One untimed generation per configuration: first runs allocate, load and capture graphs."""
    for name, runner in runners.items():
        try:
            runner.generate(prompt, max_new_tokens)
        except Exception as err:  # noqa: BLE001 - any failure of one configuration is reported, not fatal
            fail(runs[name], "warm-up", err)


def one_round(runners: dict, runs: dict[str, ConfigRun], prompts, max_new_tokens: int, rotation: int) -> None:
    """Prompt by prompt, every live configuration on it (order rotated by `rotation`), so a
    stretch of load from outside falls on all configurations alike; wall and CPU time summed."""
    names = [n for n in runners if runs[n].error is None]
    names = names[rotation % len(names):] + names[:rotation % len(names)] if names else []
    totals = {name: [0.0, 0.0, 0] for name in names}  # wall s, CPU s, tokens
    for prompt in prompts:
        for name in [n for n in names if runs[n].error is None]:
            try:
                start, cpu_start = time.perf_counter(), time.process_time()
                out = runners[name].generate(prompt.ids, max_new_tokens)
                totals[name][0] += time.perf_counter() - start
                totals[name][1] += time.process_time() - cpu_start
            except Exception as err:  # noqa: BLE001
                fail(runs[name], f"round {rotation + 1}", err)
                continue
            totals[name][2] += len(out)
            runs[name].record(prompt_key(prompt), out)
    for name, (seconds, cpu_seconds, tokens) in totals.items():
        if runs[name].error is None:
            runs[name].round_seconds.append(seconds)
            runs[name].round_cpu_seconds.append(cpu_seconds)
            runs[name].round_tokens.append(tokens)


def run_rounds(runners: dict, prompts, max_new_tokens: int, rounds: int, budget_s: float,
               on_round=None) -> dict[str, ConfigRun]:
    """Warm-up, then up to `rounds` interleaved rounds within `budget_s` seconds of rounds."""
    runs = {name: ConfigRun(name, runner.side) for name, runner in runners.items()}
    say(f"warm-up of {len(runners)} configurations")
    warm_up(runners, runs, prompts[0].ids, min(16, max_new_tokens))
    start = time.perf_counter()
    for r in range(rounds):
        round_start = time.perf_counter()
        for runner in runners.values():
            runner.count.steps = runner.count.tokens = 0  # tokens/step of the last round only
        one_round(runners, runs, prompts, max_new_tokens, r)
        if on_round:
            on_round(runs, r + 1)
        spent, last = time.perf_counter() - start, time.perf_counter() - round_start
        say(f"round {r + 1} of {rounds}: {last:.1f} s")
        if r + 1 < rounds and spent + last > budget_s:
            say(f"stopping after {r + 1} of {rounds} rounds (time budget {budget_s:.0f} s)")
            break
    return runs


def differing_prompts(run: ConfigRun, reference: ConfigRun | None) -> int | None:
    """How many prompts' tokens differ from the reference's (None: nothing to compare)."""
    if reference is None or not reference.outputs or not run.outputs:
        return None
    shared = set(run.outputs) & set(reference.outputs)
    return sum(run.outputs[i] != reference.outputs[i] for i in shared)
