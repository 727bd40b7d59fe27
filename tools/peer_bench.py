"""ortspec beside onnxruntime-genai (the peer) on the same checkpoint, in one process.

    python tools/peer_bench.py MODEL_CHECKPOINT_DIR [--json F] [--provider cuda|cpu] [--skip-peer]
    python tools/peer_bench.py --large [--work DIR]       # the 1B random model of tools/gpu.py scale
    python tools/peer_bench.py --report F.json            # print the tables of an earlier run

1. Export: ortspec converts the checkpoint (fp16; with --provider cpu float32, whose CPU graph
   variants a CPU Session runs); the peer's own builder exports the re-laid checkpoint (fp16 for
   its CUDA EP; with --provider cpu fp32 for its CPU EP, with its fused CPU kernels) and the
   harness writes its MTP head directory and CUDA-graph variants (tools/peer/export.py).
   --precision overrides the choice for both; --threads gives both the same intra-op threads.
2. Interleaved rounds over the bench's code prompts and a held-out set (tools/peer/prompts.py),
   batch 1, 128 new tokens: ortspec greedy and k = 1..4; peer eager and CUDA-graph greedy; peer
   MTP N = 1..4, eager and with graphs. tok/s and ms/token are medians over rounds (min-max
   beside); every configuration's tokens are compared with ortspec's greedy and the peer's eager.
3. On CUDA, a kernel profile of chosen configurations with one profiler (CUPTI) against the
   bandwidth floor (tools/peer/profile.py).
Every peer configuration is guarded: one that fails is reported and the rest go on. The JSON is
rewritten after each phase; the tables come last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ortspec  # noqa: E402
from ortspec.errors import CheckpointNotFoundError, ConfigurationError, OrtspecError  # noqa: E402
from ortspec.runtime.graphs import check_provider  # noqa: E402
from tools.peer import export, profile, relayout, report, rounds, runners  # noqa: E402
from tools.peer.progress import say  # noqa: E402
from tools.peer.prompts import load_prompts  # noqa: E402

DTYPES = {"fp16": "float16", "fp32": "float32"}  # --precision -> ortspec.convert's dtype
DEFAULT_PROFILE = ("ortspec greedy", "ortspec k=2", "peer eager", "peer graph", "peer mtp N=2", "peer mtp N=2 graph")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", nargs="?", type=Path, help="HuggingFace checkpoint directory (config + safetensors)")
    p.add_argument("--large", action="store_true", help="generate and use LARGE of tools/gpu.py scale (in --work)")
    p.add_argument("--report", type=Path, help="print the tables of an earlier --json result and exit")
    p.add_argument("--work", type=Path, default=Path("/tmp/ortspec_peer"), help="exports go here")
    p.add_argument("--reuse-exports", action="store_true", help="keep --work's exports if made from this checkpoint")
    p.add_argument("--json", type=Path)
    p.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--precision", choices=("fp16", "fp32"), default=None,
                   help="both exports' precision (default: fp16 on cuda, fp32 on cpu)")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads of both runtimes' sessions (default: ONNX Runtime's choice)")
    p.add_argument("--skip-peer", action="store_true", help="ortspec only (no onnxruntime-genai needed)")
    p.add_argument("--no-graph", action="store_true", help="leave out the peer's CUDA-graph configurations")
    p.add_argument("--k", default="1,2,3,4", help="ortspec speculative k values (greedy always runs)")
    p.add_argument("--mtp", default="1,2,3,4", help="peer MTP N values ('' for none)")
    p.add_argument("--prompts-per-set", type=int, default=8, help="prompts of each set (code, held-out), 1..8")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-length", type=int, default=256, help="KV capacity of both runtimes (prompt + new tokens)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=240.0, help="time for the timed rounds (at least one runs)")
    p.add_argument("--profile", default=",".join(DEFAULT_PROFILE), help="configurations to profile; 'none' or 'all'")
    p.add_argument("--profile-tokens", type=int, default=64)
    p.add_argument("--peer-path", type=Path, default=os.environ.get("ORTSPEC_PEER_PATH") or ROOT / ".peer-cpu",
                   help="a directory holding onnxruntime_genai (and onnx_ir), put first on the import path")
    return p.parse_args(argv)


def int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigurationError(f"--{what} {text!r}: give comma-separated integers, e.g. 1,2,3,4") from None
    if any(not 1 <= v <= 4 for v in values):
        raise ConfigurationError(f"--{what} {text!r}: values must be in 1..4 (the conversion's K is 4)")
    return values


def use_peer_path(path: Path) -> None:
    """Put `path` first on this process's import path and on the builder subprocess's PYTHONPATH."""
    if path and Path(path).is_dir():
        sys.path.insert(0, str(path))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")]))


def large_checkpoint(work: Path) -> Path:
    """LARGE of tools/gpu.py scale (seed 3), stored fp16 (~1.8 GB; both sides run it in fp16).
    Reused when present: config.json is written after the weights, so it marks a finished one."""
    from tools.gpu_suite.common import LARGE
    from tools.make_tiny_checkpoint import make_checkpoint

    out = work / "large_ck"
    if not (out / "config.json").exists():
        say(f"generating LARGE in {out}")
        make_checkpoint(out, seed=3, dtype="float16", **LARGE)
    return out


def make_runners(args, ortspec_dir: Path, peer_dirs, order: list, errors: dict) -> dict:
    """name -> runner; every wanted name goes to `order` (report order), and a configuration
    that cannot be built to `errors` with its message."""
    wanted = [("ortspec greedy", lambda: runners.OrtspecRunner(ortspec_dir, args.provider, 0, args.threads))]
    wanted += [(f"ortspec k={k}", lambda k=k: runners.OrtspecRunner(ortspec_dir, args.provider, k, args.threads))
               for k in int_list(args.k, "k")]
    if peer_dirs is not None:
        models = runners.PeerModels(peer_dirs)
        graphs = [False] if args.provider == "cpu" or args.no_graph else [False, True]
        wanted += [(f"peer {'graph' if g else 'eager'}",
                    lambda g=g: runners.PeerGreedyRunner(models, g, args.max_length)) for g in graphs]
        wanted += [(f"peer mtp N={k}" + (" graph" if g else ""),
                    lambda g=g, k=k: runners.PeerMtpRunner(models, g, k, args.max_length))
                   for g in graphs for k in int_list(args.mtp, "mtp")]
    built = {}
    for name, make in wanted:
        order.append(name)
        try:
            built[name] = make()
        except Exception as err:  # noqa: BLE001 - reported per configuration
            errors[name] = f"load: {type(err).__name__}: {str(err).strip()[:300]}"
            say(f"{name} could not be loaded ({errors[name]})")
    return built


def profile_all(args, built: dict, prompt, floor: dict, bandwidth: float) -> dict:
    names = list(built) if args.profile == "all" else [n for n in args.profile.split(",") if n in built]
    profiles = {}
    for name in [] if args.profile == "none" else names:
        say(f"profiling {name}")
        try:
            p = profile.kernel_profile(lambda: len(built[name].generate(prompt.ids, args.profile_tokens)))
            profiles[name] = {**p, **profile.against_floor(p, floor["total"], bandwidth)}
        except Exception as err:  # noqa: BLE001
            profiles[name] = {"error": f"{type(err).__name__}: {str(err).strip()[:200]}"}
    return profiles


def precision(args) -> str:
    """--precision, or the provider's: fp16 on CUDA, fp32 on the CPU."""
    return args.precision or ("fp32" if args.provider == "cpu" else "fp16")


