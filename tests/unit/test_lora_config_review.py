"""Two findings of a review of ``lora/peft.py``'s reading of ``adapter_config.json``, each checked
against PEFT where PEFT decides:

- ``rank_pattern``/``alpha_pattern`` keys are bounded in number and compiled once. Before, each was
  recompiled for each module: 40,000 harmless keys (830 KB, under the 1 MiB config bound) made one
  LoadLora take 10 s a module, about 40 minutes on a 32-layer model, holding up every other.
- ``fan_in_fan_out`` is accepted: PEFT turns it off on linear projections and serves the same
  outputs, yet the engine refused the adapter.
- A ``--lora-root`` that is not a directory is said at start.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import time
from pathlib import Path

import pytest
from peft import PeftModel

from refengine.config import LoraConfig
from refengine.lora import peft
from refengine.lora.peft import MAX_PATTERN_KEYS, read_peft_adapter
from refengine.lora.registry import LoraRegistry
from refengine.types import InvalidRequestError, LoraAdapterSpec
from tests.unit.test_lora_engine import ALL, PROMPTS, greedy, hf_greedy, make_adapter, make_engine, tiny  # noqa: F401


def _with_config(directory: Path, **changes: object) -> None:
    config_file = directory / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **changes}))


@pytest.mark.parametrize("name", ["rank_pattern", "alpha_pattern"])
def test_too_many_pattern_keys_are_refused_before_any_match(tiny, tmp_path: Path, name: str) -> None:  # noqa: F811
    make_adapter(tiny[0], tmp_path / "a", 4, ALL)
    _with_config(tmp_path / "a", **{name: {f"zz{i}[a-z]*x": 4 for i in range(40_000)}})
    start = time.monotonic()
    with pytest.raises(InvalidRequestError, match=f"{name} has 40000 keys; the limit is {MAX_PATTERN_KEYS}"):
        read_peft_adapter(tmp_path / "a", tiny[1], 16, (str(tmp_path),))
    assert time.monotonic() - start < 5.0


def test_each_pattern_key_is_compiled_once_whatever_the_modules(tiny, tmp_path: Path,  # noqa: F811
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    make_adapter(tiny[0], tmp_path / "a", 4, ALL, rank_pattern={"q_proj": 4})
    keys = {f"zz{i}[a-z]*x": 4 for i in range(MAX_PATTERN_KEYS - 1)}
    _with_config(tmp_path / "a", rank_pattern={**keys, "q_proj": 4})
    compiled = []
    real_compile = peft.regex.compile
    monkeypatch.setattr(peft.regex, "compile", lambda pattern, *a, **k: compiled.append(pattern)
                        or real_compile(pattern, *a, **k))
    adapter = read_peft_adapter(tmp_path / "a", tiny[1], 16, (str(tmp_path),))
    assert adapter.max_rank == 4
    assert len(compiled) <= 2 * MAX_PATTERN_KEYS, "a pattern compiled again for each of the 14 modules"


def test_fan_in_fan_out_on_linear_projections_loads_like_peft(tiny, tmp_path: Path) -> None:  # noqa: F811
    plain = make_adapter(tiny[0], tmp_path / "plain", 4, ALL, seed=1)
    shutil.copytree(tmp_path / "plain", tmp_path / "fifo")
    _with_config(tmp_path / "fifo", fan_in_fan_out=True)
    oracle = PeftModel.from_pretrained(copy.deepcopy(tiny[0]), str(tmp_path / "fifo")).eval()  # PEFT warns, runs it
    expected = hf_greedy(oracle, PROMPTS[1])
    assert expected == hf_greedy(plain, PROMPTS[1]) != hf_greedy(tiny[0], PROMPTS[1])
    engine = make_engine(tiny, tmp_path)
    engine.load_lora(LoraAdapterSpec(1, "fifo", str(tmp_path / "fifo")))
    (done,) = engine.run_until_done([greedy("r", PROMPTS[1], "fifo")])
    assert done.outputs[0].token_ids == expected


def test_a_lora_root_that_is_not_a_directory_is_said_at_start(tiny, tmp_path: Path,  # noqa: F811
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """Found by review of the CLI: ``--lora-root /nonexistent`` started READY in silence, and
    every LoadLora then failed. It may be mounted later, so it is a warning, not a refusal."""
    with caplog.at_level(logging.WARNING, logger="refengine.lora.registry"):
        LoraRegistry(LoraConfig(enabled=True, roots=(str(tmp_path / "missing"), str(tmp_path))), tiny[1])
    assert f"--lora-root {tmp_path / 'missing'} is not a directory" in caplog.text
    assert f"--lora-root {tmp_path} " not in caplog.text
