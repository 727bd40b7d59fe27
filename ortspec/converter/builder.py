"""A small ONNX graph builder and the weight store that every graph of a model shares.

Weights are written once, to ``weights.bin``; each graph refers to them as external-data
initializers, and the runtime hands the same in-memory arrays to every ONNX Runtime
session (``SessionOptions.add_initializer``), so N graphs cost one copy of the weights.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..manifest import WEIGHTS_FILE

OPSET = 18
MS_DOMAIN = "com.microsoft"
ORTSPEC_DOMAIN = "ai.ortspec"  # ortspec's own ops, loaded by runtime/custom_ops.py
PORTABLE, CPU = "portable", "cpu"  # GraphBuilder.target: the formulations a graph is built with (see GraphBuilder)
IR_VERSION = 10  # onnxruntime 1.31 reads IR <= 13; onnx 1.23 would default to 14
_ALIGN = 64

_ONNX_TYPE = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(ml_dtypes.bfloat16): TensorProto.BFLOAT16,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.int32): TensorProto.INT32,
}


class WeightStore:
    """Named weight arrays, laid out back to back (64-byte aligned) in one weights.bin.

    activations: the dtype of the activations between layers in every graph built over this
    store (float32, or the model's float16/bfloat16 with ``convert(activations="model")``). It
    lives here because the weights depend on it: the norms on the residual stream are stored in
    it (ONNX Runtime's norm kernels take the weight in the input's dtype; weights.cast_matrices)."""

    def __init__(self, activations=np.float32) -> None:
        self.arrays: dict[str, np.ndarray] = {}
        self.quantized: dict[str, tuple[int, int]] = {}  # int4 weights: name -> (K, N)
        self.activations = np.dtype(activations)

    def add(self, name: str, array: np.ndarray) -> str:
        if name in self.arrays:
            raise KeyError(f"weight {name!r} added twice")
        self.arrays[name] = np.ascontiguousarray(array)
        return name

    def layout(self) -> dict[str, dict]:
        """name -> {offset, length, dtype, shape}; the manifest records it for the runtime."""
        table, offset = {}, 0
        for name, arr in self.arrays.items():
            offset = -(-offset // _ALIGN) * _ALIGN
            table[name] = {
                "offset": offset,
                "length": arr.nbytes,
                "dtype": str(arr.dtype),
                "shape": list(arr.shape),
            }
            offset += arr.nbytes
        return table

    def save(self, out_dir: Path) -> dict[str, dict]:
        with open(out_dir / WEIGHTS_FILE, "wb") as f:
            return self.write(f)

    def write(self, f) -> dict[str, dict]:
        """Writes weights.bin front to back (zero padding written, not sought over, so a writer
        can checksum the bytes as they pass); returns the layout."""
        table, end = self.layout(), 0
        for name, arr in self.arrays.items():
            f.write(bytes(table[name]["offset"] - end))
            f.write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)
            end = table[name]["offset"] + table[name]["length"]
        return table

    def external_tensor(self, name: str, entry: dict) -> TensorProto:
        arr = self.arrays[name]
        t = TensorProto(name=name, data_type=_ONNX_TYPE[arr.dtype], dims=list(arr.shape))
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", WEIGHTS_FILE), ("offset", entry["offset"]), ("length", entry["length"])):
            t.external_data.add(key=key, value=str(value))
        return t


def _rename(nodes, value: str, name: str) -> None:
    """Every use of value in nodes, and in the subgraphs of their If branches (outer-scope reads), named name."""
    for node in nodes:
        node.output[:] = [name if o == value else o for o in node.output]
        node.input[:] = [name if i == value else i for i in node.input]
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _rename(attribute.g.node, value, name)


class GraphBuilder:
    """Accumulates nodes; ``op`` returns output names so graphs read like straight-line code.

    target: PORTABLE builds with the fused com.microsoft ops (GatedRMSNorm, ScaledSiLU,
    LinearAttention, CausalConvWithState), one kernel each on CUDA; what a CUDA Session runs.
    CPU builds with what ONNX Runtime's CPU EP runs fastest (converter/gdn_cpu.py says what and
    why); what a CPU Session runs where the model has such graphs (manifest "cpu" entries). Every
    graph of one target uses one formulation, so a decode and a verify of that target compute a
    token's row the same way."""

    def __init__(self, name: str, weights: WeightStore, target: str = PORTABLE) -> None:
        if target not in (PORTABLE, CPU):
            raise ValueError(f"target {target!r}: use {PORTABLE!r} or {CPU!r}")
        self.name = name
        self.weights = weights
        self.target = target
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.used_weights: list[str] = []
        self.constants: dict[str, TensorProto] = {}
        self._renamed: dict[str, str] = {}
        self.memo: dict = {}  # values made once per graph and shared by its parts (layers._shared_slots)
        self._ids = itertools.count()

    # -- graph boundary --------------------------------------------------------------------
    def input(self, name: str, elem_type: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, value: str, name: str, elem_type: int, shape: list) -> None:
        """Declares `value` a graph output called `name`: the producing node's output is renamed
        (an Identity would be one more kernel per step on the GPU), unless `value` is a graph
        input or already an output, which need a copy."""
        value = self._renamed.get(value, value)  # declared before under another name
        producers = [n for n in self.nodes if value in n.output]
        taken = {o.name for o in self.outputs} | {i.name for i in self.inputs}
        if value != name and producers and value not in taken:
            _rename(self.nodes, value, name)
            self._renamed[value] = name
        elif value != name:
            self.op("Identity", [value], outputs=[name])
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    # -- values ----------------------------------------------------------------------------
    def weight(self, name: str) -> str:
        if name not in self.used_weights:
            self.used_weights.append(name)
        return name

    @property
    def activations(self) -> int:
        """The ONNX dtype of the activations between layers: the residual stream, the embedding
        rows, the norms on the stream, the projections' inputs and outputs, the hidden rows
        (``WeightStore.activations``). The mixers' insides stay float32 (layers.py)."""
        return _ONNX_TYPE[self.weights.activations]

    def matmul_dtype(self, weight: str) -> int:
        """The dtype a product with `weight` runs in: the weight's (float32, float16, bfloat16);
        float32 for an int4 weight (MatMulNBits takes and gives float32 here)."""
        if weight in self.weights.quantized:
            return TensorProto.FLOAT
        return _ONNX_TYPE[self.weights.arrays[weight].dtype]

    def linear(self, x: str, weight: str, hint: str | None = None, x_dtype: int | None = None,
               out_dtype: int | None = None) -> str:
        """x [.., in] @ W [in, out], x arriving in x_dtype, the result wanted in out_dtype (None:
        the activations' dtype). With W stored in fp16/bf16 the product runs in that dtype: x is
        cast down and the result back only where a side differs from it (float32 activations,
        or a mixer's float32 inside); with activations in the model dtype a product between two
        stream ops needs no Cast. An int4 weight runs as MatMulNBits (see converter/quantize.py)."""
        x_dtype = self.activations if x_dtype is None else x_dtype
        out_dtype = self.activations if out_dtype is None else out_dtype
        low = self.matmul_dtype(weight)
        if x_dtype != low:
            x = self.op("Cast", [x], to=low)
        if weight in self.weights.quantized:
            K, N = self.weights.quantized[weight]
            y = self.ms("MatMulNBits", [x, self.weight(weight), self.weight(f"{weight}.scales")], hint=hint,
                        K=K, N=N, bits=4, block_size=32, accuracy_level=4)
        else:
            y = self.op("MatMul", [x, self.weight(weight)], hint=hint)
        return y if out_dtype == low else self.op("Cast", [y], to=out_dtype, hint=hint)

    def embedding(self, ids: str, weight: str = "embed") -> str:
        """The rows of `weight` at ids [B, M], in the activations' dtype: [B, M, H]."""
        rows = self.op("Gather", [self.weight(weight), ids], hint="embed")
        if self.weights.arrays[weight].dtype != self.weights.activations:
            rows = self.op("Cast", [rows], to=self.activations)
        return rows

    def const(self, value, dtype=np.int64, hint: str = "const") -> str:
        arr = np.asarray(value, dtype=dtype)
        name = f"{hint}.{next(self._ids)}"
        self.constants[name] = numpy_helper.from_array(arr, name)
        return name

    # -- nodes -----------------------------------------------------------------------------
    def op(self, op_type: str, inputs: list[str], *, outputs=None, num_outputs: int = 1, domain: str = "",
           hint: str | None = None, **attrs):
        node_id = next(self._ids)
        if outputs is None:
            base = hint or op_type.lower()
            outputs = [f"{base}.{node_id}" if num_outputs == 1 else f"{base}.{node_id}.{i}" for i in range(num_outputs)]
        node = helper.make_node(op_type, inputs, outputs, name=f"{op_type}_{node_id}", domain=domain, **attrs)
        self.nodes.append(node)
        return outputs[0] if len(outputs) == 1 else outputs

    def ms(self, op_type: str, inputs: list[str], **kwargs):
        return self.op(op_type, inputs, domain=MS_DOMAIN, **kwargs)

    def if_else(self, cond: str, then_branch, else_branch, elem_types: list[int]):
        """An ``If`` node: cond a bool of one element; each branch(builder) builds its subgraph in a
        builder of its own and returns its values (as many as elem_types, of those types). The
        branches read any value of this graph (ONNX outer scope) and put their constants and
        weights among this graph's initializers. Returns the If's output(s). Only where nothing is
        captured (the CPU graphs): the condition is read on the host."""
        graphs = []
        for label, build in (("then", then_branch), ("else", else_branch)):
            sub = GraphBuilder(f"{self.name}.{label}.{next(self._ids)}", self.weights, self.target)
            sub.constants, sub.used_weights, sub._ids = self.constants, self.used_weights, self._ids
            outputs = []
            for value, elem_type in zip(build(sub), elem_types, strict=True):
                name = sub.op("Identity", [value], hint=f"{label}_out")  # a branch output must be its own
                outputs.append(helper.make_tensor_value_info(name, elem_type, None))
            graphs.append(helper.make_graph(sub.nodes, sub.name, [], outputs))
        return self.op("If", [cond], num_outputs=len(elem_types), then_branch=graphs[0], else_branch=graphs[1])

    # -- model -----------------------------------------------------------------------------
    def build(self, weight_layout: dict[str, dict]) -> onnx.ModelProto:
        initializers = [self.weights.external_tensor(n, weight_layout[n]) for n in self.used_weights]
        initializers += list(self.constants.values())
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, initializers)
        domains = {node.domain for node in _all_nodes(self.nodes)} - {"", MS_DOMAIN}  # ORTSPEC_DOMAIN where used
        return helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1),
                           *(helper.make_opsetid(domain, 1) for domain in sorted(domains))],
            ir_version=IR_VERSION,
            producer_name="ortspec",
        )


def _all_nodes(nodes):
    """nodes and those of every If branch inside them."""
    for node in nodes:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(attribute.g.node)
