"""CUDA-graph slots: which runs are captured, under which key, with which buffers, until when.

A captured CUDA graph replays the device addresses it saw at capture. So a slot is keyed by
everything that fixes them (``SlotKey``): the graph, the tokens per request row M, the batch
bucket B, and the engine (one set of state buffers, ``runtime.engines``) whose addresses it
binds. Two engines of one batch size therefore capture two graphs and never fall back or
invalidate each other when their steps alternate.

This module owns that key, the batch buckets, the rule for which graphs are captured, the
table of captured slots with their static buffers (``GraphSlots``, ``CapturedSlot``), the
hand-over buffers between pipeline stages on different devices (``HandOver``), and their
release. ONNX Runtime (1.31) frees a session's captured graphs only with the session, so
``GraphSlots.release`` drops the static buffers and the registry's keys, and
``GraphSet.close`` drops the sessions.

The native ``GraphSlotRegistry`` numbers the keys for ONNX Runtime (``gpu_graph_id``, never
reused) and counts captures, replays, fallbacks and invalidations per key.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading

import numpy as np
import onnxruntime as ort

from ..manifest import split_window_name
from .arrays import DTYPES

BATCH_BUCKETS = (1, 2, 4, 8, 16)


def batch_bucket(n: int) -> int:
    """The batch size CUDA graphs are captured for: the next of 1, 2, 4, 8, 16 (then multiples of 16).
    Padding rows hold finished placeholder requests; rows never mix, so they cannot affect real ones."""
    return next((b for b in BATCH_BUCKETS if b >= n), -(-n // 16) * 16)


def is_captured_graph(name: str) -> bool:
    """Graphs run as CUDA graphs at fixed shapes: decode (M=1, argmax or sampled), the verifies
    (M=k+1, the fused ones greedy or sampled) and the MTP head's (catch-up + drafts, argmax or
    sampled), and their KV window variants (decode.w256). Prefill runs any length, so always eagerly."""
    base = split_window_name(name)[0].split(".stage")[0]
    return base in ("decode", "decode_sample", "mtp") or base.startswith(
        ("verify", "mtp_propose", "mtp_sample"))


@dataclasses.dataclass(frozen=True)
class SlotKey:
    """One captured graph: a graph at one shape over one engine's buffers. The native registry
    reads these four attributes."""

    slot: str  # the graph's manifest name, e.g. "decode", "verify_select_k3", "decode.stage1", "decode.w256"
    tokens_per_row: int  # M
    batch_bucket: int  # B, rows the graph runs (padded batch)
    engine: int  # id of the engine whose state buffers the graph binds

    @classmethod
    def for_run(cls, graph: str, ids: np.ndarray, engine: int) -> "SlotKey":
        """The key of a fixed-shape run of ``graph`` over ids [B, M] on ``engine``'s buffers."""
        return cls(graph, int(ids.shape[1]), int(ids.shape[0]), engine)

    def describe(self) -> str:
        return f"{self.slot}/M{self.tokens_per_row}/B{self.batch_bucket}/engine{self.engine}"


CAPTURE_LOCK = threading.Lock()
"""Held while ONNX Runtime captures a CUDA graph, and by a Run on another thread than the steps'
(``prefill_thread``): a capture is in the global mode, during which no other thread of the
process may launch, allocate or synchronise on the device."""

NO_SYNC = "disable_synchronize_execution_providers"  # ONNX Runtime run config key; "1": Run does not wait for the GPU


def graph_id_options(graph_id: int | None, wait: bool = True) -> ort.RunOptions:
    """RunOptions naming a CUDA graph (-1: run eagerly; None: a session without CUDA graphs); made
    once per slot (each costs host time). wait=False: Run returns once the work is enqueued (read
    its outputs through the stream)."""
    options = ort.RunOptions()
    if graph_id is not None:
        options.add_run_config_entry("gpu_graph_id", str(graph_id))
    if not wait:
        options.add_run_config_entry(NO_SYNC, "1")
    return options


class CapturedSlot:
    """One CUDA graph: a fixed-shape IOBinding over static buffers, captured on its first replay.

    Nothing the graph reads is written by it: states come in as inputs and leave as separate
    outputs that the runtime commits afterwards. So ONNX Runtime's warm-up runs before a
    capture (the graph runs 3 times) leave every state as it was.

    Host inputs (ids, positions) are uploaded into static buffers (``uploads``). A caller that
    writes one of them on the device itself (the next step's input_ids from this step's tokens)
    passes that very buffer (``static_input``) as the feed, and nothing is uploaded for it.
    """

    def __init__(self, runner, graph_id: int, feeds: dict, first_out: dict) -> None:
        arrays = runner.arrays
        self.runner, self.arrays = runner, arrays
        self.run_options = {True: graph_id_options(graph_id), False: graph_id_options(graph_id, wait=False)}
        self.binding = runner.session.io_binding()
        self.uploads, self.pointers, self.outputs = {}, {}, Outputs()
        for name in runner.input_names:
            value = feeds[name]
            if isinstance(value, np.ndarray):  # host inputs (ids, positions) are uploaded into a static buffer
                value = self.uploads[name] = arrays.zeros(value.shape, value.dtype)
            else:  # device inputs (states, hiddens) must come at this address every time
                self.pointers[name] = value.data_ptr
            self.binding.bind_ortvalue_input(name, arrays.ort_value(value))
        for name in runner.output_names:
            buffer = self.outputs[name] = arrays.zeros(first_out[name].shape, DTYPES[first_out[name].dtype])
            self.binding.bind_ortvalue_output(name, arrays.ort_value(buffer))
        self.captured = False

    def matches(self, feeds: dict) -> bool:
        return all(feeds[n].data_ptr == ptr for n, ptr in self.pointers.items()) and all(
            feeds[n].shape == self.uploads[n].shape for n in self.uploads)

    def load_inputs(self, feeds: dict) -> None:
        """Uploads the host inputs into the static buffers. Every run of the slot does (the first
        and fallbacks too, which run eagerly from the feeds), so the static inputs always hold the
        latest run's: a caller may read them on the device (the KV commit reads the positions)."""
        for name, buffer in self.uploads.items():
            if feeds[name] is not buffer:  # the static buffer itself: written on the device already
                self.arrays.upload(buffer, feeds[name])

    def replay(self, feeds: dict, wait: bool = True) -> dict:
        """Uploads the host inputs and runs the graph (ONNX Runtime captures it on the first call);
        wait=False: returns before the GPU is done (``graph_id_options``)."""
        self.load_inputs(feeds)
        self.arrays.settle()
        options = self.run_options[wait or not self.arrays.shared_stream]
        if self.captured:
            self.runner.session.run_with_iobinding(self.binding, options)
        else:
            with CAPTURE_LOCK:
                self.runner.session.run_with_iobinding(self.binding, options)
            self.captured = True
        return self.outputs