def export_both(args, checkpoint: Path, result: dict):
    """ortspec's conversion, then the peer's export (a failure there leaves ortspec running), both
    in precision(args). With --reuse-exports both are kept from an earlier run when exports.json
    shows it was made from the same checkpoint files, max_length and precision (the host
    script's retry uses this)."""
    chosen = precision(args)
    stamp_path, stamp = args.work / "exports.json", export.source_stamp(checkpoint, args.max_length, chosen)
    reuse = args.reuse_exports and stamp_path.exists() and json.loads(stamp_path.read_text()) == stamp
    ortspec_dir = args.work / f"ortspec_{chosen}"
    if not reuse:
        stamp_path.unlink(missing_ok=True)
        for stale in (ortspec_dir, args.work / "peer"):  # never reuse an export of another checkpoint
            shutil.rmtree(stale, ignore_errors=True)
        say(f"converting {checkpoint} with ortspec ({chosen})")
        start = time.perf_counter()
        ortspec.convert(checkpoint, ortspec_dir, num_speculative_tokens=4, dtype=DTYPES[chosen],
                        max_length=args.max_length, progress=False)
        result["setup"]["ortspec_convert_s"] = time.perf_counter() - start
        stamp_path.write_text(json.dumps(stamp))
    result["setup"]["reused_exports"] = reuse
    if args.skip_peer:
        return ortspec_dir, None
    start = time.perf_counter()
    try:
        if reuse and (args.work / "peer" / "genai_config.json").exists():
            return ortspec_dir, export.model_dirs(args.work / "peer", args.provider, args.threads)
        say(f"exporting with onnxruntime-genai's builder ({chosen}, {'CPU' if chosen == 'fp32' else 'CUDA'} EP)")
        peer_dirs = export.export_peer(checkpoint, args.work, args.provider, chosen, args.threads)
    except Exception as err:  # noqa: BLE001
        result["setup"]["peer_error"] = f"{type(err).__name__}: {err}"
        result["notes"].append(f"the peer's export failed ({type(err).__name__}: {str(err).splitlines()[0]}); "
                               "ortspec ran alone")
        say(f"the peer's export failed; running ortspec alone.\n{err}")
        return ortspec_dir, None
    result["setup"]["peer_export_s"] = time.perf_counter() - start
    return ortspec_dir, peer_dirs


