"""The GPU host checks and measurements, one entry point: python3 tools/gpu.py SUBCOMMAND [options].

Needs onnxruntime-gpu and ortspec._native built with CUDA: tools/gpu_host.sh installs and
builds both, runs the native CUDA tests, then the subcommands named in GPU_TOOL. The
subcommands replace the former scripts: check (tools/gpu_check.py), batch
(gpu_batch_check.py), pipeline (gpu_pipeline.py), scale (gpu_scale.py), profile
(gpu_host_profile.py), ab (gpu_ab.sh), int4 (gpu_int4.sh), trained (gpu_trained.sh), threads
(one caller per state on CUDA) and soak (20,000+ batcher steps: memory, graph faults, solo
tokens); each makes the checks and measurements its script made. Five have no former script:
exact (float16/bfloat16 identity in exact mode, and its cost), agree (LARGE with drafts
scripted to agree with the target at a set rate: speculation's speed-up and efficiency at 1B),
stream_probe (the plain greedy loop against replays on an ortspec stream), greedy_loop (the
pipelined greedy loop against the plain one: tokens, states, speed), spec_loop (the pipelined
speculative loop against the plain one, k = 1..4: tokens, states, speed) and auto_loop (auto k's
stretches of k = 0 and runs of one k >= 1 in the pipelined loops: tokens, states, tokens/s against
greedy), kernels (GPU time per token by kernel name and class over a generate call, against the
floor), kv_windows (the KV window variants against the portable graphs: tokens, states, graph
counters, tokens/s), gdn_verify (the CUDA verify's GDN forms, convert --gdn-verify: the native
transition kernels, state and token checks per form, and verify/decode per form at 1B),
sample_dist (exact speculative sampling on the device: chi-square tests of its distributions,
planted acceptance rules caught), sample_cost (sampling on the device against greedy per
step: decode_sample, verify_mtp_sample_k{k}) and sampling_ops (the ai.ortspec sampling ops on CUDA
against the CPU's, bit for bit). Every
subcommand takes --json FILE for its results and --activations auto|float32|model for the models it
converts (convert --activations); a failed identity check makes the exit status 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ortspec.cli import HelpFormatter  # noqa: E402  (after the path: the tree's ortspec)

SUBCOMMANDS = {"check": "check", "batch": "batch", "pipeline": "pipeline", "scale": "scale",
               "profile": "host_profile", "ab": "ab", "int4": "int4", "trained": "trained", "threads": "threads",
               "soak": "soak", "exact": "exact", "agree": "agree", "stream_probe": "stream_probe",
               "greedy_loop": "greedy_loop", "spec_loop": "spec_loop", "auto_loop": "auto_loop", "kernels": "kernels",
               "kv_windows": "kv_windows", "gdn_verify": "gdn_verify", "sample_dist": "sample_dist",
               "sample_cost": "sample_cost", "sampling_ops": "sampling_ops"}


def subcommand_module(name: str):
    return importlib.import_module(f"tools.gpu_suite.{SUBCOMMANDS[name]}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tools/gpu.py", description=__doc__, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    for name in SUBCOMMANDS:
        module = subcommand_module(name)
        p = sub.add_parser(name, help=module.SUMMARY, description=module.__doc__, formatter_class=HelpFormatter)
        module.add_arguments(p)
        p.add_argument("--json", metavar="FILE", help="write this subcommand's results here as JSON")
        p.add_argument("--activations", choices=["auto", "float32", "model"], default="auto",
                       help="the activations every model this subcommand converts gets (convert --activations; "
                            "int4 conversions keep float32)")
        p.set_defaults(run=module.run)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import onnxruntime as ort

    from tools.gpu_suite import common

    common.ACTIVATIONS = args.activations

    ort.set_default_logger_severity(3)  # no "No registered plugin EP" warnings between the results
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
