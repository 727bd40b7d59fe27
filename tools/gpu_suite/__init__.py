"""The GPU host suite behind tools/gpu.py: one module per subcommand, shared pieces in common.py.

Each subcommand module has SUMMARY (one line for `gpu.py --help`), a docstring (its --help),
add_arguments(parser) and run(args) -> exit status. Importing any of them needs no GPU (torch
and CUDA are imported where they are used), so their argument parsing and pure parts run on
the CPU in tests/test_gpu_tools.py.
"""
