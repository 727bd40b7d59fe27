"""tools/cpu_decode_floor.py on a tiny model: the floor graph holds exactly the decode's weight
MatMuls (their products equal the decode's own nodes'), and the table prints (timings not asserted)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort

from ortspec.manifest import Manifest
from tests.small_models import convert_small
from tools import cpu_decode_floor


def test_floor_graph_is_the_decodes_weight_products(models, tmp_path, capsys):
    out = convert_small(models.checkpoint("base"), tmp_path / "m")
    manifest = Manifest.load(out)
    model, names, feeds = cpu_decode_floor.floor_model(manifest, "decode", batch=2)
    decode = onnx.load(str(out / "decode.cpu.onnx"), load_external_data=False)
    assert names == [n.input[1] for n in decode.graph.node if n.op_type == "MatMul" and n.input[1] in manifest.weights]
    assert "lm_head" in names and all(node.op_type == "MatMul" for node in model.graph.node)
    path = out / "floor.onnx"
    onnx.save(model, str(path))
    results = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    lm_head = manifest.weights["lm_head"]
    weight = np.fromfile(out / "weights.bin", np.uint8)[lm_head["offset"]: lm_head["offset"] + lm_head["length"]]
    expected = np.ones((2, 1, lm_head["shape"][0]), np.float32) @ weight.view(np.float32).reshape(lm_head["shape"])
    np.testing.assert_allclose(results[names.index("lm_head")], expected, rtol=1e-5, atol=1e-4)
    assert cpu_decode_floor.main([str(out), "--rounds", "1", "--block", "2", "--position", "5"]) == 0
    assert "weight MatMuls alone" in capsys.readouterr().out and not (out / ".floor_decode.onnx").exists()
