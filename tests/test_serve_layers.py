"""tools/serve_layers.py end to end on a tiny model: every layer's throughput row and every
latency row (HTTP through both engines included) is measured and positive. Timing itself is not
asserted: performance is measured, not tested."""

from __future__ import annotations

import json

from tools import serve_layers

LAYERS = {"generate", "batcher", "engine thread", "engine process"}


def test_serve_layers_measures_every_layer(tokenized_model, tmp_path):
    report_path = tmp_path / "layers.json"
    assert serve_layers.main([str(tokenized_model), "--clients", "1,2", "--requests", "1", "--max-tokens", "3",
                              "--rounds", "1", "--latency", "2", "--threads", "1", "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert set(report["throughput"]) == {"1", "2"}
    for row in report["throughput"].values():
        assert set(row) == LAYERS
        assert all(len(values) == 1 and values[0] > 0 for values in row.values())
    latency = report["latency_p50_ms"]
    for layer in ("batcher", "engine thread", "engine process"):
        assert latency[f"{layer}, 1 tokens"] > 0 and latency[f"{layer}, 3 tokens"] > 0
    http = [name for name in latency if name.startswith("http")]
    assert len(http) == 8 and all(latency[name] > 0 for name in http)  # 2 engines x 2 sizes x streamed / whole
