"""The CUDA select verify's GDN layers in each form (convert --gdn-verify; issue 23): checked, then timed.

(1) The native transition kernels on the device against the CPU kernels, at Qwen3.5-0.8B's GDN
    sizes (nk = nv = 16, dk = dv = 128, 18 layers in one launch) and LARGE's (nv = 32 over 16 key
    heads): states within 1e-5 x (1 + max |state|), conv tails bit for bit; and the replay's time.
(2) Per form (per_row, state_window, transition), the tiny model (--check-models: also MEDIUM's
    realistic head sizes, about 30 s more per form) converted in float32:
    the scripted-draft state check (every state after every commit within 1e-5 x (1 + max |state|)
    of a plain decode, k = 1..4, one- and two-Run steps: check_speculative) and Session tokens with
    the head's own drafts (the loop a Session runs) == greedy, k = 1..4. A failure fails the run.
(3) LARGE converted in float16 in each form: GPU time per step of the decode and of
    verify_select_k{k} with its select commit of every draft (step_timer.py), k = 1..4, batch 1
    and 16, rounds alternating the forms (the fastest round kept). The table comes last:
    decode ms and verify/decode per k, one row per (form, batch).

A form that ONNX Runtime refuses or that fails (state_window is the least tried) counts as a
failure, with its error printed, and the other forms go on. Estimated (not yet run on a GPU) at
2.5-3 minutes on an H200 (LARGE: one checkpoint, three conversions of ~20 s, three GraphSets;
the tiny checks ~15 s per form); --budget-s stops the timing rounds in time. --provider cpu runs
it all on the CPU with the portable graphs (tests/test_gpu_tools.py; state_window is CUDA only).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ortspec._native_loader import load_native
from ortspec.manifest import Manifest
from ortspec.runtime.graphs import GraphSet
from ortspec.speculative.exactness import plain_decode_states

from .common import (IDENTITY_PROMPTS, TINY, Budget, Checks, convert, markdown_table, random_checkpoint,
                     speculative_matches_greedy, state_check_row_steps, write_json)
from .step_timer import StepTimer

SUMMARY = "the CUDA verify's GDN forms (per_row, state_window, transition): kernel and state checks, verify/decode"
FORMS = ("per_row", "state_window", "transition")
CUDA_ONLY = {"state_window"}  # refused by the CPU kernels
STATE_ATOL = 1e-5  # x (1 + max |state|): the GPU state tolerance (exactness.within)
KERNEL_RTOL = 1e-5
# kernel_check's shapes: label -> (nk, nv, layers, dk = dv); the timed batches; the conv tail [K-1, C]
KERNEL_SHAPES = {"qwen3.5-0.8b": (16, 16, 18, 128), "large": (16, 32, 9, 128)}
KERNEL_BATCHES = (1, 16)
CONV_TAIL = (3, 8192)


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="/tmp/ortspec_gpu_gdn_verify", help="working directory (checkpoints, models)")
    parser.add_argument("--forms", default=",".join(FORMS), help="comma-separated gdn_verify forms")
    parser.add_argument("--check-models", default="tiny",
                        help="float32 models checked per form: tiny, medium, large or a checkpoint directory ('' none)")
    parser.add_argument("--time-models", default="large", help="models timed per form, as --check-models ('' none)")
    parser.add_argument("--time-dtype", default="float16", help="dtype of the timed conversions")
    parser.add_argument("--ks", default="1,2,3,4", help="comma-separated k (drafts per step) checked and timed")
    parser.add_argument("--batches", default="1,16", help="comma-separated batch sizes timed")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per graph and round")
    parser.add_argument("--rounds", type=int, default=2, help="timing rounds, alternating the forms")
    parser.add_argument("--new-tokens", type=int, default=40, help="tokens per request in the checks")
    parser.add_argument("--provider", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the same logic on the CPU's portable graphs (tests)")
    parser.add_argument("--budget-s", type=float, default=280.0, help="stop timing rounds past this (0: no limit)")


def run(args) -> int:
    budget, checks = Budget(args.budget_s), Checks()
    forms = [f for f in args.forms.split(",") if args.provider == "cuda" or f not in CUDA_ONLY]
    ks, out = [int(k) for k in args.ks.split(",")], Path(args.out)
    if args.provider == "cuda":
        checks.results["kernels"] = guarded(checks, "kernels", kernel_check, checks)
    for name in filter(None, args.check_models.split(",")):
        source = checkpoint(name, out)
        for form in forms:
            label = f"{Path(name).name} {form}"
            model = convert(source, out / f"{Path(name).name}_float32_{form}", gdn_verify=form)
            guarded(checks, label, state_check, model, label, ks, args, checks)
            print(f"{budget.elapsed():.0f} s: {label} checked", flush=True)
    tables, timings = [], []
    for name in filter(None, args.time_models.split(",")):
        source = checkpoint(name, out)
        models = {form: convert(source, out / f"{Path(name).name}_{args.time_dtype}_{form}", dtype=args.time_dtype,
                                gdn_verify=form) for form in forms}
        print(f"{budget.elapsed():.0f} s: {name} converted in {len(models)} forms", flush=True)
        rows = time_forms(models, ks, [int(b) for b in args.batches.split(",")], args, budget, checks)
        timings.append({"model": name, "dtype": args.time_dtype, "rows": rows})
        tables.append(f"### {name} ({args.time_dtype}): decode ms, verify_select_k + commit / decode\n\n"
                      f"{ratio_table(rows, ks)}")
    checks.results["timings"] = timings
    write_json(args.json, checks.results)
    status = checks.exit_status("check failures")
    print("\n" + "\n\n".join(tables))
    return status


def guarded(checks: Checks, label: str, work, *arguments):
    """work(*arguments); an exception (ONNX Runtime refusing a form's graphs, a kernel failing) is
    a recorded failure of `label`, printed, and None is returned, so the other forms still run."""
    try:
        return work(*arguments)
    except Exception as error:  # noqa: BLE001  (any failure of one form is reported, not fatal)
        print(f"FAILED {label}: {type(error).__name__}: {str(error)[:600]}", flush=True)
        checks.record(f"{label}: ran", False)
        checks.results[f"{label}: error"] = f"{type(error).__name__}: {str(error)[:600]}"
        return None


def checkpoint(name: str, out: Path) -> Path:
    """tiny (models/tiny-qwen35), medium / large (common.PRESETS, made in out), or a directory."""
    if name == "tiny":
        return TINY
    if name in ("medium", "large"):
        return random_checkpoint(out / f"{name}_ck", name)
    return Path(name)


def load_graphs(model: Path, provider: str) -> GraphSet:
    """The model's graphs; on the CPU without its CPU variants (the portable graphs: the forms' own)."""
    manifest = Manifest.load(model)
    if provider == "cpu":
        for entry in manifest.graphs.values():
            entry.pop("cpu", None)
    return GraphSet(manifest, provider=provider)


def state_check(model: Path, label: str, ks: list[int], args, checks: Checks) -> None:
    """Scripted drafts (p = 0.7): states after every commit vs a plain decode, one- and two-Run
    steps; then the Session loop with the head's own drafts == greedy."""
    graphs, prompts, n = load_graphs(model, args.provider), IDENTITY_PROMPTS[:3], args.new_tokens
    for k in ks:
        reference = plain_decode_states(graphs, prompts, n + k + 1, k)
        for fused in (True, False):
            steps = state_check_row_steps(graphs, prompts, n, k, "select", p=0.7, seed=k, reference=reference,
                                          atol=STATE_ATOL, fused_verify=fused)
            checks.record(f"{label} k={k} {'one Run' if fused else 'two Runs'}: row-steps within tolerance",
                          steps is not None, steps)
    graphs.close()
    same = speculative_matches_greedy(model, IDENTITY_PROMPTS, n, provider=args.provider, ks=ks, commits=("select",))
    for (_, k), ok in same.items():
        checks.record(f"{label} k={k}: Session tokens == greedy", ok)
    print(f"{label}: {checks.failures} check failures so far", flush=True)


