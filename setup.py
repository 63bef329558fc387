"""Build pagedopt._C: CPU kernels always, CUDA kernels and paging when nvcc and a CUDA torch exist.

PAGEDOPT_CUDA=1 forces the CUDA build (and fails clearly if it cannot be done);
PAGEDOPT_CUDA=0 builds the CPU kernels only. MAX_JOBS sets the parallel compile jobs (default: one
per core).

One build directory, ./build, serves every way of building: ``python setup.py build_ext --inplace``
(what ``make setup`` runs), ``pip install --no-build-isolation -e .`` and ``pip install .``. Its
objects and ninja's log stay there, so a build compiles only the units whose sources, headers or
build settings (``build/config.stamp``) changed, and an editable install right after a build
compiles nothing. scripts/build_progress.py says which units compile, with progress and elapsed
time, and records each build in ``build/pagedopt-build.json``.
"""
import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup

import torch
from torch.utils import cpp_extension

ROOT = Path(__file__).parent.resolve()
BUILD = ROOT / "build"
sys.path.insert(0, str(ROOT / "scripts"))
import build_progress  # noqa: E402  (scripts/build_progress.py)


def _find_cuda_home():
    """torch guesses CUDA_HOME from the nvcc on PATH (often /usr/local), which breaks -lcudart."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    for c in candidates:
        if c and (Path(c) / "bin" / "nvcc").exists() and (Path(c) / "include" / "cuda_runtime.h").exists():
            return c
    return None


def _wheel_cuda_includes():
    """The toolkit here lacks cublas_v2.h/cusparse.h that ATen/cuda/CUDAContext.h includes; the nvidia wheels ship them."""
    dirs = []
    try:
        import nvidia  # type: ignore

        for base in nvidia.__path__:
            for sub in ("cu13/include", "cu12/include"):
                d = Path(base) / sub
                if d.is_dir():
                    dirs.append(str(d))
    except ImportError:
        pass
    return dirs


def _libstdcxx_link_args():
    """Link libstdc++ dynamically, like torch. Where the compiler's own libstdc++.so is missing
    (only libstdc++.a is installed, as on one GPU image we use), the linker silently embeds a
    static copy; its second, uninitialised iostream/locale state then crashes the first error
    message formatted in the extension. Name the runtime library explicitly there."""
    if os.environ.get("PAGEDOPT_LINK_LIBSTDCXX", "auto") == "off":
        return []
    cxx = os.environ.get("CXX", "c++")
    try:
        found = subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True, text=True,
                               timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return []
    if os.path.isabs(found) and os.path.exists(found):
        return []
    print("pagedopt: the compiler has no libstdc++.so; linking the runtime libstdc++.so.6 explicitly", flush=True)
    return ["-l:libstdc++.so.6"]


def _want_cuda():
    flag = os.environ.get("PAGEDOPT_CUDA", "").strip()
    cuda_home = _find_cuda_home()
    torch_has_cuda = torch.version.cuda is not None
    if flag == "0":
        return False, None
    if flag == "1":
        if not torch_has_cuda:
            sys.exit(f"PAGEDOPT_CUDA=1 but the installed torch {torch.__version__} is a CPU-only build; "
                     "install a CUDA build of torch or unset PAGEDOPT_CUDA.")
        if cuda_home is None:
            sys.exit("PAGEDOPT_CUDA=1 but no CUDA toolkit (nvcc and cuda_runtime.h) was found; "
                     "set CUDA_HOME to the toolkit root or unset PAGEDOPT_CUDA.")
        return True, cuda_home
    if flag not in ("",):
        sys.exit(f"PAGEDOPT_CUDA must be 0 or 1, got {flag!r}")
    return (torch_has_cuda and cuda_home is not None), cuda_home


def build_extension():
    with_cuda, cuda_home = _want_cuda()
    include_dirs = [str(ROOT / "csrc" / "include")]
    sources = ["csrc/pagedopt.cpp", "csrc/check_grads.cpp", "csrc/copy_bytes.cpp",
               "csrc/quantized_state_list.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    cxx = ["-O3", "-fopenmp"]
    nvcc = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]
    define_macros = []
    link_args = ["-fopenmp"] + _libstdcxx_link_args()
    if with_cuda:
        os.environ["CUDA_HOME"] = cuda_home
        cpp_extension.CUDA_HOME = cuda_home
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            # torch picks the archs of the visible GPUs; with none (CI, build machines) it has
            # nothing to pick. One arch proves the sources compile and link; release builds set
            # TORCH_CUDA_ARCH_LIST to the archs they ship (e.g. "8.0;8.6;9.0").
            os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
        sources += (sorted(glob.glob("csrc/cuda/*.cu")) + sorted(glob.glob("csrc/cuda/*.cpp"))
                    + sorted(glob.glob("csrc/paging/*.cpp")))
        for d in _wheel_cuda_includes():
            cxx += ["-isystem", d]
            nvcc += ["-isystem", d]
        define_macros.append(("PAGEDOPT_WITH_CUDA", "1"))
        ext = cpp_extension.CUDAExtension(
            "pagedopt._C", sources, include_dirs=include_dirs, define_macros=define_macros,
            extra_compile_args={"cxx": cxx, "nvcc": nvcc}, extra_link_args=link_args,
        )
    else:
        ext = cpp_extension.CppExtension(
            "pagedopt._C", sources, include_dirs=include_dirs, define_macros=define_macros,
            extra_compile_args={"cxx": cxx}, extra_link_args=link_args,
        )
    ext.depends = _headers()
    ext.build_config = {
        "sources": sources, "include_dirs": include_dirs, "define_macros": define_macros, "cxx": cxx,
        "nvcc": nvcc if with_cuda else None, "link": link_args, "cuda_home": cuda_home if with_cuda else None,
        "arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST") if with_cuda else None,
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "python": sys.version,
        "compilers": {k: os.environ.get(k) for k in ("CC", "CXX", "NVCC_CCBIN", "CUDAHOSTCXX")},
    }
    print(f"pagedopt build: CUDA kernels {'yes (' + cuda_home + ', TORCH_CUDA_ARCH_LIST=' + os.environ.get('TORCH_CUDA_ARCH_LIST', 'of the visible GPUs') + ')' if with_cuda else 'no'}",
          flush=True)
    return ext


def _headers():
    """Every header under csrc/: a change to one rebuilds (ninja then recompiles only the units
    that include it, from the compilers' dependency files)."""
    found = []
    for pattern in ("*.h", "*.hpp", "*.cuh"):
        found += glob.glob(f"csrc/**/{pattern}", recursive=True)
    return sorted(found)


setup(
    ext_modules=[build_extension()],
    cmdclass=build_progress.build_commands(BUILD),
)
