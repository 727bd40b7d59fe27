"""Build of the extension module ortspec._native (pybind11), with CUDA kernels where they can run.

Project metadata lives in pyproject.toml; this file only describes the extension, because
whether CUDA is compiled is decided at build time (``cuda_decision``):

- ORTSPEC_NO_CUDA=1 (or ORTSPEC_CUDA=0): never; a CPU-only module.
- ORTSPEC_CUDA=1: always; the build fails if nvcc or libcudart_static.a is not found. For a
  wheel or an image built on a machine without a GPU for hosts with one.
- Neither (the default): when this machine has an NVIDIA driver (/proc/driver/nvidia exists,
  or ``nvidia-smi -L`` lists a GPU) and nvcc is found. A machine without a GPU builds the
  CPU-only module even where a CUDA toolkit is installed: the kernels could not run there,
  and nvcc costs half a minute per build.

With CUDA, csrc/cuda/*.cu are compiled by nvcc (looked up in $CUDA_HOME/bin, $CUDA_PATH/bin,
/usr/local/cuda/bin, then PATH) for ORTSPEC_CUDA_ARCH (default "90", e.g. "80;90"),
ORTSPEC_WITH_CUDA is defined, and the static CUDA runtime is linked, so the module imports on
machines without a GPU or driver (cuda_available() is then False). CUDAHOSTCXX picks nvcc's
host compiler, as in CMake. C++ and CUDA sources compile in parallel (ORTSPEC_BUILD_JOBS,
default: all cores).

Every object file and the linked module are kept in build/ortspec-cache/ (git-ignored), keyed
by a hash of what made them: the source and every header, the compile or link command, the
compiler, Python and pybind11. pip builds each ``pip install -e .`` in a fresh temporary
directory, so without the cache every install recompiled everything; with it, an install with
nothing changed compiles and links nothing. Entries unused for CACHE_DAYS days are deleted;
``rm -rf build`` clears the cache.

    pip install -e .                                     # development
    pip install --no-build-isolation --no-deps -e .      # hosts without a registry
    ORTSPEC_NO_CUDA=1 pip install -e .                   # a CPU-only build
    ORTSPEC_CUDA=1 pip install -e .                      # the CUDA kernels, GPU or not
"""

import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
CACHE_DIR = ROOT / "build" / "ortspec-cache"
CACHE_DAYS = 14


def relative_sources(*patterns: str) -> List[str]:
    """Sources as paths relative to the project root (setuptools refuses absolute ones)."""
    found = sorted(p for pattern in patterns for p in CSRC.glob(pattern))
    return [p.relative_to(ROOT).as_posix() for p in found]


CPP_SOURCES = relative_sources("core/*.cpp", "python/*.cpp")
CUDA_SOURCES = relative_sources("cuda/*.cu")
HEADERS = relative_sources("core/*.h", "cuda/*.h", "cuda/*.cuh", "python/*.h")


def log(message: str) -> None:
    print(f"ortspec setup: {message}", flush=True)


# -- whether to compile CUDA ------------------------------------------------------------------

class CudaDecision(NamedTuple):
    build: bool  # compile csrc/cuda/*.cu
    required: bool  # asked for by ORTSPEC_CUDA=1: a missing toolkit fails the build
    reason: str


def cuda_decision(environ: Mapping[str, str], gpu_present: Callable[[], bool]) -> CudaDecision:
    """The rule of the module docstring; gpu_present is asked only when no variable decides."""
    for name in ("ORTSPEC_NO_CUDA", "ORTSPEC_CUDA"):
        if environ.get(name, "") not in ("", "0", "1"):
            sys.exit(f"ortspec setup: {name}={environ[name]!r}: use 1 or 0, or leave it unset")
    if environ.get("ORTSPEC_NO_CUDA") == "1" or environ.get("ORTSPEC_CUDA") == "0":
        switch = "ORTSPEC_NO_CUDA=1" if environ.get("ORTSPEC_NO_CUDA") == "1" else "ORTSPEC_CUDA=0"
        return CudaDecision(False, False, f"{switch}: building without CUDA")
    if environ.get("ORTSPEC_CUDA") == "1":
        return CudaDecision(True, True, "ORTSPEC_CUDA=1: building with CUDA")
    if gpu_present():
        return CudaDecision(True, False, "an NVIDIA GPU is present: building with CUDA where nvcc is found")
    return CudaDecision(False, False, "no NVIDIA GPU or driver here (nvidia-smi -L, /proc/driver/nvidia): "
                                      "building without CUDA; ORTSPEC_CUDA=1 compiles the CUDA kernels anyway")


