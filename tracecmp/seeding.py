"""Removing randomness before a comparison: one call seeds everything a training run draws from."""

from __future__ import annotations

import os
import random
from typing import Any

import torch


def _npu_module() -> Any | None:
    """``torch_npu`` when it is importable (Ascend), else None; never raises."""
    try:
        import torch_npu  # type: ignore[import-not-found]  # noqa: F401
    except Exception:  # any failure means "no NPU here"; importing a vendor stack can raise anything
        return None
    return getattr(torch, "npu", None)


def seed_all(seed: int = 1234, deterministic: bool = False) -> dict[str, Any]:
    """Seed Python, NumPy and torch on the CPU and on every accelerator; optionally force determinism.

    With ``deterministic=True`` also turns on ``torch.use_deterministic_algorithms(True)``,
    cuDNN's deterministic mode without benchmarking, and sets the workspace variable that
    deterministic cuBLAS needs (``CUBLAS_WORKSPACE_CONFIG=:4096:8``, and the Ascend equivalent
    ``HCCL_DETERMINISTIC``). Returns what it set, which ``TraceCompare`` stores in the manifest.

    >>> settings = seed_all(1234)
    >>> settings["seed"], settings["deterministic"]
    (1234, False)
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        from tracecmp.errors import TracecmpError

        raise TracecmpError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    settings: dict[str, Any] = {"seed": seed, "deterministic": deterministic, "seeded": ["python"]}
    os.environ["PYTHONHASHSEED"] = str(seed)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed)
        settings["seeded"].append("numpy")
    torch.manual_seed(seed)  # seeds the CPU generator and every initialised CUDA device
    settings["seeded"].append("torch")
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
        settings["seeded"].append("cuda")
    npu = _npu_module()
    if npu is not None and npu.is_available():
        npu.manual_seed_all(seed)
        settings["seeded"].append("npu")
    env: dict[str, str] = {"PYTHONHASHSEED": str(seed)}
    if deterministic:
        # cuBLAS is only deterministic with a fixed workspace; this must be set before the first
        # cuBLAS handle is created, which is why users call seed_all first thing.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        os.environ.setdefault("HCCL_DETERMINISTIC", "true")
        env["CUBLAS_WORKSPACE_CONFIG"] = os.environ["CUBLAS_WORKSPACE_CONFIG"]
        env["HCCL_DETERMINISTIC"] = os.environ["HCCL_DETERMINISTIC"]
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic and torch.backends.cudnn.benchmark
    settings["env"] = env
    settings["torch_deterministic_algorithms"] = torch.are_deterministic_algorithms_enabled()
    settings["cudnn_deterministic"] = bool(torch.backends.cudnn.deterministic)
    settings["cudnn_benchmark"] = bool(torch.backends.cudnn.benchmark)
    _LAST_SETTINGS.clear()
    _LAST_SETTINGS.update(settings)
    return settings


# What the latest seed_all did, so a TraceCompare opened afterwards can record it in its manifest.
_LAST_SETTINGS: dict[str, Any] = {}


def last_seed_settings() -> dict[str, Any]:
    """A copy of what the most recent :func:`seed_all` set (empty if it was never called)."""
    return dict(_LAST_SETTINGS)
