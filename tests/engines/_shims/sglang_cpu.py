"""Import shims that let SGLang 0.5.23's HiCache modules import on this
CPU-only test machine (tests/engines/test_sglang.py; never on a GPU server,
where the real packages are installed).

- ``triton``: ``sglang.srt.utils.common`` imports it unconditionally and
  hundreds of kernel modules decorate functions with ``@triton.jit`` at import
  time. The stub is SGLang's own macOS triton stub
  (``sglang/_platform_stubs.py``: ``_MockModule`` + ``_TritonFinder``), loaded
  from its file so that ``sglang/__init__`` (which needs triton) does not run
  first. No triton kernel is ever called on the paths the tests drive.
- ``torchvision``: SGLang's multimodal processors import it at module import
  time, and PyPI's torchvision does not import next to CPU torch 2.13.0
  (``operator torchvision::nms does not exist``). The stub is an empty
  package of the same kind; no image path runs here.

Call :func:`install` before the first ``import sglang``, in a process of its
own: the stubs must not leak into other engines' tests (vLLM decides at
import time whether triton exists).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

_installed = False


def _load_sglang_stub_module() -> ModuleType:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "_platform_stubs.py"
    file_spec = importlib.util.spec_from_file_location("_tierfs_sglang_platform_stubs", path)
    assert file_spec is not None and file_spec.loader is not None
    mod = importlib.util.module_from_spec(file_spec)
    sys.modules[file_spec.name] = mod  # its dataclasses look themselves up there
    file_spec.loader.exec_module(mod)
    return mod


def _install_triton(stubs: Any) -> None:
    if "triton" in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    sys.meta_path.insert(0, stubs._TritonFinder())
    triton = stubs._make_mock("triton")
    triton.__version__ = "3.0.0"
    triton.cdiv = stubs._cdiv
    triton.next_power_of_2 = stubs._next_power_of_2
    triton.Config = stubs._Config
    tl = stubs._make_mock("triton.language")

    class constexpr:
        def __init__(self, value: Any = None) -> None:
            self.value = value

    tl.constexpr = constexpr
    triton.language = tl
    runtime = stubs._make_mock("triton.runtime")
    triton.runtime = runtime
    jit_mod = stubs._make_mock("triton.runtime.jit")

    class JITFunction:
        pass

    class KernelInterface(stubs._StubBase):
        pass

    jit_mod.JITFunction = JITFunction
    jit_mod.KernelInterface = KernelInterface
    runtime.jit = jit_mod
    autotuner = stubs._make_mock("triton.runtime.autotuner")

    class OutOfResources(Exception):
        pass

    class PTXASError(Exception):
        pass

    autotuner.OutOfResources = OutOfResources
    autotuner.PTXASError = PTXASError
    runtime.autotuner = autotuner
    cache = stubs._make_mock("triton.runtime.cache")
    cache.triton_key = stubs._triton_key
    runtime.cache = cache
    # torch 2.13's Inductor imports these as classes when it sees a triton.
    compiler_root = stubs._make_mock("triton.compiler")
    compiler_root.CompiledKernel = type("CompiledKernel", (stubs._StubBase,), {})
    compiler_impl = stubs._make_mock("triton.compiler.compiler")
    compiler_impl.ASTSource = type("ASTSource", (stubs._StubBase,), {})
    compiler_impl.triton_key = stubs._triton_key
    compiler_root.compiler = compiler_impl
    triton.compiler = compiler_root
    runtime.driver = stubs._make_mock("triton.runtime.driver")
    triton.testing = stubs._make_mock("triton.testing")
    tools = stubs._make_mock("triton.tools")
    triton.tools = tools
    tools.tensor_descriptor = stubs._make_mock("triton.tools.tensor_descriptor")
    backends = stubs._make_mock("triton.backends")
    triton.backends = backends
    backend_compiler = stubs._make_mock("triton.backends.compiler")
    backend_compiler.GPUTarget = type("GPUTarget", (stubs._StubBase,), {})
    backends.compiler = backend_compiler


def _install_mock_package(stubs: Any, root: str) -> None:
    """Every ``import root[.x]`` gets a mock module, unless ``root`` imports."""
    try:
        importlib.import_module(root)
        return
    except Exception:
        for name in [m for m in sys.modules if m == root or m.startswith(root + ".")]:
            del sys.modules[name]

    class _Finder:
        def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
            if fullname == root or fullname.startswith(root + "."):
                if fullname in sys.modules:
                    return sys.modules[fullname].__spec__
                mod = stubs._MockModule(fullname)
                sys.modules[fullname] = mod
                parent, _, child = fullname.rpartition(".")
                if parent in sys.modules:
                    setattr(sys.modules[parent], child, mod)
                return mod.__spec__
            return None

    sys.meta_path.insert(0, _Finder())
    stubs._make_mock(root).__version__ = "0.0.0+tierfs-stub"


def install() -> None:
    """Install both stubs (idempotent)."""
    global _installed
    if _installed:
        return
    stubs = _load_sglang_stub_module()
    _install_triton(stubs)
    _install_mock_package(stubs, "IPython")
    # transformers asks once (lru_cache) whether torchvision exists and then
    # uses it for image processing: ask before the stub exists, so it says no.
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()
    _install_mock_package(stubs, "torchvision")
    _installed = True
