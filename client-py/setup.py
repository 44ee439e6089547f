"""Builds the `trainstream` package: Python code plus `trainstream._C`, a pybind11 extension over
tsclient (client-cpp/) and the torch that is installed.

    pip install --no-build-isolation ./client-py     # what scripts/setup.sh runs
    pip install ./client-py                          # works too: the build finds the outer torch

Steps:
  1. CMake builds the `tsclient` target of the repository (client-cpp/ and proto/) into
     $TSD_PY_BUILD_DIR (default: build-py/ at the repository root), with the same toolchain and
     Debian libraries as the daemon. On a machine with nvcc, tsclient registers regions with CUDA.
  2. The extension is compiled against torch's headers (torch.utils.cpp_extension) and linked
     against libtsclient.so, which is copied next to it (rpath $ORIGIN), as is libtsd_quant.so
     (the quantization kernels, loaded by trainstream.quant through ctypes).

The extension itself needs no CUDA headers: the same source builds on machines without a GPU.
"""
import glob
import os
import shutil
import subprocess
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _import_torch():
    """Imports torch. Under pip's build isolation the installed torch is hidden; then ask the
    interpreter outside the isolated environment where its torch lives, and use that one, so the
    extension is built against exactly the torch it will run with."""
    try:
        import torch  # noqa: F401
        return
    except ImportError:
        pass
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
    probe = subprocess.run([sys.executable, "-c", "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))"],
                           capture_output=True, text=True, env=env)
    if probe.returncode != 0:
        sys.exit("trainstream builds against the installed PyTorch, and none was found for " + sys.executable +
                 ": install torch first (see requirements-torch.txt), then pip install --no-build-isolation ./client-py")
    sys.path.append(probe.stdout.strip().splitlines()[-1])
    import torch  # noqa: F401


_import_torch()
from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402

BUILD_DIR = os.environ.get("TSD_PY_BUILD_DIR", os.path.join(ROOT, "build-py"))
JOBS = os.environ.get("TSD_BUILD_JOBS", str(min(2, os.cpu_count() or 1)))


def build_tsclient():
    """Configures and builds tsclient with CMake; returns the directory holding libtsclient.so."""
    if not os.path.exists(os.path.join(ROOT, "client-cpp", "include", "tsd", "client.h")):
        sys.exit(f"client-py must stay inside the tsd repository (no client-cpp/ found at {ROOT})")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    if not os.path.exists(os.path.join(BUILD_DIR, "CMakeCache.txt")):
        subprocess.check_call(["cmake", "-S", ROOT, "-B", BUILD_DIR, *gen, "-DCMAKE_BUILD_TYPE=Release",
                               "-DTSD_BUILD_TESTS=OFF", "-DTSD_BUILD_BENCH=OFF"])
    # tsd_quant: the quantization kernels' C ABI, which trainstream.quant loads with ctypes.
    subprocess.check_call(["cmake", "--build", BUILD_DIR, "--target", "tsclient", "tsd_quant", "-j", JOBS])
    return os.path.join(BUILD_DIR, "lib")


class Build(BuildExtension):
    def build_extensions(self):
        self.libdir = build_tsclient()
        for ext in self.extensions:
            ext.library_dirs.append(self.libdir)
        super().build_extensions()
        self._ship_tsclient(os.path.join(self.build_lib, "trainstream"))

    def run(self):
        inplace = self.inplace  # setuptools clears it while it builds, then copies the extension
        super().run()
        if inplace:
            self._ship_tsclient(os.path.join(HERE, "trainstream"))

    def _ship_tsclient(self, dest):
        """Ships libtsclient.so.<major> (its SONAME) next to the extension."""
        os.makedirs(dest, exist_ok=True)
        for lib in glob.glob(os.path.join(self.libdir, "libtsclient.so.*")):
            if lib.count(".so.") == 1 and lib.split(".so.")[1].isdigit():
                shutil.copy2(lib, dest)
        quant = os.path.join(self.libdir, "libtsd_quant.so")
        if os.path.exists(quant):
            shutil.copy2(quant, dest)


ext = CppExtension(
    name="trainstream._C",
    sources=["csrc/module.cc"],
    # client-cpp/include for tsclient; the repository root for proto/wire.h and proto/control_page.h,
    # whose constants the extension exports (one copy of each fact on both sides).
    include_dirs=[os.path.join(ROOT, "client-cpp", "include"), ROOT],
    libraries=["tsclient", "absl_status", "absl_statusor", "absl_time", "absl_synchronization"],
    extra_compile_args=["-O2", "-Wall"],
    extra_link_args=["-Wl,-rpath,$ORIGIN"],
)

setup(
    name="trainstream",
    version="0.5.0",
    description="Python client of the TrainStream daemon (tsd): AdamW on the daemon's CPU threads, "
                "gradients streamed out while backward runs",
    packages=["trainstream", "trainstream.paging", "trainstream.quant", "trainstream.integrations"],
    package_dir={"trainstream": "trainstream"},
    package_data={"trainstream": ["py.typed"]},
    ext_modules=[ext],
    cmdclass={"build_ext": Build},
    python_requires=">=3.10",
    zip_safe=False,
)