def nvidia_gpu_present() -> bool:
    """Whether this machine has an NVIDIA driver: /proc/driver/nvidia (Linux), or a GPU that
    ``nvidia-smi -L`` lists (also where /proc has no driver entry, as under WSL)."""
    if Path("/proc/driver/nvidia").exists():
        return True
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


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


def find_cuda(decision: CudaDecision) -> Optional[CudaToolkit]:
    """The CUDA toolkit to build with, or None (with the reason printed); exits where CUDA
    was required and is missing."""
    if not decision.build:
        log(decision.reason)
        return None
    nvcc = find_nvcc()
    library_dir = find_cudart_static(nvcc) if nvcc is not None else None
    if library_dir is None:
        missing = ("nvcc not found (CUDA_HOME, CUDA_PATH, /usr/local/cuda, PATH)" if nvcc is None
                   else f"{nvcc} found but not libcudart_static.a")
        if decision.required:
            sys.exit(f"ortspec setup: ORTSPEC_CUDA=1 but {missing}; install the CUDA toolkit or unset ORTSPEC_CUDA")
        log(f"{missing}: building without CUDA (CPU-only ortspec._native)")
        return None
    toolkit = CudaToolkit(str(nvcc), library_dir, cuda_archs())
    log(f"{decision.reason}: {toolkit.nvcc}, sm_{', sm_'.join(toolkit.archs)}")
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


# -- the build cache --------------------------------------------------------------------------

def digest(*parts: str) -> str:
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(part.encode())
        hasher.update(b"\0")
    return hasher.hexdigest()


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tool_identity(program: str) -> str:
    """A compiler or linker as the cache key sees it: its resolved path, size and mtime (an
    upgraded compiler makes new keys)."""
    found = shutil.which(program)
    if found is None:
        return program
    resolved = Path(found).resolve()
    stat = resolved.stat()
    return f"{resolved}:{stat.st_size}:{stat.st_mtime_ns}"


def build_context(pybind11_version: str) -> str:
    """What every object depends on beside its own source and command: the headers, and the
    Python and pybind11 it is built for (their include paths are left out of the commands:
    under build isolation pybind11's lies in a new temporary directory every time)."""
    headers = [f"{h}:{file_digest(ROOT / h)}" for h in HEADERS]
    return digest(sys.version, sysconfig.get_config_var("EXT_SUFFIX") or "", pybind11_version, *headers)


def object_key(command: List[str], source: Path, context: str) -> str:
    """The cache key of one object file: its compile command without include paths and output
    path (pass the command with the output left out), the compiler, the source's bytes and the
    build context."""
    flags = [arg for arg in command if not arg.startswith("-I")]
    return digest(context, tool_identity(command[0]), *flags, file_digest(source))


