"""Adapters whose init rewrites the base weights (PiSSA, OLoRA; PEFT 0.21), against PEFT as the
oracle. Saved the default way they keep ``init_lora_weights: "pissa"`` and PEFT redoes the rewrite
(W := W - scale * B0 @ A0) when loading them: applied to the unchanged base, as a LoRA server
does, their outputs differ from PEFT's (found by review: greedy tokens differed from the first
one), so they are refused, naming the fix. Saved converted (PEFT's
``path_initial_model_for_weight_conversion``) they are plain LoRA and match PEFT."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig as PeftConfig
from peft import PeftModel, get_peft_model

from refengine.types import InvalidRequestError, LoraAdapterSpec
from tests.unit.test_lora_engine import PROMPTS, greedy, hf_greedy, make_engine, tiny  # noqa: F401 - tiny: a fixture

MODULES = ["q_proj", "v_proj", "down_proj"]


def _trained(model: torch.nn.Module, init: str, initial: Path | None = None) -> torch.nn.Module:
    """A PEFT model with ``init``, its LoRA weights then moved as training would move them; with
    ``initial``, its untrained adapter is saved there first (what the converted save needs)."""
    torch.manual_seed(0)
    peft_model = get_peft_model(copy.deepcopy(model), PeftConfig(r=4, lora_alpha=8, init_lora_weights=init,
                                                                target_modules=MODULES))
    if initial is not None:
        peft_model.peft_config["default"].init_lora_weights = True  # PEFT's recipe for the converted save
        peft_model.save_pretrained(str(initial))
    with torch.no_grad():
        for name, weight in peft_model.named_parameters():
            if "lora_" in name:
                weight.add_(torch.randn_like(weight) * 0.05)
    return peft_model


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_an_unconverted_adapter_is_refused_where_it_would_not_match_peft(tiny, tmp_path: Path, init: str) -> None:  # noqa: F811
    _trained(tiny[0], init).save_pretrained(str(tmp_path / "a"))
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["init_lora_weights"] == init
    oracle = PeftModel.from_pretrained(copy.deepcopy(tiny[0]), str(tmp_path / "a")).eval()
    # PEFT's own model differs from the plain-LoRA reading of the same files (the unchanged base):
    plain = get_peft_model(copy.deepcopy(tiny[0]), PeftConfig(r=4, lora_alpha=8, target_modules=MODULES)).eval()
    plain.load_state_dict({k: v for k, v in oracle.state_dict().items() if "lora_" in k}, strict=False)
    with torch.no_grad():
        assert not torch.allclose(plain(torch.tensor([PROMPTS[2]])).logits, oracle(torch.tensor([PROMPTS[2]])).logits,
                                  atol=1e-3)
    engine = make_engine(tiny, tmp_path)
    with pytest.raises(InvalidRequestError, match=f"init_lora_weights='{init}' is not supported.*converted"):
        engine.load_lora(LoraAdapterSpec(1, "a", str(tmp_path / "a")))
    assert engine.list_loras() == []


def test_a_converted_pissa_adapter_loads_and_matches_peft(tiny, tmp_path: Path) -> None:  # noqa: F811
    peft_model = _trained(tiny[0], "pissa", initial=tmp_path / "initial")
    peft_model.save_pretrained(str(tmp_path / "a"), path_initial_model_for_weight_conversion=str(tmp_path / "initial"))
    oracle = PeftModel.from_pretrained(copy.deepcopy(tiny[0]), str(tmp_path / "a")).eval()
    engine = make_engine(tiny, tmp_path)
    engine.load_lora(LoraAdapterSpec(1, "a", str(tmp_path / "a")))
    (out,) = engine.run_until_done([greedy("r", PROMPTS[2], "a")])
    assert out.outputs[0].token_ids == hf_greedy(oracle, PROMPTS[2])