def time_forms(models: dict[str, Path], ks: list[int], batches: list[int], args, budget: Budget,
               checks: Checks) -> list[dict]:
    """Per (form, batch): decode ms and verify ms per k, the fastest of the rounds run in time; a
    form that fails is dropped from the later rounds (``guarded``)."""
    graphs = {form: guarded(checks, f"timing {form}", load_graphs, model, args.provider) for form, model in models.items()}
    timers = {(form, b): StepTimer(g, b) for form, g in graphs.items() if g is not None for b in batches}
    best: dict[tuple, float] = {}
    last_round = 0.0
    for round_ in range(args.rounds):
        if round_ and budget.spent(reserve=last_round):
            print(f"budget: stopped after {round_} timing rounds", flush=True)
            break
        start = time.perf_counter()
        for form, b in list(timers):
            if (form, b) not in timers:  # its form failed at another batch size
                continue
            if guarded(checks, f"timing {form} batch {b}", time_steps, timers[(form, b)], form, ks, args.steps,
                       best) is None:
                timers = {key: t for key, t in timers.items() if key[0] != form}
        last_round = time.perf_counter() - start
        print(f"{budget.elapsed():.0f} s: timing round {round_ + 1} took {last_round:.0f} s", flush=True)
    for g in graphs.values():
        if g is not None:
            g.close()
    return [{"form": form, "batch": b, "decode_ms": best[(form, b, 0)],
             "verify_ms": {k: best[(form, b, k)] for k in ks}} for form, b in timers]