class BuildCache:
    """Built files by key (``object_key``, or the link's), in one directory, written atomically."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def fetch(self, key: str, suffix: str, destination: str) -> bool:
        """Copies the entry to destination; False where there is none."""
        entry = self.directory / f"{key}{suffix}"
        if not entry.is_file():
            return False
        Path(destination).parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copy(entry, destination)
        except FileNotFoundError:
            return False
        os.utime(entry)  # last used: what prune reads
        return True

    def store(self, key: str, suffix: str, built: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        partial = self.directory / f".{key}{suffix}.{os.getpid()}.{threading.get_ident()}"
        shutil.copy(built, partial)
        os.replace(partial, self.directory / f"{key}{suffix}")

    def prune(self, max_age_s: float) -> None:
        """Deletes entries unused for max_age_s seconds (and partial ones left by a killed build)."""
        if not self.directory.is_dir():
            return
        cutoff = time.time() - max_age_s
        for entry in self.directory.iterdir():
            if entry.stat().st_mtime < cutoff:
                entry.unlink(missing_ok=True)


def cached_build(cache: BuildCache, key: str, suffix: str, output: str, build: Callable[[], None],
                 outcomes: List[bool]) -> None:
    """Puts the cached entry at output, or builds it there and caches it; appends whether it
    came from the cache to outcomes."""
    hit = cache.fetch(key, suffix, output)
    if not hit:
        build()
        cache.store(key, suffix, output)
    outcomes.append(hit)


class CachedNativeBuild:
    """A build_ext mixin: .cu sources compiled by nvcc when CUDA is on, and every object and the
    linked module taken from the build cache where it holds them (module docstring).

    The .cu files go through the same compiler.compile() call as the C++ files (a per-file hook
    dispatches them to nvcc), so ParallelCompile runs both in parallel. ``force`` is always on:
    setuptools' own skip compares file times, which say nothing of a CUDA on/off switch; the
    cache keys do.
    """

    pybind11_version = ""

    def build_extensions(self) -> None:
        toolkit = find_cuda(cuda_decision(os.environ, nvidia_gpu_present))
        version = self.distribution.get_version()
        self.force = True
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
        cache, objects, modules = BuildCache(CACHE_DIR), [], []
        self._cache_compiles(cache, toolkit, objects)
        self._cache_links(cache, modules)
        super().build_extensions()
        cache.prune(CACHE_DAYS * 86400)
        log(f"{sum(objects)} of {len(objects)} objects and {sum(modules)} of {len(modules)} linked modules "
            f"taken from {CACHE_DIR.relative_to(ROOT)}, the rest built")

    def _cache_compiles(self, cache: BuildCache, toolkit: Optional[CudaToolkit], outcomes: List[bool]) -> None:
        compiler = self.compiler
        compiler.src_extensions.append(".cu")
        compile_host_source = compiler._compile
        context = build_context(self.pybind11_version)
        host = [*compiler.compiler_so, *getattr(compiler, "compiler_so_cxx", [])]

        def compile_source(obj, source, ext, cc_args, extra_postargs, pp_opts):
            if source.endswith(".cu"):
                command = nvcc_command(toolkit, source, "", pp_opts)
                build = lambda: self.spawn(nvcc_command(toolkit, source, obj, pp_opts))  # noqa: E731
            else:
                command = [*host, *cc_args, source, *extra_postargs]
                build = lambda: compile_host_source(obj, source, ext, cc_args, extra_postargs, pp_opts)  # noqa: E731
            cached_build(cache, object_key(command, ROOT / source, context), ".o", obj, build, outcomes)

        compiler._compile = compile_source

    def _cache_links(self, cache: BuildCache, outcomes: List[bool]) -> None:
        compiler = self.compiler
        link = compiler.link_shared_object

        def link_cached(objects, output_filename, *args, **kwargs):
            settings = sorted((name, value) for name, value in kwargs.items() if name != "build_temp")
            output = os.path.join(kwargs.get("output_dir") or "", output_filename)
            key = digest(tool_identity(compiler.linker_so[0]), *compiler.linker_so, repr(args), repr(settings),
                         Path(output).name, *(file_digest(Path(o)) for o in objects))
            cached_build(cache, key, ".so", output, lambda: link(objects, output_filename, *args, **kwargs), outcomes)

        compiler.link_shared_object = link_cached


def main() -> None:
    import pybind11
    from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
    from setuptools import setup

    class BuildNativeExtension(CachedNativeBuild, build_ext):
        pybind11_version = pybind11.__version__

    ParallelCompile("ORTSPEC_BUILD_JOBS").install()
    setup(
        ext_modules=[
            Pybind11Extension(
                "ortspec._native",
                sources=CPP_SOURCES,
                include_dirs=["csrc"],
                depends=HEADERS + CUDA_SOURCES,  # shipped in sdists
                cxx_std=17,
            )
        ],
        cmdclass={"build_ext": BuildNativeExtension},
    )


if __name__ == "__main__":  # setuptools runs this file as __main__; the tests import its functions
    main()
