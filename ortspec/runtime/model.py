"""One forward at a time: the target model and the MTP head over a batch of state rows.

This layer owns sessions, feeds and states; it makes no decision about which tokens to
run (that is the speculative layer's job). Every method takes the batch rows it runs on
and [B, M] ids/positions built by the caller. Graph outputs stay where the backend keeps
them (numpy, or device buffers on CUDA); only token ids come back to the host.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..errors import InternalError
from ..manifest import graph_name, stage_graph_name
from .graph_slots import HandOver, SlotKey
from .graphs import GraphSet
from .host_binding import HostBinding, HostBindings
from .kv_window import attention_window
from .sampling_inputs import SamplingInputs
from .states import Rows, Snapshot, StateSet
from .streams import StepReadbacks


class Forward(dict):
    """Graph outputs (backend arrays) plus ``tokens``, the argmax ids as a host int64 [B, M]
    array, and ``positions`` [B, M], where the forward ran (a consumer of its hidden states,
    the MTP head, feeds the same M rows). The logits stay where the graph left them until a
    sampled request asks (``logits``). ``parts``: the forwards of exact mode's row groups that
    this one joins (``forward_shapes.FixedShape``), which keep the logits of their rows."""

    tokens: np.ndarray | None = None
    downloaded: np.ndarray | None = None  # the int64 output read to the host: tokens [B, M], or more columns after them
    positions: np.ndarray
    arrays: object  # the backend the outputs live in
    parts: list["Forward"] | None = None

    def read(self, download: str = "tokens") -> None:
        """Reads ``downloaded`` and ``tokens`` to the host (waits for the forward on CUDA), once."""
        if self.downloaded is not None:
            return
        self.downloaded = self.arrays.download(self[download])
        self.tokens = self.downloaded[:, : self.positions.shape[1]]

    def logits(self, at: np.ndarray | None = None) -> np.ndarray:
        """Host float32 logits: every row [B, M, V], or with at [B] row at[j] of request j [B, V]
        (on CUDA gathered on the device first, so a prefill downloads one row, not the prompt's)."""
        if "logits" not in self and self.parts:  # exact mode's groups, B_fix rows each, in row order
            bounds = np.cumsum([0] + [len(part.tokens) for part in self.parts])
            return np.concatenate([part.logits(None if at is None else at[start:end])
                                   for part, start, end in zip(self.parts, bounds[:-1], bounds[1:])])
        logits = self["logits"]
        if at is None:
            return self.arrays.download(logits)
        if self.arrays.device == "cpu":
            return logits[np.arange(len(at)), at]
        rows = self.arrays.staging("logits_at", (len(at), logits.shape[2]), np.float32)
        self.arrays.gather(logits, np.asarray(at, np.int64), rows)
        return self.arrays.download(rows)


def _forward(graphs: GraphSet, out: dict, positions: np.ndarray, download: str | None = "tokens") -> Forward:
    """download: the int64 output [B, >= M] the host reads, whose first M columns are the tokens
    (``verify_mtp_k{k}`` packs its accept lengths and drafts after them: one download per step);
    None: nothing yet (``Forward.read``)."""
    result = Forward(out)
    result.keep_alive = getattr(out, "keep_alive", None)
    result.positions = positions
    result.arrays = graphs.arrays
    if download is not None:
        result.read(download)
    return result


def proxies(outputs: dict) -> dict:
    """The proxy tensors a pipeline stage handed on (``proxy.*``, [B, M, H] token rows). Only
    those it produced: a proxy a stage legitimately lacks (no residual before any layer ran)
    is absent here, and the next stage does not ask for it."""
    return {name: value for name, value in outputs.items() if name.startswith("proxy.")}


def past_slots(graphs: GraphSet) -> int:
    """The GDN states' past windows (runtime.states.LayerState): K+1 slots where the CUDA verifies
    read them (gdn_verify="state_window"), else none (the CPU runs its own per-row variants)."""
    manifest = graphs.manifest
    return manifest.num_speculative_tokens + 1 if manifest.gdn_verify == "state_window" and graphs.provider == "cuda" else 0


class TargetModel:
    """The hybrid target: prefill, M=1 decode, M=k+1 verify (plain or with state windows).

    With pipeline stages each forward runs the stage graphs in order, each over its own
    layers' states, passing the proxies on; the outputs of all stages are merged, so the
    state kinds and the speculative step see one model.

    engine: the id CUDA-graph slots are keyed by (``graph_slots.SlotKey``): the captured graphs
    of these buffers are this model's own. Default: a fresh id. A forward over rows that start
    past row 0 (exact mode's row groups) binds other addresses, so it gets an id of its own.
    """

    def __init__(self, graphs: GraphSet, batch: int, stages: int = 1, engine: int | None = None) -> None:
        self.graphs, self.stages = graphs, stages
        self.engine = graphs.slots.new_engine_id() if engine is None else engine
        self.states = StateSet(graphs.state_arrays, graphs.manifest.states, batch, ("kv_key", "conv", "recurrent"),
                               past_slots=past_slots(graphs))
        self.hand_overs = [HandOver(graphs, s) for s in range(1, stages)]
        self._slot_ids = {0: self.engine}  # first row of a bound row range -> the id its graph slots use
        self._control: dict = {}  # (name, first row, shape) -> an int64 buffer of a loop's step control
        self._readbacks: dict = {}  # (name, shape, dtype) -> StepReadbacks a run reads its steps through
        self._bindings = HostBindings()  # the CPU's forwards over IOBinding (bound_forward)
        self._zeros: dict[tuple, object] = {}  # (name, shape, dtype) -> a zero buffer (prefill_apart)

    def slot_id(self, rows: Rows) -> int:
        """The engine id of the slot keys of a forward over these rows: the model's own for rows
        from 0; a fresh one, kept, for each other first row (its captured graphs bind other addresses)."""
        first = int(rows.indices[0])
        if first not in self._slot_ids:
            self._slot_ids[first] = self.graphs.slots.new_engine_id()
        return self._slot_ids[first]

    def control_buffer(self, name: str, rows: Rows, shape: tuple):
        """A persistent int64 buffer named ``name`` for a step's control over these rows (the next
        inputs and commit counts a loop ahead of the GPU makes on the device), made once per name,
        first row and shape: device pool memory is not handed back before Session.close, so a buffer
        per generate call would grow without bound."""
        key = (name, int(rows.indices[0]), tuple(shape))
        if key not in self._control:
            self._control[key] = self.graphs.arrays.zeros(shape, np.int64)
        return self._control[key]

    def step_readbacks(self, name: str, shape: tuple, dtype) -> StepReadbacks:
        """The page-locked copies a run of steps reads ``name`` [shape] back through, made once per
        name, shape and dtype: allocating page-locked memory costs as much as a step, and freeing it
        may synchronise the device, so a run (one per join or change of k) takes them from here."""
        key = (name, tuple(int(d) for d in shape), np.dtype(dtype).str)
        if key not in self._readbacks:
            self._readbacks[key] = StepReadbacks(self.graphs.arrays, shape, dtype)
        return self._readbacks[key]

    def graph_names(self, name: str) -> list[str]:
        return [name] if self.stages == 1 else [stage_graph_name(name, s) for s in range(self.stages)]

    def _run(self, name: str, rows: Rows, ids: np.ndarray, positions: np.ndarray, graphed: bool = False,
             extra_feeds: dict | None = None, download: str | None = "tokens", reach: int = 1,
             kv_window: bool = True, wait: bool = True) -> Forward:
        """graphed: a fixed-shape run, replayed as a CUDA graph where the provider captures them.
        extra_feeds: inputs besides ids, positions and the target's states: the MTP head's cache for a graph
        that runs the head too (``verify_with_head``), a sampling graph's (``SamplingInputs``).
        reach: the slots past the last position the graph touches (1; k where the MTP head drafts k
        in it), for the KV window variant CUDA runs (``kv_window``); kv_window=False: the portable
        graph over all max_length slots whatever the positions (exact mode). download=None,
        wait=False (an eager forward of one stage): returns once its work is enqueued, nothing
        read yet (``Forward.read``)."""
        feeds = {"input_ids": ids, "positions": positions,
                 **self.states.feeds(rows, attention_window(self.graphs, positions, reach=1)), **(extra_feeds or {})}
        merged, keep_alive = {}, []
        windows = self.graphs.kv_windows
        for stage, graph in enumerate(self.graph_names(name)):
            graph = windows.for_positions(graph, positions, reach) if kv_window else graph
            key = SlotKey.for_run(graph, ids, self.slot_id(rows)) if graphed else None
            out = self.graphs[graph].run(feeds, slot=key, wait=wait or stage + 1 < self.stages)
            keep_alive.append(getattr(out, "keep_alive", None))
            merged.update(out)
            if stage + 1 < self.stages:
                handed = self.hand_overs[stage](proxies(out), key)
                feeds = {**{n: v for n, v in feeds.items() if not n.startswith("proxy.")}, **handed}
        result = _forward(self.graphs, merged, positions, download)
        result.keep_alive = keep_alive
        return result

    def bound_forward(self, graph: str, rows: Rows, feeds: dict, head: "MTPHead | None" = None, drafts: int = 0,
                      in_place: dict | None = None) -> dict:
        """(the CPU) One forward over a ``HostBinding``, made once per graph, rows' slots and state
        buffers (the rows are moved into consecutive slots first: ``StateSet.feeds``). ``feeds``:
        the step inputs (input_ids and positions [B, M], sampling inputs), loaded into the binding;
        the states are bound where they live, with the MTP head's cache where the graph reads it too
        (``head``, drafting ``drafts``), and ``in_place`` (views of buffers that live as long as the
        model, never copies: a copy would be bound once and never read again). A plain graph
        (``*_out``) writes the GDN states after it into the spare buffers: keep them with
        ``states.flip``. Returns the outputs: arrays that the next run of this graph over these
        rows overwrites. The states' feeds are built only where a binding is made: its key names
        every buffer they would hold, and a binding reads them in place."""
        positions = feeds["positions"]
        window = attention_window(self.graphs, positions, reach=1)
        self.states.place(rows, window)
        if head is not None:
            head.states.place(rows, attention_window(self.graphs, positions, reach=drafts))
        runner = self.graphs[graph]
        here = self.states.binding_key(rows)  # (first slot, end, live GDN buffer, KV layout)
        key = (graph, here, head.states.binding_key(rows) if head is not None else None)

        def make() -> HostBinding:
            every = {**feeds, **self.states.feeds(rows, window),
                     **(head.cache_feeds(rows, positions, drafts) if head is not None else {}), **(in_place or {})}
            plain = self.states.double_buffered and self.states.layers[0].out_name in runner.output_names
            shared = self._bindings.outputs.setdefault((graph, here[:2]), {})
            return HostBinding(runner, every, tuple(feeds), self.states.spare_outputs(rows) if plain else {}, shared,
                               SlotKey.for_run(graph, feeds["input_ids"], self.slot_id(rows)))

        return runner.run(feeds, slot=self._bindings.get(key, make))

    def reset(self, rows: Rows) -> None:
        """Zero GDN states for new requests in these rows (stale KV slots are masked, no need)."""
        self.states.reset(rows)

    def prefill(self, rows: Rows, ids: np.ndarray, positions: np.ndarray, read: bool = True) -> Forward:
        """read=False: returns once the forward and its state writes are enqueued, its tokens not
        read yet (``Forward.read``): the host can go on while the GPU runs it."""
        out = self._run("prefill", rows, ids, positions, download="tokens" if read else None, wait=read)
        self.states.advance(out, rows, positions)
        return out

    def prefill_apart(self, rows: Rows, ids: np.ndarray, positions: np.ndarray) -> Callable[[], Forward]:
        """A prefill of fresh sequences as a call another thread may make (``prefill_thread``),
        its tokens not read yet (``Forward.read``). Its Run writes only its own outputs and reads
        GDN states of zeros made for it (what reset leaves: the rows' own may be written by the
        steps meanwhile) and the rows' KV caches, whose contents a fresh prompt's forward never
        uses (it attends to the entries it writes itself; every later slot is masked). So it
        touches nothing a step needs. ``commit_prefill`` writes its outputs into the rows. One
        stage only."""
        if self.stages != 1:
            raise InternalError("prefill_apart runs one stage; a pipeline's prefill runs with prefill()")
        feeds = self.states.feeds(rows, attention_window(self.graphs, positions, reach=1))
        kv = {name for cache in self.states.caches for name in cache.names}
        feeds = {"input_ids": ids, "positions": positions, **feeds,
                 **self._zeros_like({name: value for name, value in feeds.items() if name not in kv})}
        graphs = self.graphs
        runner = graphs[graphs.kv_windows.for_positions("prefill", positions, 1)]

        def run() -> Forward:  # returns once enqueued: its tokens are read where the steps' thread commits it
            return _forward(graphs, runner.run(feeds, wait=False), positions, download=None)
        return run

    def commit_prefill(self, out: Forward, rows: Rows, positions: np.ndarray) -> None:
        """A ``prefill_apart`` forward's states written into its rows (reset first)."""
        self.states.fit(attention_window(self.graphs, positions, reach=1))
        self.states.advance(out, rows, positions)

    def _zeros_like(self, feeds: dict) -> dict:
        """Zero buffers of the feeds' shapes and dtypes, made once per shape and never written."""
        zeros = {}
        for name, value in feeds.items():
            key = (name, tuple(value.shape), str(value.dtype))  # a numpy dtype, or a device buffer's name of one
            if key not in self._zeros:
                self._zeros[key] = self.graphs.arrays.zeros(value.shape, value.dtype)
            zeros[name] = self._zeros[key]
        return zeros

    def samples_last_rows(self, out: Forward) -> bool:
        """``sample_last_rows`` can choose from out: one row of logits per request (a prefill's,
        since they are its last row's alone) and a model with ``sample_logits``."""
        return "sample_logits" in self.graphs.manifest.graphs and "logits" in out and out["logits"].shape[1] == 1

    def sample_last_rows(self, out: Forward, sampling: SamplingInputs) -> np.ndarray:
        """tokens [B] chosen where out's logits [B, 1, V] lie (``sample_logits``): a draw for rows
        with temperature > 0, the argmax for the others; only the ids come to the host."""
        drawn = self.graphs["sample_logits"].run({"logits": out["logits"], **sampling.feeds()})
        return self.graphs.arrays.download(drawn["tokens"])[:, 0]

    def decode(self, rows: Rows, ids: np.ndarray, positions: np.ndarray) -> Forward:
        """ids/positions [B, 1]."""
        out = self._run("decode", rows, ids, positions, graphed=True)
        self.states.advance(out, rows, positions)
        return out

    def decode_sampled(self, rows: Rows, ids: np.ndarray, positions: np.ndarray, sampling: SamplingInputs) -> Forward:
        """decode whose tokens are drawn on the device for rows with temperature > 0 (the argmax,
        bit for bit decode's, for the others): ``decode_sample``, sampling's uniforms [B, 1]. The
        logits stay on the device; tokens [B, 1] is the one download."""
        out = self._run("decode_sample", rows, ids, positions, graphed=True, extra_feeds=sampling.feeds())
        self.states.advance(out, rows, positions)
        return out

    def verify(self, rows: Rows, ids: np.ndarray, positions: np.ndarray) -> Forward:
        """ids/positions [B, k+1]; advances every state past all k+1 rows (readvance fixes it)."""
        out = self._run(graph_name("verify", ids.shape[1] - 1), rows, ids, positions, graphed=True)
        self.states.advance(out, rows, positions)
        return out

    def verify_windows(self, rows: Rows, ids: np.ndarray, positions: np.ndarray, kv_window: bool = True) -> Forward:
        """Like verify, but leaves the states untouched; the outputs hold the state after each row.
        kv_window=False: over all max_length KV slots on CUDA (exact mode: one shape, one computation)."""
        return self._run(graph_name("verify_select", ids.shape[1] - 1), rows, ids, positions, graphed=True,
                         kv_window=kv_window)

    def verify_with_head(self, rows: Rows, ids: np.ndarray, positions: np.ndarray,
                         head: "MTPHead") -> tuple[Forward, np.ndarray, np.ndarray]:
        """verify_windows, the greedy accept lengths and the head's catch-up with its next k drafts,
        in one graph (``verify_mtp_k{k}``; one stage only): ids/positions [B, k+1]. No state is
        touched; the head's new KV rows stay in the outputs (``MTPHead.write_entries``). Returns
        (the forward, accepted [B], drafts [B, k]), all three from one download."""
        k = ids.shape[1] - 1
        out = self._run(graph_name("verify_mtp", k), rows, ids, positions, graphed=True,
                        extra_feeds=head.cache_feeds(rows, positions, drafts=k), download="step_ids", reach=k)
        step_ids = out.downloaded  # [B, 2k+2]: tokens g_0..g_k | accepted | drafts
        return out, step_ids[:, k + 1], step_ids[:, k + 2:]

    def verify_with_head_sampled(self, rows: Rows, ids: np.ndarray, positions: np.ndarray, head: "MTPHead",
                                 sampling: SamplingInputs, draft_probs=None) -> tuple[Forward, np.ndarray, np.ndarray]:
        """verify_with_head for batches where rows sample (``verify_mtp_sample_k{k}``): their
        acceptance by exact speculative sampling, their next drafts drawn, all on the device;
        sampling's uniforms [B, 2k+1]. draft_probs: the buffer [batch, k, V] holding what the drafts
        ids[:, 1:] were drawn from (default ``head.draft_probs(k)``); the graph's draft_probs_out
        (the next drafts') replaces it. Returns (the forward, whose tokens are the emitted e_0..e_k,
        accepted [B], drafts [B, k]), from one download; commit as verify_with_head's."""
        k = ids.shape[1] - 1
        buffer = head.draft_probs(k) if draft_probs is None else draft_probs
        feeds = {**sampling.feeds(), "draft_probs": rows.take(self.graphs.arrays, buffer),
                 **head.cache_feeds(rows, positions, drafts=k)}
        out = self._run(graph_name("verify_mtp_sample", k), rows, ids, positions, graphed=True, extra_feeds=feeds,
                        download="step_ids", reach=k)
        rows.put(self.graphs.arrays, buffer, out["draft_probs_out"])
        step_ids = out.downloaded  # [B, 2k+2]: emitted e_0..e_k | accepted | drafts
        return out, step_ids[:, k + 1], step_ids[:, k + 2:]

    def select(self, out: Forward, rows: Rows, positions: np.ndarray, accepted: np.ndarray) -> None:
        self.states.select(out, rows, positions, accepted)

    def snapshot(self, rows: Rows, lengths: np.ndarray) -> Snapshot:
        return self.states.snapshot(rows, lengths)

    def fork(self, src_row: int, dst_rows: Rows) -> None:
        """Row src_row's states copied into dst_rows (n > 1: a prompt prefilled once; ``StateSet.fork``)."""
        self.states.fork(src_row, dst_rows)

    def restore(self, snap: Snapshot, rows: Rows, lengths: np.ndarray) -> None:
        self.states.restore(snap, rows, lengths)

    def release(self) -> None:
        """Drops the state, control and hand-over buffers (Session.close), even while stale objects still hold this model."""
        self.states.release()
        self._bindings.clear()
        self._control.clear()
        self._zeros.clear()
        with self.graphs.device_lock:  # freeing page-locked memory may synchronise the device
            for readbacks in self._readbacks.values():
                readbacks.close()
            self._readbacks.clear()
        for hand_over in self.hand_overs:
            hand_over.release()


class MTPHead:
    """The MTP draft head: its own KV cache, and the k drafts it proposes for the next step.

    Entry p of its cache holds (h_p, x_{p+1}): the target's final-normed hidden state at
    position p and the token that followed. ``catch_up`` fills entries from target hiddens
    (after prefill and after every commit) and, in the same graph (``mtp_propose_k{k}``),
    drafts d1..dk for the next step: d1 from the entry at the last real row, each further
    draft from the previous one and the head's own output. Only the catch-up's entries are
    written to the cache; the draft passes' entries live inside the graph.
    ``catch_up_sampled`` runs the same catch-up in ``mtp_sample_k{k}``, whose drafts are drawn
    (for rows with temperature > 0) from the head's transformed distributions, also returned, or
    kept on the device in ``draft_probs(k)``, where ``TargetModel.verify_with_head_sampled`` reads
    them and leaves the next drafts' in their place.
    """

    def __init__(self, graphs: GraphSet, batch: int, k: int, engine: int | None = None) -> None:
        self.graphs, self.arrays, self.k, self.batch = graphs, graphs.arrays, k, batch
        self.engine = graphs.slots.new_engine_id() if engine is None else engine
        self.states = StateSet(graphs.state_arrays, graphs.manifest.states, batch, ("mtp_kv_key",))
        self._draft_probs: dict = {}  # k -> [batch, k, V] (draft_probs)

    def catch_up(self, rows: Rows, hidden, next_ids: np.ndarray, positions: np.ndarray, last: np.ndarray,
                 drafts: int, graphed: bool = True) -> np.ndarray:
        """Entries T..T+last[j] of row j from target hiddens [B, M, H] and next tokens [B, M]
        (rows past last[j] are padding, never written). Returns the next step's drafts [B, drafts]
        (1..k: the graph ``mtp_propose_k{drafts}``). graphed: a fixed-shape run (every step's),
        replayed as a CUDA graph; not the prefill's."""
        out = self._catch_up(graph_name("mtp_propose", drafts), drafts, {}, rows, hidden, next_ids, positions, last,
                             graphed)
        return self.arrays.download(out["drafts"])

    def catch_up_sampled(self, rows: Rows, hidden, next_ids: np.ndarray, positions: np.ndarray, last: np.ndarray,
                         drafts: int, sampling, graphed: bool = True, on_device: bool = False):
        """catch_up whose drafts are drawn: sampling (``SamplingInputs`` or its feeds) holds
        temperature float32 [B] (0: the argmax, as catch_up), top_k int64 [B], top_p, min_p float32
        [B] and uniforms float32 [B, k]. Returns the drafts [B, k] and the distributions they were
        drawn from [B, k, V] (k = drafts); on_device: those stay in ``draft_probs(k)`` (the buffer
        verify_with_head_sampled reads), and None is returned in their place."""
        feeds = sampling.feeds() if isinstance(sampling, SamplingInputs) else sampling
        out = self._catch_up(graph_name("mtp_sample", drafts), drafts, feeds, rows, hidden, next_ids, positions,
                             last, graphed)
        if on_device:
            rows.put(self.arrays, self.draft_probs(drafts), out["draft_probs"])
            return self.arrays.download(out["drafts"]), None
        return self.arrays.download(out["drafts"]), self.arrays.download(out["draft_probs"])

    def draft_probs(self, k: int):
        """The persistent buffer [batch, k, V] float32 of what each row's k drafts were drawn from:
        written by the graph that drew them (``mtp_sample_k{k}``, ``verify_mtp_sample_k{k}``), read
        by the verify of those drafts. Made once per k (device pool memory lives as long as the engine)."""
        if k not in self._draft_probs:
            self._draft_probs[k] = self.arrays.zeros((self.batch, k, self.graphs.manifest.spec.vocab_size), np.float32)
        return self._draft_probs[k]

    def _catch_up(self, graph: str, drafts: int, extra: dict, rows: Rows, hidden, next_ids, positions, last,
                  graphed: bool):
        feeds = {"input_ids": next_ids, "hidden": hidden, "positions": positions,
                 "last": np.ascontiguousarray(last, np.int64), **extra, **self.cache_feeds(rows, positions, drafts)}
        graph = self.graphs.kv_windows.for_positions(graph, positions, reach=drafts)
        key = SlotKey.for_run(graph, next_ids, self.engine) if graphed else None
        out = self.graphs[graph].run(feeds, slot=key)
        self.write_entries(out, rows, positions, last)
        return out

    def cache_feeds(self, rows: Rows, positions: np.ndarray, drafts: int) -> dict:
        """The head's cache as inputs of a run over positions [B, M] that then drafts ``drafts``
        tokens: on the CPU a window reaching k slots past the last position (drafts d2..dk sit
        k-1 slots past row a), on CUDA the whole buffers (a window variant narrows them)."""
        return self.states.feeds(rows, attention_window(self.graphs, positions, reach=drafts))

    def write_entries(self, out, rows: Rows, positions: np.ndarray, last: np.ndarray) -> None:
        """Keeps a catch-up's entries T..T+last[j] of row j: new_key.mtp / new_value.mtp rows 0..last[j]."""
        self.states.write(out, rows, positions, counts=last + 1)

    def row_state(self, row: int, length: int) -> dict[str, np.ndarray]:
        return self.states.row_state(row, length)

    def reset(self, rows: Rows) -> None:
        """New sequences in these rows: their entries are dead (``StateSet.reset``)."""
        self.states.reset(rows)

    def fork(self, src_row: int, dst_rows: Rows) -> None:
        """Row src_row's cache (and drafts' distributions) copied into dst_rows (``StateSet.fork``)."""
        self.states.fork(src_row, dst_rows)
        for buffer in self._draft_probs.values():
            self.states.copy_rows(self.arrays, [buffer], src_row, dst_rows)

    def release(self) -> None:
        self.states.release()
        self._draft_probs.clear()
