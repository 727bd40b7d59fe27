"""The peer harness: onnxruntime-genai beside ortspec on the same checkpoint (tools/peer_bench.py).

    relayout  the checkpoint in the layout the peer's model builder takes
    export    the builder run, the MTP head directory, the CUDA-graph variants
    prompts   the bench's code prompts and a held-out set no other benchmark uses
    runners   one object per configuration (ortspec greedy / k, peer eager / graph / MTP N)
    rounds    interleaved timed rounds, token comparisons
    profile   one kernel profiler for both (CUPTI via torch.profiler), the bandwidth floor
    report    the JSON and the table
    progress  timestamped progress lines (host logs are read after the fact)
"""
