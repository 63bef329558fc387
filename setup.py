"""Build pagedopt._C: CPU kernels always, CUDA kernels and paging when nvcc and a CUDA torch exist.

PAGEDOPT_CUDA=1 forces the CUDA build (and fails clearly if it cannot be done);
PAGEDOPT_CUDA=0 builds the CPU kernels only.
"""
import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup

import torch
from torch.utils import cpp_extension

ROOT = Path(__file__).parent.resolve()


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
    print(f"pagedopt: building with CUDA={'yes (' + cuda_home + ')' if with_cuda else 'no'}", flush=True)
    return ext


setup(
    ext_modules=[build_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