def time_steps(timer: StepTimer, form: str, ks: list[int], steps: int, best: dict) -> bool:
    """One round of one timer: decode (k = 0) and each verify, the fastest so far kept in
    best[(form, batch, k)]."""
    for k in [0, *ks]:
        ms = timer.decode_ms(steps) if k == 0 else timer.verify_ms(k, steps)
        best[(form, timer.batch, k)] = min(ms, best.get((form, timer.batch, k), ms))
    return True


def ratio_table(rows: list[dict], ks: list[int]) -> str:
    """One row per (form, batch): decode ms, then verify/decode per k."""
    header = ["form", "batch", "decode ms"] + [f"k={k}" for k in ks]
    return markdown_table(header, [[r["form"], r["batch"], f"{r['decode_ms']:.3f}"]
                                   + [f"{r['verify_ms'][k] / r['decode_ms']:.2f}" for k in ks] for r in rows])


# -- the kernels ---------------------------------------------------------------------------

def random_record(rng, batch=3, rows=4, key_heads=2, value_heads=4, key_dim=8, value_dim=6):
    """(state [B, nv, dk, dv], keys k̂ [B, M, nk, dk] of unit length, values [B, M, nv*dv], decay g <= 0
    and beta in (0, 1) [B, M, nv]), float32: one GDN layer's live state and a verify's record."""
    state = rng.standard_normal((batch, value_heads, key_dim, value_dim)).astype(np.float32)
    keys = rng.standard_normal((batch, rows, key_heads, key_dim)).astype(np.float32)
    keys /= np.linalg.norm(keys, axis=-1, keepdims=True)
    values = rng.standard_normal((batch, rows, value_heads * value_dim)).astype(np.float32)
    decay = -2 * rng.random((batch, rows, value_heads)).astype(np.float32)
    beta = rng.uniform(0.01, 0.99, (batch, rows, value_heads)).astype(np.float32)
    return state, keys, values, decay, beta


