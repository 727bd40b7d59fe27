"""Fewer small kernels in the portable (CUDA) graphs, the same bits: one-row graphs move rows by
Reshape instead of Transpose and keep one attention bias row, and a graph expands its KV scatter
indices once for all its attention layers. The CPU variants keep their own formulation."""

from __future__ import annotations

import collections

import onnx

from ortspec.manifest import Manifest
from ortspec.runtime.graphs import GraphSet
from ortspec.speculative.exactness import check_speculative
from tests.small_models import convert_small

PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [42], [8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7]]


def op_counts(manifest: Manifest, name: str, provider: str | None = None) -> collections.Counter:
    graph = onnx.load(str(manifest.graph_path(name, provider)), load_external_data=False).graph
    return collections.Counter(node.op_type for node in graph.node)


def test_one_row_graphs_move_no_rows_and_every_graph_expands_its_kv_indices_once(models):
    """The "mixed" model: two attention layers (and the MTP head's)."""
    manifest = Manifest.load(models.converted("mixed"))
    attention, gdn = (manifest.spec.layer_types.count(kind) for kind in ("full_attention", "linear_attention"))
    decode, verify = op_counts(manifest, "decode"), op_counts(manifest, "verify_select_k2")
    assert decode["Transpose"] == 0 and decode["Expand"] == 1  # one row: the value's indices are a view of the key's
    # 4 per attention layer, 1 per GDN layer's conv window (per_row); the bias rows expanded per group
    assert verify["Transpose"] == 4 * attention + gdn and verify["Expand"] == 2 + 1
    cpu = op_counts(manifest, "decode", "cpu")
    assert cpu["Transpose"] == 4 * attention and cpu["Expand"] == 2 * attention + 1
    # the catch-up moves its new KV rows; only its last row attends, as the two draft passes, moving none
    propose = op_counts(manifest, "mtp_propose_k3")
    assert propose["Transpose"] == 2 and propose["Expand"] == 2 + 1  # the catch-up's indices; the draft passes' in one


def test_the_portable_set_stays_exact_on_the_cpu(models, tmp_path):
    """Decode and verifies of the portable graphs alone (no CPU variants) leave the same bits as a
    plain decode, with two attention layers sharing their indices and one-row passes reshaping."""
    manifest = Manifest.load(convert_small(models.checkpoint("mixed"), tmp_path / "m", num_speculative_tokens=3,
                                           max_length=64, mtp_quant="none"))
    for entry in manifest.graphs.values():
        entry.pop("cpu", None)
    for fused in (True, False):
        check_speculative(GraphSet(manifest), PROMPTS, 16, 3, "select", p=0.6, fused_verify=fused)
