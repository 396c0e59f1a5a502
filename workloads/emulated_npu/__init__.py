"""An emulated NPU: torch's PrivateUse1 backend, renamed ``npu``, over host memory (``npu.cpp``).

Tests, benchmarks and ``tracecmp demo --emulated-npu`` run tracecmp's accelerator path on it where
no accelerator exists. Tensors report ``device.type == "npu"``; each aten op runs on the CPU
kernels; the emulator counts what would block the host on a real device (:func:`counters`).
Its numerics differ from the CPU's as an NPU's do, on request (:func:`set_numerics`), and its
random stream always does: ``torch.manual_seed(s)`` seeds it apart from the CPU's. Not emulated:
LSTM/GRU (torch runs their fused cells, CUDA-only kernels, on every device but the CPU).
Collectives: :func:`serve_collectives` gives a gloo process group a backend for the npu.

>>> npu = load()                                    # doctest: +SKIP
>>> torch.ones(2, device="npu").device.type         # doctest: +SKIP
'npu'

The library is compiled once per torch version and source (about 30 s, ``c++`` and torch's headers)
into ``build/emulated_npu/`` at the repository root, with no ninja: :func:`load` raises
:class:`EmulatorUnavailable` saying why when it cannot be built or hosted.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Iterator, NamedTuple

import torch

SOURCE = Path(__file__).with_name("npu.cpp")
BUILD_ROOT = Path(__file__).resolve().parents[2] / "build" / "emulated_npu"
DEVICE = "npu"
# The oldest torch whose PrivateUse1 interfaces npu.cpp is written against (hooks with
# hasPrimaryContext and resizePrivateUse1Bytes, Allocator::copy_data); CI runs it on the newest
# torch only, and torch 2.1 (CI's oldest) lacks these interfaces.
OLDEST_TORCH = (2, 5)


class EmulatorUnavailable(RuntimeError):
    """The emulated NPU cannot be built or hosted by this torch; the message says why."""


class Counters(NamedTuple):
    """What the emulator counted since the last :func:`reset_counters` (fallback copies excluded)."""

    d2h_copies: int  # copies from the npu to the CPU
    h2d_copies: int  # copies from the CPU to the npu
    syncs: int  # host waits: .item(), value-sized outputs (nonzero ...), synchronize()
    ops: int  # aten ops run by the CPU fallback


_loaded: types.ModuleType | None = None


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _library_path() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    return BUILD_ROOT / f"torch-{torch.__version__}-{digest}" / "emulated_npu.so"


def _compile(target: Path) -> None:
    """Compile npu.cpp into ``target`` with torch's headers and libraries."""
    from torch.utils import cpp_extension

    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        raise EmulatorUnavailable("no C++ compiler (c++, or $CXX) to build the emulated npu")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    command = [compiler, "-shared", "-fPIC", "-O1", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", str(SOURCE)]
    command += [f"-I{path}" for path in cpp_extension.include_paths()]
    command += [f"-L{path}" for path in cpp_extension.library_paths()]
    command += ["-lc10", "-ltorch_cpu", "-ltorch", "-o", str(target)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise EmulatorUnavailable(
            f"the emulated npu did not compile with torch {torch.__version__}:\n{done.stderr[-3000:]}"
        )


def torch_can_host() -> bool:
    """Whether this torch has the PrivateUse1 interfaces npu.cpp is written against."""
    return _torch_version() >= OLDEST_TORCH


def build() -> Path:
    """The compiled library, built now if this torch and source have none yet (a lock keeps
    concurrent test workers from building it twice)."""
    if not torch_can_host():
        raise EmulatorUnavailable(
            f"torch {torch.__version__} cannot host the emulated npu: it needs torch "
            f"{'.'.join(map(str, OLDEST_TORCH))} or later (PrivateUse1 hooks and allocator interfaces)"
        )
    target = _library_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            partial = target.with_suffix(f".{os.getpid()}.tmp")
            _compile(partial)
            partial.replace(target)  # atomic: a reader never loads a half-written library
    return target


def load() -> types.ModuleType:
    """Build and load the emulator once per process; returns the ``torch.npu`` device module."""
    global _loaded
    if _loaded is not None:
        return _loaded
    registered = getattr(torch, DEVICE, None)
    if getattr(registered, "emulated", False):  # loaded in this process through another import of this file
        _loaded = registered
        return registered
    backend = torch._C._get_privateuse1_backend_name()
    if backend not in ("privateuseone", DEVICE):
        raise EmulatorUnavailable(f"torch's PrivateUse1 device is already {backend!r} in this process")
    torch.ops.load_library(str(build()))
    if backend != DEVICE:
        torch.utils.rename_privateuse1_backend(DEVICE)
    module = _device_module()
    torch._register_device_module(DEVICE, module)
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
    _loaded = module
    return module


def _device_module() -> types.ModuleType:
    """``torch.npu``: what torch's seeding and device utilities look up on a custom device."""
    ops = torch.ops.emulated_npu
    module = types.ModuleType("torch.npu", "The emulated NPU (workloads/emulated_npu).")
    module.emulated = True  # type: ignore[attr-defined]
    module.is_available = lambda: True  # type: ignore[attr-defined]
    module.is_initialized = lambda: True  # type: ignore[attr-defined]
    module._is_in_bad_fork = lambda: False  # type: ignore[attr-defined]
    module.device_count = lambda: 1  # type: ignore[attr-defined]
    module.current_device = lambda: 0  # type: ignore[attr-defined]
    module.synchronize = lambda device=None: ops.synchronize()  # type: ignore[attr-defined]
    module.manual_seed = lambda seed: ops.manual_seed(int(seed))  # type: ignore[attr-defined]
    module.manual_seed_all = module.manual_seed  # type: ignore[attr-defined]
    return module


def serve_collectives(group: torch.distributed.ProcessGroup | None = None) -> None:
    """Give ``group`` (default: the default group), made with gloo, a backend for the npu: gloo's
    collectives on host copies of the npu tensors, waited for and copied back."""
    torch.ops.emulated_npu.serve_collectives((group or torch.distributed.group.WORLD).boxed())


def counters() -> Counters:
    """The emulator's counts since the last :func:`reset_counters`."""
    return Counters(*torch.ops.emulated_npu.counters())


def reset_counters() -> None:
    """Start the emulator's counts (:func:`counters`) from zero."""
    torch.ops.emulated_npu.reset_counters()


def set_numerics(matrix_units: str = "fp32", reversed_sums: bool = False) -> None:
    """The device's arithmetic: ``matrix_units`` "fp16"/"bf16"/"tf32" rounds the fp32 operands of
    matmul-like ops (mm, bmm, addmm, baddbmm, mv, convolution) to that precision before the fp32
    kernel runs, as an NPU's cube units read them ("tf32": a 10-bit mantissa, like Ascend's HF32);
    ``reversed_sums`` sums (sum, mean, nansum) in reverse order along the reduced dimensions."""
    torch.ops.emulated_npu.set_numerics(matrix_units, reversed_sums)


@contextlib.contextmanager
def numerics(matrix_units: str = "fp32", reversed_sums: bool = False) -> Iterator[None]:
    """:func:`set_numerics` for a block, then plain fp32 again."""
    set_numerics(matrix_units, reversed_sums)
    try:
        yield
    finally:
        set_numerics()


def unavailable_reason() -> str | None:
    """Why :func:`load` fails here (None when the emulator loads)."""
    try:
        load()
    except (EmulatorUnavailable, RuntimeError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


if __name__ == "__main__":  # python -m workloads.emulated_npu: build it, print where
    print(build(), file=sys.stdout)