class Outputs(dict):
    """Graph outputs; holds the OrtValues whose device memory the wrapped buffers point into."""

    keep_alive = None


class GraphSlots:
    """The captured slots of one GraphSet: SlotKey -> CapturedSlot, numbered and counted by the
    native registry (None on the CPU, where nothing is captured), and the engine ids the keys use.

    ``run`` is called under ``GraphSet.device_lock`` (CUDA steps never overlap), so the table
    needs no lock of its own; engine ids come from an atomic counter.
    """

    def __init__(self, registry) -> None:
        self.registry = registry
        self._captured: dict[SlotKey, CapturedSlot] = {}
        self._engine_ids = itertools.count()
        self._released: dict | None = None  # the counters as they were at release
        self.setup_runs = 0  # runs that were not replays: each slot's first (eager) run and its capture, fallbacks

    def new_engine_id(self) -> int:
        return next(self._engine_ids)

    def static_input(self, key: SlotKey, name: str):
        """The static buffer a captured slot uploads host input ``name`` into (None before the
        slot's first run): a caller may write it on the device and feed it back (``CapturedSlot``)."""
        captured = self._captured.get(key)
        return None if captured is None else captured.uploads.get(name)

    def run(self, runner, key: SlotKey, feeds: dict, wait: bool = True) -> dict:
        """The first run of a key is eager (it learns the output shapes) and binds static buffers;
        later runs replay the graph, or run eagerly (a counted fallback) if an input moved.
        wait=False: a replay returns before the GPU is done (the eager runs always wait)."""
        captured = self._captured.get(key)
        if captured is None:
            self.setup_runs += 1
            out = runner.run_bound(feeds)
            captured = self._captured[key] = CapturedSlot(runner, self.registry.graph_id(key), feeds, out)
            for name, value in out.items():  # hand out the static buffers from the start, so a
                runner.arrays.copy(captured.outputs[name], value)  # consumer bound to them stays valid
            captured.load_inputs(feeds)
            return captured.outputs
        if not captured.matches(feeds):
            self.setup_runs += 1
            self.registry.on_fallback(key)
            captured.load_inputs(feeds)
            return runner.run_bound(feeds)
        first = not captured.captured
        self.setup_runs += first
        outputs = captured.replay(feeds, wait)
        (self.registry.on_capture if first else self.registry.on_replay)(key)
        return outputs

    def counters(self) -> dict:
        """Per slot ("graph/M/B/engine"): captures, replays, fallbacks, invalidations ({} on the CPU)."""
        if self._released is not None:
            return self._released
        if self.registry is None:
            return {}
        return {SlotKey(*key).describe(): {k: v for k, v in c.items()
                                           if k in ("captures", "replays", "fallbacks", "invalidations")}
                for key, c in self.registry.counters().items()}

    def release(self) -> None:
        """Forgets every captured slot (its IOBinding and static buffers) and the registry's keys;
        ``counters()`` keeps answering with the counts as they were. Idempotent."""
        if self._released is None:
            self._released = self.counters()
            self._captured.clear()
            if self.registry is not None:
                self.registry.release_all()


class HandOver:
    """Proxies passed from one pipeline stage to the next when the two run on different devices:
    copied into buffers on the receiving device. A captured CUDA graph binds its input
    addresses, so each graph slot receives into its own fixed buffer (one HandOver per engine
    and stage boundary, so per engine too); eager runs (prefill, any M) receive into a staging
    buffer per proxy."""

    def __init__(self, graphs, stage: int) -> None:
        self.source = graphs.stage_device(stage - 1)
        self.device = graphs.stage_device(stage)
        self.arrays = graphs.arrays_on(self.device)
        self._slot_buffers: dict = {}

    def __call__(self, proxies: dict, slot: SlotKey | None) -> dict:
        if self.device == self.source:
            return proxies
        received = {}
        for name, value in proxies.items():
            if slot is None:
                buffer = self.arrays.staging(name, value.shape, value.dtype)
            else:
                buffer = self._slot_buffers.get((slot, name))
                if buffer is None:
                    buffer = self._slot_buffers[(slot, name)] = self.arrays.zeros(value.shape, value.dtype)
            self.arrays.copy(buffer, value)
            received[name] = buffer
        return received

    def release(self) -> None:
        self._slot_buffers.clear()
