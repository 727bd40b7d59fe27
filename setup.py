"""Build of the extension module ortspec._native (pybind11), with CUDA when nvcc is found.

Project metadata lives in pyproject.toml; this file only describes the extension,
because whether CUDA is compiled is decided at build time:

- nvcc is looked up in $CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda/bin, then PATH.
  Found (and ORTSPEC_NO_CUDA != 1): csrc/cuda/*.cu are compiled by nvcc for
  ORTSPEC_CUDA_ARCH (default "90", e.g. "80;90"), ORTSPEC_WITH_CUDA is defined, and the
  static CUDA runtime is linked, so the module imports on machines without a GPU or
  driver (cuda_available() is then False). Not found: a CPU-only module, and a message.
- C++ and CUDA sources compile in parallel (ORTSPEC_BUILD_JOBS, default: all cores).
- CUDAHOSTCXX picks nvcc's host compiler, as in CMake.

    pip install -e .                                     # development
    pip install --no-build-isolation --no-deps -e .      # hosts without a registry
    ORTSPEC_NO_CUDA=1 pip install -e .                   # force a CPU-only build
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, NamedTuple, Optional

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"


def relative_sources(*patterns: str) -> List[str]:
    """Sources as paths relative to the project root (setuptools refuses absolute ones)."""
    found = sorted(p for pattern in patterns for p in CSRC.glob(pattern))
    return [p.relative_to(ROOT).as_posix() for p in found]


CPP_SOURCES = relative_sources("core/*.cpp", "python/*.cpp")
CUDA_SOURCES = relative_sources("cuda/*.cu")
HEADERS = relative_sources("core/*.h", "cuda/*.h", "cuda/*.cuh", "python/*.h")


def log(message: str) -> None:
    print(f"ortspec setup: {message}", flush=True)


class CudaToolkit(NamedTuple):
    nvcc: str
    library_dir: str  # holds libcudart_static.a
    archs: List[str]  # e.g. ["80", "90"]


def find_nvcc() -> Optional[Path]:
    candidates = [Path(os.environ[var]) / "bin" / "nvcc"
                  for var in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(var)]
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(Path(on_path))
    return next((c for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)


def find_cudart_static(nvcc: Path) -> Optional[str]:
    """The directory of libcudart_static.a, as nvcc itself would link it.

    Asking nvcc (--dryrun prints its -L directories) covers wrapper scripts on PATH and
    the targets/<arch>/lib layout; the toolkit-root guesses are the fallback.
    """
    try:
        dryrun = subprocess.run([str(nvcc), "--dryrun", "-x", "cu", "-c", os.devnull,
                                 "-o", os.devnull], capture_output=True, text=True, timeout=60)
        directories = re.findall(r'"-L([^"]+)"', dryrun.stdout + dryrun.stderr)
    except (OSError, subprocess.SubprocessError):
        directories = []
    root = nvcc.resolve().parent.parent
    directories += [str(root / "lib64"), str(root / "lib")]
    return next((d for d in directories if (Path(d) / "libcudart_static.a").is_file()), None)


def cuda_archs() -> List[str]:
    text = os.environ.get("ORTSPEC_CUDA_ARCH", "90")
    archs = [a.strip() for a in re.split(r"[;,\s]+", text) if a.strip()]
    bad = [a for a in archs if not re.fullmatch(r"\d+[af]?", a)]
    if not archs or bad:
        sys.exit(f"ortspec setup: ORTSPEC_CUDA_ARCH={text!r} is not a list of compute "
                 f"capabilities like '90' or '80;90'")
    return archs


def find_cuda() -> Optional[CudaToolkit]:
    """The CUDA toolkit to build with, or None (with the reason printed)."""
    if os.environ.get("ORTSPEC_NO_CUDA") == "1":
        log("ORTSPEC_NO_CUDA=1: building without CUDA (CPU-only ortspec._native)")
        return None
    nvcc = find_nvcc()
    if nvcc is None:
        log("nvcc not found (CUDA_HOME, CUDA_PATH, /usr/local/cuda, PATH): building without "
            "CUDA (CPU-only ortspec._native)")
        return None
    library_dir = find_cudart_static(nvcc)
    if library_dir is None:
        log(f"{nvcc} found but not libcudart_static.a: building without CUDA")
        return None
    toolkit = CudaToolkit(str(nvcc), library_dir, cuda_archs())
    log(f"building with CUDA: {toolkit.nvcc}, sm_{', sm_'.join(toolkit.archs)}")
    return toolkit


def nvcc_command(toolkit: CudaToolkit, source: str, obj: str, pp_opts: List[str]) -> List[str]:
    include_dirs = [opt for opt in pp_opts if opt.startswith("-I")]
    gencodes = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in toolkit.archs]
    host_compiler = os.environ.get("CUDAHOSTCXX")
    return [
        toolkit.nvcc, "-c", source, "-o", obj, "-O3", "-std=c++17",
        "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
        "-DORTSPEC_WITH_CUDA", *gencodes, *include_dirs,
        *(["-ccbin", host_compiler] if host_compiler else []),
    ]


class BuildNativeExtension(build_ext):
    """pybind11's build_ext, plus .cu sources compiled by nvcc when CUDA is found.

    The .cu files go through the same compiler.compile() call as the C++ files (a
    per-file hook dispatches them to nvcc), so ParallelCompile runs both in parallel.
    """

    def build_extensions(self) -> None:
        toolkit = find_cuda()
        version = self.distribution.get_version()
        self._rebuild_if_configuration_changed(f"{version} {toolkit}")
        for extension in self.extensions:
            extension.define_macros.append(("ORTSPEC_VERSION", f'"{version}"'))
            if toolkit is not None:
                extension.sources += CUDA_SOURCES
                extension.define_macros += [
                    ("ORTSPEC_WITH_CUDA", None),
                    ("ORTSPEC_CUDA_ARCHS", '"' + ";".join(toolkit.archs) + '"'),
                ]
                extension.library_dirs.append(toolkit.library_dir)
                # Static runtime: nothing CUDA to find at import; it looks for the driver
                # only when a CUDA function is first called.
                extension.libraries += ["cudart_static", "rt", "pthread", "dl"]
        if toolkit is not None:
            self._compile_cu_with_nvcc(toolkit)
        super().build_extensions()

    def _rebuild_if_configuration_changed(self, configuration: str) -> None:
        """Forces a full rebuild when CUDA on/off, archs or nvcc changed since the last build.

        setuptools only compares file times, so a reused build/ directory would otherwise
        keep a CUDA module after ORTSPEC_NO_CUDA=1 (or the reverse).
        """
        stamp = Path(self.build_temp) / "ortspec_build_configuration.txt"
        if not stamp.is_file() or stamp.read_text() != configuration:
            self.force = True
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(configuration)

    def _compile_cu_with_nvcc(self, toolkit: CudaToolkit) -> None:
        compiler = self.compiler
        compiler.src_extensions.append(".cu")
        compile_host_source = compiler._compile

        def compile_source(obj, source, ext, cc_args, extra_postargs, pp_opts):
            if source.endswith(".cu"):
                self.spawn(nvcc_command(toolkit, source, obj, pp_opts))
            else:
                compile_host_source(obj, source, ext, cc_args, extra_postargs, pp_opts)

        compiler._compile = compile_source


ParallelCompile("ORTSPEC_BUILD_JOBS").install()

setup(
    ext_modules=[
        Pybind11Extension(
            "ortspec._native",
            sources=CPP_SOURCES,
            include_dirs=["csrc"],
            depends=HEADERS + CUDA_SOURCES,  # rebuild triggers; also shipped in sdists
            cxx_std=17,
        )
    ],
    cmdclass={"build_ext": BuildNativeExtension},
)
