"""Input names: what the user passed, by forward parameter and path, eager or compiled alike."""

from __future__ import annotations

from collections import UserDict

import pytest
import torch

from tracecmp.capture.inputs import name_of_source, named_inputs


class Model(torch.nn.Module):
    def forward(self, input_ids, attention_mask=None, *extra, labels=None, **options):
        return input_ids


T = torch.ones(2)


def _names(*args, **kwargs) -> list[str]:
    return [name for name, _ in named_inputs(Model().forward, args, kwargs)]


def test_an_argument_is_named_by_its_parameter_however_it_was_passed() -> None:
    assert _names(T, T) == ["input_ids", "attention_mask"]
    assert _names(input_ids=T, attention_mask=T) == ["input_ids", "attention_mask"]
    assert _names(T, labels=T) == ["input_ids", "labels"]


def test_star_args_by_position_and_star_kwargs_by_keyword() -> None:
    assert _names(T, T, T, T, scale=T) == ["input_ids", "attention_mask", "input.2", "input.3", "scale"]


def test_paths_inside_lists_and_mappings() -> None:
    batch = UserDict({"ids": T, "pair": (T, [T])})  # transformers' BatchEncoding is a UserDict
    assert _names(batch) == ["input_ids.ids", "input_ids.pair.0", "input_ids.pair.1.0"]


def test_a_call_forward_would_refuse_falls_back_to_positions() -> None:
    def strict(x):
        return x

    names = [name for name, _ in named_inputs(strict, (T, T), {"y": T})]
    assert names == ["input.0", "input.1", "y"]


@pytest.mark.parametrize(
    ("source", "name"),
    [
        ("L['input_ids']", "input_ids"),
        ("L['labels']", "labels"),
        ("L['input_ids']['ids']", "input_ids.ids"),
        ("L['input_ids']['pair'][1][0]", "input_ids.pair.1.0"),
        ("L['extra'][1]", "input.3"),
        ("L['options']['scale']", "scale"),
        ("L['hidden']", None),  # a local of a resumed frame, not an argument
        ("G['table']", None),
        ("L['input_ids'].shape", None),
    ],
)
def test_dynamo_sources_name_the_same_inputs(source: str, name: str | None) -> None:
    assert name_of_source(source, Model().forward) == name