def versions(provider: str) -> dict:
    import onnxruntime as ort

    out = {"onnxruntime": ort.__version__, "ortspec": ortspec.__file__}
    try:
        import onnxruntime_genai as og

        out["onnxruntime_genai"] = og.__version__
    except ImportError:
        out["onnxruntime_genai"] = None
    if provider == "cuda":
        import torch

        out["device"] = torch.cuda.get_device_name()
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)  # 0; 3 when an ortspec configuration failed (a sticky CUDA error, say)
    except OrtspecError as err:
        print(f"peer_bench: {err}", file=sys.stderr)
        return 2


def check_args(args) -> None:
    """Refuse bad options before minutes of export, naming the option and what to give."""
    check_provider(args.provider)
    int_list(args.k, "k")
    int_list(args.mtp, "mtp")
    if (args.checkpoint is None) == (not args.large):
        raise ConfigurationError("give a checkpoint directory or --large (exactly one of them)")
    for name, value, low in (("prompts-per-set", args.prompts_per_set, 1), ("max-new-tokens", args.max_new_tokens, 1),
                             ("rounds", args.rounds, 1), ("profile-tokens", args.profile_tokens, 1)):
        if value < low:
            raise ConfigurationError(f"--{name} {value}: must be at least {low}")


def checked_prompts(args, checkpoint: Path) -> list:
    """Both prompt sets; max_length must hold the longest prompt, the new tokens and a draft
    window (8), since both runtimes size their caches by it."""
    config = relayout.text_config_of(json.loads((checkpoint / "config.json").read_text()))
    prompts = load_prompts(checkpoint, config["vocab_size"], args.prompts_per_set)
    need = max(len(p.ids) for p in prompts) + args.max_new_tokens + 8
    if need > args.max_length:
        raise ConfigurationError(f"--max-length {args.max_length} is too small for the longest prompt + "
                                 f"--max-new-tokens {args.max_new_tokens} + 8 draft positions; use --max-length {need}")
    return prompts


def add_floor(result: dict, checkpoint: Path, prompts) -> None:
    """The bandwidth floor per token at the mean context of the run, and the copy rate (CUDA)."""
    import torch

    from tools.gpu_suite.scale import copy_bandwidth

    context = round(statistics.mean(len(p.ids) for p in prompts) + result["max_new_tokens"] / 2)
    result["floor"] = profile.floor_bytes_per_token(checkpoint, context)
    result["bandwidth_bytes_per_s"] = copy_bandwidth()
    torch.cuda.empty_cache()  # the copy's 4 GiB go back to the device, not to torch's cache


def run(args) -> int:
    if args.report:
        print(report.format_report(report.read_json(args.report)))
        return 0
    check_args(args)
    use_peer_path(args.peer_path)
    args.work.mkdir(parents=True, exist_ok=True)
    checkpoint = large_checkpoint(args.work) if args.large else args.checkpoint
    if not (checkpoint / "config.json").is_file():
        raise CheckpointNotFoundError(f"{checkpoint} has no config.json: pass a HuggingFace checkpoint directory")
    prompts = checked_prompts(args, checkpoint)
    result = {"checkpoint": str(checkpoint), "provider": args.provider, "precision": precision(args),
              "threads": args.threads, "max_new_tokens": args.max_new_tokens,
              "max_length": args.max_length, "num_prompts": len(prompts), "prompts": [vars(p) for p in prompts],
              "setup": {}, "notes": [], "complete": False, "versions": versions(args.provider)}
    report.write_json(result, args.json)
    ortspec_dir, peer_dirs = export_both(args, checkpoint, result)
    if args.provider == "cpu" and peer_dirs is not None:
        export_kind = "fp32 CPU export" if precision(args) == "fp32" else "fp16 CUDA export with providers cleared"
        result["notes"].append(f"peer on the CPU: its {export_kind}, shared_initializers dropped (its CPU runtime "
                               f"refuses them), {args.threads or 'default'} intra-op threads; no graph configurations")
    if args.provider == "cuda":
        add_floor(result, checkpoint, prompts)
    say("loading the configurations")
    order, errors = [], {}
    built = make_runners(args, ortspec_dir, peer_dirs, order, errors)

    def save(runs, done_rounds):
        all_runs = {n: runs.get(n) or rounds.ConfigRun(n, n.split()[0], error=errors.get(n)) for n in order}
        result.update(configs=report.config_rows(all_runs, built, result.get("floor"),
                                                 result.get("bandwidth_bytes_per_s")), rounds_done=done_rounds)
        report.write_json(result, args.json)

    save({}, 0)  # a run cut short during warm-up still leaves its setup and load errors
    runs = rounds.run_rounds(built, prompts, args.max_new_tokens, args.rounds, args.budget_s, on_round=save)
    save(runs, result.get("rounds_done", 0))
    if args.provider == "cuda" and args.profile != "none":
        live = {n: r for n, r in built.items() if runs[n].error is None}
        result["profiles"] = profile_all(args, live, prompts[0], result["floor"], result["bandwidth_bytes_per_s"])
    result["complete"] = True
    report.write_json(result, args.json)
    print(report.format_report(result))
    return 3 if any(runs[n].error for n in built if n.startswith("ortspec")) else 0


if __name__ == "__main__":
    sys.exit(main())
