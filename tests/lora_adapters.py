"""Random LoRA adapters in PEFT's saved layout, and PEFT itself as the oracle for them.

``make_peft_adapter`` builds an adapter with peft on a transformers model and saves it
(``adapter_config.json`` + ``adapter_model.safetensors``), the layout refengine reads.
The weights are random but deterministic (a function of ``seed`` and the module's name,
never of the global RNG), and sized relative to the weight they modify: for every
targeted module, ``lora_A`` is drawn like PEFT's own A init (uniform in
``±1/sqrt(in_features)``), ``lora_B`` standard normal, then ``lora_B`` is rescaled so that
the module's effective delta ``scaling * B @ A`` has Frobenius norm ``strength *
||W||_F``. The default ``strength`` (0.2) changes greedy continuations of SmolLM2 within
a few tokens while keeping the logits in the base model's range. Because the delta's size
is fixed, ``lora_alpha``, ``use_rslora`` and the patterns only change how it is split
between the stored ``B`` and the scale — an engine that got the scale wrong (``alpha/r``
for rsLoRA, the wrong pattern entry) computes a visibly different model.

``PeftOracle`` holds one ``PeftModel`` with several named adapters on one base model
(``load_adapter`` + ``set_adapter``), so a test needs one copy of the base model however
many adapters it checks; ``None`` runs the base model (``disable_adapter``).
"""

from __future__ import annotations

import contextlib
import warnings
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer

ADAPTER_NAME = "default"  # what save_pretrained writes at the directory's root
DEFAULT_STRENGTH = 0.2


def _generator(seed: int, module_name: str) -> torch.Generator:
    # torch's CPU generator (mt19937) keeps only a seed's low 32 bits, so the seed goes into
    # them: ``(seed << 32) ^ crc`` made every seed give the same adapter (found by review).
    return torch.Generator().manual_seed(zlib.crc32(module_name.encode(), seed & 0xFFFFFFFF))


@torch.no_grad()
def _randomize(model: torch.nn.Module, adapter: str, seed: int, strength: float) -> int:
    """Random A and B for every LoRA layer of ``adapter``; returns how many there are."""
    count = 0
    for name, module in sorted(model.named_modules(), key=lambda item: item[0]):
        if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
            continue
        lora_a, lora_b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
        gen = _generator(seed, name)
        bound = lora_a.shape[1] ** -0.5
        a = (torch.rand(lora_a.shape, generator=gen, dtype=torch.float64) * 2 - 1) * bound
        b = torch.randn(lora_b.shape, generator=gen, dtype=torch.float64)
        scaling = module.scaling[adapter]
        base_norm = module.get_base_layer().weight.detach().norm().item()
        b *= strength * base_norm / (scaling * (b @ a)).norm()
        lora_a.copy_(a)
        lora_b.copy_(b)
        count += 1
    return count


def make_peft_adapter(
    base_model: torch.nn.Module,
    directory: str | Path,
    r: int,
    target_modules: Sequence[str],
    lora_alpha: float | None = None,
    use_rslora: bool = False,
    rank_pattern: Mapping[str, int] | None = None,
    alpha_pattern: Mapping[str, float] | None = None,
    layers_to_transform: Sequence[int] | None = None,
    seed: int = 0,
    strength: float = DEFAULT_STRENGTH,
) -> Path:
    """Build a random LoRA adapter for ``base_model`` with peft and save it in ``directory``.

    ``lora_alpha`` defaults to ``2 * r``; ``layers_to_transform`` None = every layer.
    Pattern keys follow PEFT's rule (a key matches a module name ending with it at a dot,
    first key wins); PEFT saves them sorted, so pass overlapping keys in sorted order or
    the saved adapter will not match the one built. The adapter is injected into ``base_model`` only
    for as long as it takes to save it, then unloaded (``PeftModel.unload``): the model is
    left with its original modules and weights. Returns ``directory``.
    """
    directory = Path(directory)
    config = LoraConfig(
        r=r,
        lora_alpha=2 * r if lora_alpha is None else lora_alpha,
        target_modules=list(target_modules),
        use_rslora=use_rslora,
        rank_pattern=dict(rank_pattern or {}),
        alpha_pattern=dict(alpha_pattern or {}),
        layers_to_transform=None if layers_to_transform is None else list(layers_to_transform),
        lora_dropout=0.0,
        bias="none",
        init_lora_weights=False,
    )
    with warnings.catch_warnings():  # see PeftOracle
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = get_peft_model(base_model, config, adapter_name=ADAPTER_NAME)
    try:
        if _randomize(peft_model, ADAPTER_NAME, seed, strength) == 0:
            raise ValueError(f"target_modules {list(target_modules)} match no module of the model")
        peft_model.save_pretrained(str(directory), safe_serialization=True)
    finally:
        restored = peft_model.unload()
    assert restored is base_model
    assert not any(isinstance(m, LoraLayer) for m in base_model.modules()), "peft left LoRA layers behind"
    if not (directory / "adapter_model.safetensors").is_file():
        raise RuntimeError(f"peft did not write adapter_model.safetensors in {directory}")
    return directory


class PeftOracle:
    """transformers + peft with several named adapters on one base model.

    ``base_model`` is modified in place (PEFT wraps its projections), so pass a copy that
    nothing else uses; with every adapter disabled it computes the base model exactly.
    """

    def __init__(self, base_model: torch.nn.Module, adapters: Mapping[str, str | Path]) -> None:
        if not adapters:
            raise ValueError("PeftOracle needs at least one adapter")
        items = list(adapters.items())
        first_name, first_dir = items[0]
        with warnings.catch_warnings():  # peft 0.21 asks transformers 5 a deprecated question
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            self.model = PeftModel.from_pretrained(base_model.eval(), str(first_dir), adapter_name=first_name)
        for name, directory in items[1:]:
            self.model.load_adapter(str(directory), adapter_name=name)
        self.model.eval()
        self.names = tuple(name for name, _ in items)

    @torch.no_grad()
    def logits(self, adapter: str | None, token_ids: Iterable[int]) -> torch.Tensor:
        """``[len(token_ids), vocab]`` float32 logits of one forward pass, with ``adapter``
        (``None``: the base model)."""
        ids = torch.tensor([list(token_ids)])
        if adapter is None:
            with self.model.disable_adapter():
                return self.model(ids).logits[0].float()
        if adapter not in self.names:
            raise KeyError(f"no adapter {adapter!r} in the oracle (have {self.names})")
        self.model.set_adapter(adapter)
        return self.model(ids).logits[0].float()

    @torch.no_grad()
    def greedy(self, adapter: str | None, prompt_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Greedy continuation with transformers' KV cache (``adapter`` None: the base model)."""
        if adapter is not None:
            self.model.set_adapter(adapter)
        with self.model.disable_adapter() if adapter is None else contextlib.nullcontext():
            out = self.model(torch.tensor([list(prompt_ids)]), use_cache=True)
            generated: list[int] = []
            for _ in range(num_tokens):
                token = int(out.logits[0, -1].argmax())
                generated.append(token)
                out = self.model(torch.tensor([[token]]), cache=out.cache, use_cache=True)
        return generated