def float64_replay(state, keys, values, decay, beta, counts) -> np.ndarray:
    """The gated delta rule in float64, row by row and head by head (S <- exp(g) S, then
    S <- S + k (beta (v - S^T k))^T): the reference of the native replay_transitions."""
    out = state.astype(np.float64)
    batch, heads, _, value_dim = state.shape
    group = heads // keys.shape[2]
    for b in range(batch):
        for h in range(heads):
            for j in range(counts[b]):
                k = keys[b, j, h // group].astype(np.float64)
                v = values[b, j].reshape(heads, value_dim)[h]
                s = out[b, h]
                s *= np.exp(np.float64(decay[b, j, h]))
                s += np.outer(k, beta[b, j, h] * (v - s.T @ k))
    return out


def relative_error(got, want) -> float:
    """max |got - want| / (1 + max |want|)."""
    return float(np.max(np.abs(got - want)) / (1 + np.max(np.abs(want))))


def kernel_check(checks: Checks, device_name: str = "cuda") -> dict:
    """The CUDA replay (batch 4) and conv tails against the CPU kernels; the replay's time per call
    over all layers at batch 1 and 16 (M = 5, every row replayed). device_name "cpu": the same on
    host buffers (tests)."""
    native, rng = load_native(), np.random.default_rng(0)
    device, results = native.PersistentBuffers(device=device_name), {}

    def upload(array):
        buffer = device.allocate(f"b{len(device)}", array.shape, array.dtype)
        buffer.copy_from_numpy(np.ascontiguousarray(array))
        return buffer

    for label, (nk, nv, layers, head_dim) in KERNEL_SHAPES.items():
        records = [random_record(rng, 4, 5, nk, nv, head_dim, head_dim) for _ in range(layers)]
        counts = np.array([5, 0, 3, 1], np.int64)
        gpu = [[upload(part) for part in record] for record in records]
        native.replay_transitions(*([r[i] for r in gpu] for i in range(5)), upload(counts))
        worst = 0.0
        for record, on_device in zip(records, gpu):
            want = record[0].copy()
            native.replay_transitions([want], *([p] for p in record[1:]), counts)
            worst = max(worst, relative_error(on_device[0].to_numpy(), want))
        native.check_device_errors()
        checks.record(f"kernels {label}: CUDA replay within {KERNEL_RTOL} of the CPU", worst < KERNEL_RTOL, worst)
        for batch in KERNEL_BATCHES:
            timed = [[upload(part) for part in random_record(rng, batch, 5, nk, nv, head_dim, head_dim)]
                     for _ in range(layers)]
            results[f"{label} replay us, batch {batch}, {layers} layers"] = replay_us(
                native, timed, upload(np.full(batch, 5, np.int64)), device_name)
    tail = rng.standard_normal((16, *CONV_TAIL)).astype(np.float32)  # [B, K-1, C]
    inputs = rng.standard_normal((16, 5, CONV_TAIL[1])).astype(np.float32)  # [B, M, C]
    counts = rng.integers(0, 6, 16).astype(np.int64)
    on_device = upload(tail)
    native.commit_conv_tails([on_device], [upload(inputs)], upload(counts))
    native.commit_conv_tails([tail], [inputs], counts)
    checks.record("kernels: CUDA conv tails == CPU", bool(np.array_equal(on_device.to_numpy(), tail)))
    print("kernels:", {name: round(us, 1) for name, us in results.items()}, flush=True)
    return results


def replay_us(native, layers: list, counts, device_name: str, calls: int = 20) -> float:
    """Microseconds per replay_transitions call over every layer (calls back to back, one wait)."""
    wait = (lambda: native.synchronize(0, 0)) if device_name == "cuda" else (lambda: None)
    wait()
    start = time.perf_counter()
    for _ in range(calls):
        native.replay_transitions(*([layer[i] for layer in layers] for i in range(5)), counts)
    wait()
    return 1e6 * (time.perf_counter() - start) / calls
