"""A CPU graph's Run over one IOBinding, bound once where its inputs and outputs live, then reused.

ONNX Runtime's Python ``run`` turns every input into a tensor and allocates and wraps every
output on each call, on top of the copies of the outputs into the state buffers after it
(BENCHMARKS.md, "Session 11: the CPU loop over IOBinding"). A ``HostBinding`` is the CPU's
counterpart of a captured CUDA graph slot (``graph_slots``): made once per graph, rows and state
buffers (``HostBindings``), it binds

- the step inputs (ids, positions, sampling inputs) to arrays of its own, which ``run`` loads;
- the states to where they live (host KV caches laid out for the window, GDN states' live
  rows: views, read in place);
- a plain forward's GDN states after it to the spare buffers (``StateSet.spare_outputs``),
  so that ``StateSet.flip`` makes them live without a copy;
- every other output to arrays that the bindings of one graph and rows share (their shapes
  depend on neither the KV layout nor the live GDN buffer), overwritten by each run: a caller
  reads a step's outputs before it runs the next one (the next step's inputs are copied in
  before its Run).

Those outputs (logits, windows, new KV rows) are allocated by ONNX Runtime at the first run of
the first such binding and then bound as arrays of those shapes.
"""

from __future__ import annotations

import collections

import numpy as np

MAX_BINDINGS = 16  # per HostBindings: both GDN buffers x the KV layouts of a call or two (64 slots apart)


class HostBinding:
    """One graph's IOBinding over fixed arrays (module docstring), run by ``GraphRunner.run`` (the
    CPU's slot). ``feeds``: every graph input as the first run has it (contiguous host arrays);
    ``step_inputs``: the names among them that each run loads into arrays of the binding's own,
    the others are bound where they are; ``placed``: outputs with a place of their own (the spare
    rows); ``shared``: the other outputs' arrays, shared with the bindings of the same graph and
    rows (those not there yet are sized at the first run and put there); ``key``: the slot key a
    CUDA run of it would have."""

    def __init__(self, runner, feeds: dict[str, np.ndarray], step_inputs: tuple[str, ...],
                 placed: dict[str, np.ndarray], shared: dict[str, np.ndarray], key=None) -> None:
        self.key = key  # the graph_slots.SlotKey it stands for: graph, M, B, engine
        self._session = runner.session
        self._binding = runner.session.io_binding()
        self.inputs = {name: np.array(value) if name in step_inputs else value for name, value in feeds.items()}
        outputs = {**{n: shared[n] for n in runner.output_names if n in shared and n not in placed}, **placed}
        self.outputs, self._shared = outputs, shared
        self._step_inputs = step_inputs
        inputs = self.inputs
        for name in runner.input_names:
            if not inputs[name].flags.c_contiguous:  # ONNX Runtime would bind a copy, never read again
                raise ValueError(f"input {name} must be bound as a contiguous array "
                                 f"(got strides {inputs[name].strides})")
            self._binding.bind_cpu_input(name, inputs[name])  # read in place (it keeps a reference)
        self._output_names = runner.output_names
        self._unsized = [name for name in runner.output_names if name not in outputs]
        for name in runner.output_names:
            if name in outputs:
                self._bind_output(name, outputs[name])
            else:
                self._binding.bind_output(name, "cpu")  # ONNX Runtime allocates it at the first run

    def _bind_output(self, name: str, array: np.ndarray) -> None:
        if not array.flags.c_contiguous:
            raise ValueError(f"output {name} must be bound to a contiguous array (got strides {array.strides})")
        self._binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Loads the step inputs from ``feeds`` (the same shapes every run; its other inputs are the
        arrays bound), runs, and returns the outputs: this binding's arrays, valid until its next run."""
        for name in self._step_inputs:
            np.copyto(self.inputs[name], feeds[name])
        self._session._sess.run_with_iobinding(self._binding._iobinding, None)
        if self._unsized:
            self._size_outputs()
        return self.outputs

    def _size_outputs(self) -> None:
        """After the first run: the outputs ONNX Runtime allocated, copied into arrays of their own,
        which are bound from now on."""
        values = dict(zip(self._output_names, self._binding.get_outputs()))
        for name in self._unsized:
            array = self._shared[name] = np.ascontiguousarray(values[name].numpy())
            self.outputs[name] = array
            self._bind_output(name, array)
        self._unsized = []


class HostBindings:
    """The HostBindings of one model's forwards, made on first use and kept by key: the graph, the
    rows and the identity of every state buffer they bind (``StateSet.binding_key``), so a
    binding is reused exactly while the buffers it reads and writes are the ones it bound, also
    in the next call at the same KV layout. The least recently used beyond MAX_BINDINGS are
    dropped. ``outputs``: per graph and rows, the output arrays their bindings share."""

    def __init__(self) -> None:
        self._bindings: collections.OrderedDict = collections.OrderedDict()
        self.outputs: dict[tuple, dict] = {}

    def get(self, key: tuple, make) -> HostBinding:
        """The binding of ``key``, else ``make()``'s, kept."""
        binding = self._bindings.get(key)
        if binding is None:
            binding = self._bindings[key] = make()
            while len(self._bindings) > MAX_BINDINGS:
                self._bindings.popitem(last=False)
        else:
            self._bindings.move_to_end(key)
        return binding

    def clear(self) -> None:
        self._bindings.clear()
        self.outputs.clear()
