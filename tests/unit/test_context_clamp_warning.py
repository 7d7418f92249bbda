"""A ``--max-model-len`` past the model's ``max_position_embeddings`` is served at the model's
length and said in a warning (found by review: it was clamped without a word), as a KV pool too
small for it already was."""

from __future__ import annotations

import logging

import pytest

from refengine.config import EngineConfig
from refengine.engine.info import configured_context
from tests.unit.test_engine import tiny  # noqa: F401 - a fixture


@pytest.mark.parametrize(("asked", "served", "warned"), [(100_000, 256, True), (256, 256, False),
                                                          (128, 128, False), (None, 256, False)])
def test_a_context_past_the_model_s_is_clamped_with_a_warning(tiny, caplog: pytest.LogCaptureFixture,  # noqa: F811
                                                              asked: int | None, served: int, warned: bool) -> None:
    model_config = tiny[1]
    assert model_config.max_position_embeddings == 256
    with caplog.at_level(logging.WARNING, logger="refengine.engine.info"):
        assert configured_context(EngineConfig(max_model_len=asked), model_config) == served
    assert ("past the model's max_position_embeddings 256" in caplog.text) is warned
