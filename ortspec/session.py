"""``ortspec.Session``: the public API."""

from __future__ import annotations

from pathlib import Path

from . import validation
from .errors import InputError
from ._native_loader import load_native
from .manifest import Manifest, graph_name, stage_graph_name
from .runtime.graphs import GraphSet, check_provider
from .runtime.model import MTPHead, TargetModel
from .speculative.decoder import COMMITS, Decoder
from .speculative.requests import Request
from .speculative.stats import Stats


BATCH_BUCKETS = (1, 2, 4, 8, 16)


def batch_bucket(n: int) -> int:
    """The batch size CUDA graphs are captured for: the next of 1, 2, 4, 8, 16 (then multiples of 16).
    Padding rows hold finished placeholder requests; rows never mix, so they cannot affect real ones."""
    return next((b for b in BATCH_BUCKETS if b >= n), -(-n // 16) * 16)


class Session:
    """Greedy and MTP-speculative generation over a converted model directory.

    >>> s = ortspec.Session("out/tiny", num_speculative_tokens=2)
    >>> s.generate([1, 2, 3], max_new_tokens=8)          # list[int] -> list[int]
    >>> s.generate([[1, 2], [3, 4, 5]], max_new_tokens=8)  # batch -> list of lists
    >>> s.generate("def main(", max_new_tokens=8)          # str -> str (needs tokenizer.json)

    num_speculative_tokens k: 0 = plain greedy; 1..K (K chosen at conversion) = MTP drafts
    per step. commit: "select" (keep the verify's state after the accepted row) or
    "readvance" (restore the pre-verify state and re-run the accepted tokens). Output is
    token-identical to greedy either way (bitwise on the CPU; on a GPU in float32 - see the
    README for float16/bfloat16). threads: intra-op threads per graph session, None
    (or 0) for ONNX Runtime's default; more than the cores this process may use
    (os.sched_getaffinity) is refused with a ConfigurationError, not clamped. Every option is
    checked (ortspec.validation) before any graph session is built.
    """

    def __init__(self, model_dir: str | Path, provider: str = "cpu", num_speculative_tokens: int = 0,
                 commit: str = "select", threads: int | None = None, cuda_graphs: bool = True,
                 pipeline_stages: int = 1, devices: list[int] | None = None) -> None:
        self.manifest = Manifest.load(validation.model_dir(model_dir))
        check_provider(validation.provider(provider))
        self.stages = validation.pipeline_stages(pipeline_stages, self.manifest)
        cuda_count = load_native().build_info()["cuda_device_count"] if provider == "cuda" and devices is not None else None
        self.devices = validation.devices(devices, self.stages, cuda_count)
        self.k = validation.num_speculative_tokens(num_speculative_tokens, self.manifest)
        self.commit = validation.commit(commit, COMMITS)
        validation.model_dtype(self.manifest, provider)
        threads, cuda_graphs = validation.threads(threads), validation.cuda_graphs(cuda_graphs)
        self.graphs = GraphSet(self.manifest, provider, threads, cuda_graphs=cuda_graphs, devices=self.devices)
        self.graphs.load(self._graph_names())
        self._stats = Stats()
        self._tokenizer = None
        self._engines: dict = {}

    def _graph_names(self) -> list[str]:
        names = ["prefill", "decode"]
        if self.k:
            names += [graph_name("verify_select" if self.commit == "select" else "verify", self.k)]
        names = [g for name in names for g in ([name] if self.stages == 1 else
                                                [stage_graph_name(name, s) for s in range(self.stages)])]
        return names + ([graph_name("mtp_propose", self.k)] if self.k else [])

    # -- public ------------------------------------------------------------------------------
    @property
    def stats(self) -> dict:
        stats = self._stats.as_dict()
        stats["graphs"] = self.graphs.graph_counters()
        return stats

    def reset_stats(self) -> None:
        self._stats = Stats()

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            path = self.manifest.tokenizer_path
            if path is None:
                raise InputError(
                    f"{self.manifest.dir} has no tokenizer.json, so text prompts cannot be encoded; "
                    "pass token ids (list[int]) or convert a checkpoint that ships tokenizer.json."
                )
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(path))
        return self._tokenizer

    def generate(self, prompt, max_new_tokens: int = 32, stop_tokens=None, **decoder_options):
        """Greedy (or exact speculative) continuation of one prompt or a batch of prompts.

        prompt: token ids (list or tuple of ints or numpy integers, 1-D numpy integer array)
        -> list[int]; a batch (list of those, 2-D numpy integer array) -> list[list[int]];
        str -> str; list[str] -> list[str]. Exactly max_new_tokens tokens per request, unless a
        stop token (default: the model's eos ids; stop_tokens: one id or a list of ids, [] for
        none) ends it earlier, stop token included. decoder_options: the Decoder's hooks
        make_drafts, on_commit, fixed_rows (tests, exactness tools); any other keyword is an
        InputError. Every argument is checked before any work starts.
        """
        max_new_tokens = validation.max_new_tokens(max_new_tokens)
        stops = validation.stop_tokens(stop_tokens, self.manifest.spec.vocab_size, self.manifest.spec.eos_token_ids)
        options = validation.decoder_options(decoder_options, "generate")
        prompts, single, text = self._token_prompts(prompt)
        outs = self._generate_ids(prompts, max_new_tokens, stops, options)
        if text:
            outs = [self.tokenizer.decode(o) for o in outs]
        return outs[0] if single else outs

    def batcher(self, max_batch_size: int = 8, **decoder_options):
        """A running batch that requests join and leave between steps (add_request / step)."""
        from .speculative.batcher import Batcher

        return Batcher(self, max_batch_size, **decoder_options)

    # -- internals ---------------------------------------------------------------------------
    def _generate_ids(self, prompts, max_new_tokens, stops, decoder_options) -> list[list[int]]:
        validation.prompts_fit(prompts, max_new_tokens, self.manifest.max_length)
        validation.batch_fits_memory(len(prompts), self.manifest.states, self.graphs.arrays.device)
        if max_new_tokens == 0:
            return [[] for _ in prompts]
        requests = [Request(row=i, prompt=p, max_new_tokens=max_new_tokens, stop_tokens=stops)
                    for i, p in enumerate(prompts)]
        rows = len(requests)
        if self.graphs.arrays.device != "cpu":  # CUDA graphs per batch bucket: pad with placeholders
            rows = batch_bucket(rows)
            requests += [Request.filler(i) for i in range(len(requests), rows)]
        decoder = Decoder(self.graphs, rows, self.k, self.commit, self._stats, engine=self._engine(rows),
                          **decoder_options)
        return decoder.generate(requests)[: len(prompts)]

    def _engine(self, batch: int):
        """State buffers for a batch size, kept for the Session's life: on CUDA the captured
        graphs bind their addresses, so a later call of the same size replays them."""
        if batch not in self._engines:
            self._engines[batch] = (TargetModel(self.graphs, batch, self.stages),
                                    MTPHead(self.graphs, batch, self.k) if self.k else None)
        return self._engines[batch]

    def _token_prompts(self, prompt) -> tuple[list[list[int]], bool, bool]:
        """(prompts as token ids, single, text): text is encoded with the model's tokenizer;
        every form is checked (validation.token_prompts) before any work starts."""
        vocab = self.manifest.spec.vocab_size
        texts = validation.text_prompts(prompt)
        if texts is None:
            return *validation.token_prompts(prompt, vocab), False
        prompts, _ = validation.token_prompts([self.tokenizer.encode(t).ids for t in texts], vocab)
        return prompts, isinstance(prompt, str), True
