"""seed_all: same seed, same numbers everywhere; determinism flags on and off; bad seeds refused."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

import tracecmp
from tracecmp.seeding import last_seed_settings


@pytest.fixture(autouse=True)
def _restore_determinism():
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)
    torch.backends.cudnn.deterministic = False


def _draw() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.randn(4)


def test_same_seed_same_numbers_from_every_generator():
    tracecmp.seed_all(1234)
    first = _draw()
    tracecmp.seed_all(1234)
    second = _draw()
    assert first[0] == second[0] and first[1] == second[1]
    assert torch.equal(first[2], second[2])
    tracecmp.seed_all(4321)
    assert not torch.equal(first[2], _draw()[2])


def test_returns_what_it_set_and_remembers_it():
    settings = tracecmp.seed_all(7)
    assert settings["seed"] == 7 and settings["deterministic"] is False
    assert {"python", "numpy", "torch"} <= set(settings["seeded"])
    assert os.environ["PYTHONHASHSEED"] == "7"
    assert last_seed_settings() == settings


def test_deterministic_mode_turns_on_torch_and_cudnn_switches():
    settings = tracecmp.seed_all(1, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert settings["env"]["CUBLAS_WORKSPACE_CONFIG"] == os.environ["CUBLAS_WORKSPACE_CONFIG"]
    assert settings["torch_deterministic_algorithms"] is True
    tracecmp.seed_all(1, deterministic=False)
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "12", True])
def test_bad_seed_is_a_tracecmp_error(bad):
    with pytest.raises(tracecmp.TracecmpError, match="seed must be an integer"):
        tracecmp.seed_all(bad)
