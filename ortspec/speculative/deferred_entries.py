"""MTP entries left for later: what the head's catch-up would have read on greedy steps of auto k.

When ``num_speculative_tokens="auto"`` chooses k = 0, a step is a plain decode and the MTP head
does not run (that would make k = 0 dearer than greedy). Entry p of the head's cache still has
to exist before the head drafts again, so each such step leaves here, per row, the target's
hidden state at p (on the host), the token that followed (x_{p+1}) and p. The next catch-up
(``Decoder``) runs the head over all of a row's entries at once, the way the prefill's
catch-up runs over a prompt, and then drafts from the last of them.

Prompts wait here too: a prefill whose next step is a plain decode leaves its prompt's entries
0..n-1, and so does every prefill of a generate call of several prefill groups (``Decoder.steps``:
on CUDA each request is prefilled alone). ``take_prompts`` then runs the head once per run of
consecutive rows instead of once per group: prompts of different lengths padded to the longest,
row j's entries past last[j] = n_j - 1 padding the head computes but never writes (as a verify's
rejected drafts). On the CPU with float32 activations a row's entries then have the bits of its
own run's (tests/test_merged_prompts.py checks the states); with float16 activations they do not
(the head's key.mtp of a one-token prompt padded to 17 rows differed by 9.5e-7), so there
(``pad_lengths=False``) only prompts of one length share a run.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import InternalError
from ..runtime.states import Rows

MAX_STEPS = 256  # a plain stretch's steps whose entries wait before the head catches up anyway


class DeferredEntries:
    """The entries of the plain decode steps since the last catch-up, kept step by step (a step's
    work here is one append, whatever its rows: the pipelined loop does it while the GPU runs).

    A request that joins mid-stretch (``drop_rows`` at its join) has entries from its first step
    on, fewer than the rows beside it: the catch-up pads its row past its last entry, as it pads
    prompts (``take``), so a join costs no catch-up of the others (it had cost the CPU's k = 0 of
    auto 8% at 8 rows, a catch-up per join). On the CPU a finished request's row leaves the steps
    (its entries are dropped at the catch-up). Waiting prompts are kept per prefill group and run
    before the steps' entries, one run per run of consecutive rows (``take_prompts``)."""

    def __init__(self, arrays, pad_lengths: bool = True) -> None:
        self.arrays = arrays
        self.pad_lengths = pad_lengths  # whether prompts of different lengths share a run (``take_prompts``)
        self._steps: list[tuple[np.ndarray, ...]] = []  # per step: rows [b], hidden [b, H] host, x_{p+1} [b], p [b]
        self._last: tuple[list, Rows] | None = None  # the latest step's requests and rows
        self._joined: dict[int, int] = {}  # row -> the first kept step of its request (joined mid-stretch)
        self._dtype = None  # the hidden states' dtype on their device
        self._prompts: list[PromptEntries] = []  # prefill groups whose head entries 0..n-1 wait

    def __bool__(self) -> bool:
        """Whether any entry waits (the head's state is then behind the target's)."""
        return self.has_steps or bool(self._prompts)

    @property
    def has_steps(self) -> bool:
        """Whether plain decode steps left entries."""
        return self._last is not None

    @property
    def full(self) -> bool:
        """MAX_STEPS steps' entries wait: the head catches up although no step drafts yet, which
        bounds the host memory they hold (MAX_STEPS x rows x hidden) and the catch-up's size."""
        return len(self._steps) >= MAX_STEPS

    def add_prompts(self, requests: list, rows: Rows, hidden, next_ids: np.ndarray, source=None) -> None:
        """One prefill group's entries 0..n-1: hidden [B, n, H] on its device (downloaded now),
        next_ids [R, n] (x_{p+1}: the prompt's next token, then the first generated one); source
        [R]: each request's row of hidden (default: request j's is j)."""
        host = self.arrays.download(hidden)
        self._prompts.append(PromptEntries.of_group(requests, rows.indices.copy(),
                                                    host if source is None else host[np.asarray(source)],
                                                    hidden.dtype, np.array(next_ids, np.int64)))

    def drop_rows(self, rows: Rows) -> None:
        """Forgets every waiting entry of these rows, its prompt's and its steps' (a new request
        takes them over: its own entries start with the next step)."""
        kept = [group.without(rows.indices) for group in self._prompts]
        self._prompts = [group for group in kept if group is not None]
        for row in rows.indices.tolist():
            self._joined[row] = len(self._steps)

    def take_prompts(self) -> list[tuple]:
        """Every waiting prompt entry, forgetting them: one catch-up per run of consecutive rows
        (a run is one contiguous range, as CUDA's states need; without pad_lengths also of one
        prompt length), in row order: per run (requests, rows, hidden [B, n, H] on the device,
        next_ids [B, n], positions [B, n] = 0..n-1, last [B] = n_j - 1), n its longest prompt."""
        groups, self._prompts = self._prompts, []
        if not groups:
            return []
        waiting = PromptEntries.padded(groups).rows_at(np.argsort(np.concatenate([g.rows for g in groups]),
                                                                  kind="stable"))  # every row, in row order
        return [waiting.rows_at(run).catch_up_inputs(self.arrays) for run in self._runs(waiting.rows, waiting.lengths)]

    def _runs(self, order: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
        """Indices into order [B] (ascending) of its runs of consecutive values (a range of rows,
        as CUDA's states need), without pad_lengths also of one length (lengths [B])."""
        breaks = np.diff(order) != 1  # [B - 1]: entry j + 1 does not follow entry j
        if not self.pad_lengths:
            breaks |= np.diff(lengths) != 0
        return np.split(np.arange(len(order)), np.flatnonzero(breaks) + 1)

    def add(self, requests: list, rows: Rows, hidden, next_ids: np.ndarray, positions: np.ndarray) -> None:
        """One plain decode step: hidden [B, W, H] on its device (row 0 is the step's token),
        next_ids [B], positions [B]. Downloads the hidden rows (the host waits for the step)."""
        self.add_host(requests, rows, self.arrays.download(hidden)[:, 0], hidden.dtype, next_ids, positions)

    def add_host(self, requests: list, rows: Rows, hidden: np.ndarray, dtype, next_ids: np.ndarray,
                 positions: np.ndarray) -> None:
        """One plain decode step whose hidden rows are on the host already: hidden [B, H] as
        ``arrays.download`` gives them (bfloat16: its uint16 bit pattern), dtype: theirs on the
        device. A decode run reads them back a step late (``runtime.decode_run``)."""
        self._dtype = dtype
        self._steps.append((rows.indices, hidden, np.array(next_ids, np.int64), np.array(positions, np.int64)))
        self._last = (requests, rows)

    def take(self) -> list[tuple]:
        """Every entry of the latest step's rows, forgetting all: per run of rows (one run; split
        where a row taken over since the latest step, with no entries yet, is left out, and with
        pad_lengths=False where the count of entries changes) (requests, rows, hidden [B, m,
        H] on the device, next_ids [B, m], positions [B, m], last [B] = m_j - 1), row j's entries
        from its request's first kept step on, columns past last[j] padding (its last entry
        repeated) that the head computes but never writes."""
        requests, rows = self._last
        wanted = rows.indices
        start = np.array([self._joined.get(row, 0) for row in wanted.tolist()], np.int64)  # [B]
        columns = [_rows_of(step, wanted) for step in self._steps]  # S x (present [B], hidden [B, H], x [B], p [B])
        self._steps, self._last, self._joined = [], None, {}
        present = np.stack([c[0] for c in columns], axis=1)  # [B, S]
        steps = present.shape[1]
        missed = ~present & (np.arange(steps)[None] >= start[:, None])  # [B, S]: a step of its request without it
        if missed.any():
            j, i = np.argwhere(missed)[0]
            raise InternalError(f"deferred MTP entries out of step: row {wanted[j]} of the latest step missed an "
                                f"earlier step of its request (step {i} of {steps}). A bug of num_speculative_tokens="
                                "\"auto\": report it; a fixed num_speculative_tokens runs without deferred entries.")
        hidden, next_ids, positions = (np.stack([c[part] for c in columns], axis=1) for part in (1, 2, 3))  # [B, S..]
        counts = steps - np.minimum(start, steps)  # [B]; 0: taken over since the latest step (its prompt waits)
        kept = np.flatnonzero(counts)  # a row left out between two splits them: one range each side
        runs = []
        for run in (kept[at] for at in self._runs(kept, counts[kept]) if at.size):
            m = int(counts[run].max())
            cols = np.minimum(start[run, None] + np.arange(m)[None], steps - 1)  # [b, m]: past the last, the last again
            at = run[:, None]
            runs.append(([requests[j] for j in run.tolist()], Rows(wanted[run]),
                         self.arrays.from_host(hidden[at, cols], self._dtype), next_ids[at, cols], positions[at, cols],
                         counts[run] - 1))
        return runs


@dataclasses.dataclass
class PromptEntries:
    """Waiting head entries 0..lengths[j]-1 of prompts (one prefill group's, or several padded
    to the longest): columns past lengths[j] - 1 are padding (zeros), never written."""

    requests: list
    rows: np.ndarray  # [B]
    hidden: np.ndarray  # [B, n, H] on the host, as arrays.download gives it
    dtype: object  # the hidden states' dtype on their device
    next_ids: np.ndarray  # [B, n]
    lengths: np.ndarray  # [B] each row's prompt length n_j <= n

    @classmethod
    def of_group(cls, requests: list, rows: np.ndarray, hidden: np.ndarray, dtype, next_ids: np.ndarray):
        """One prefill group's entries: prompts of one length n (hidden [B, n, H], next_ids [B, n])."""
        return cls(list(requests), rows, hidden, dtype, next_ids, np.full(len(rows), next_ids.shape[1], np.int64))

    @classmethod
    def padded(cls, groups: list["PromptEntries"]) -> "PromptEntries":
        """The groups' rows one after another, padded with zeros to the longest prompt."""
        n = max(g.next_ids.shape[1] for g in groups)

        def pad(a: np.ndarray) -> np.ndarray:  # [B, n_g, ...] -> [B, n, ...]
            return np.pad(a, [(0, 0), (0, n - a.shape[1])] + [(0, 0)] * (a.ndim - 2))

        return cls([r for g in groups for r in g.requests], np.concatenate([g.rows for g in groups]),
                   np.concatenate([pad(g.hidden) for g in groups]), groups[0].dtype,
                   np.concatenate([pad(g.next_ids) for g in groups]), np.concatenate([g.lengths for g in groups]))

    def rows_at(self, at: np.ndarray) -> "PromptEntries":
        """These entries' rows ``at`` (indices or a mask [B]), cut to the longest of them."""
        lengths = self.lengths[at]
        n = int(lengths.max())
        return PromptEntries([self.requests[j] for j in np.arange(len(self.rows))[at]], self.rows[at],
                             self.hidden[at, :n], self.dtype, self.next_ids[at, :n], lengths)

    def without(self, dropped: np.ndarray) -> "PromptEntries | None":
        """These entries less the rows ``dropped`` (None: none left)."""
        keep = ~np.isin(self.rows, dropped)  # [B]
        return self.rows_at(keep) if keep.any() else None

    def catch_up_inputs(self, arrays) -> tuple:
        batch, n = self.next_ids.shape
        positions = np.tile(np.arange(n, dtype=np.int64), (batch, 1))  # [B, n]; past lengths[j] - 1: padding
        last = self.lengths - 1  # [B]
        return (self.requests, Rows(self.rows), arrays.from_host(self.hidden, self.dtype), self.next_ids,
                positions, last)


def _rows_of(step: tuple[np.ndarray, ...], wanted: np.ndarray) -> tuple[np.ndarray, ...]:
    """One kept step at rows ``wanted`` [B]: (whether each took part [B], hidden, x_{p+1}, p at
    them; where a row did not take part, another row's values)."""
    step_rows, *values = step
    order = np.argsort(step_rows)
    at = order[np.minimum(np.searchsorted(step_rows, wanted, sorter=order), len(order) - 1)]  # [B]
    return (step_rows[at] == wanted, *(v[at] for v in values))
