"""Reading a LoRA adapter in PEFT's saved layout: ``adapter_config.json`` and
``adapter_model.safetensors`` (never pickle: a directory with only ``adapter_model.bin``
is refused).

What is supported is what the model's projections can take: ``peft_type`` LORA on
``q/k/v/o_proj`` and ``gate/up/down_proj`` of any layers, any rank up to the engine's
``max_lora_rank`` (per module too: ``rank_pattern``, ``alpha_pattern``), scaling
``lora_alpha / r`` or, with ``use_rslora``, ``lora_alpha / sqrt(r)``. Everything else that
changes the math — DoRA, LoRA biases, ``bias`` other than "none", ``modules_to_save``,
trainable tokens, target parameters, embedding or lm_head adapters, activated LoRA, an
unconverted PiSSA/OLoRA/CorDA/LoftQ init — is refused with ``InvalidRequestError`` naming it,
before any weight is kept. ``fan_in_fan_out`` is not: it changes only how a delta is merged into
a Conv1D weight, and PEFT turns it off on these linear projections (the same outputs; found by
review, it was refused).

The result is grouped the way the engine's projections are fused (``ProjectionDeltas``:
q, k and v under ``qkv_proj``, gate and up under ``gate_up_proj``), each module's pair
with the scale folded into ``B``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import regex
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from refengine.config import ModelConfig
from refengine.kernels.lora_linear import FUSED_PROJECTIONS, LoraPair, ProjectionDeltas
from refengine.lora.confined import ConfinedDirectory
from refengine.types import InvalidRequestError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
PATTERN_SECONDS = 0.1  # the longest one target_modules / rank_pattern / alpha_pattern match may take
#: Keys of one rank_pattern / alpha_pattern: PEFT writes at most one a module (7 a layer: 896 for
#: 128 layers), and all of them are matched against each module.
MAX_PATTERN_KEYS = 1024
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn\.(q|k|v|o)|mlp\.(gate|up|down))"
                  r"_proj\.lora_([AB])(?:\.[\w-]+)?\.weight$")
# ``init_lora_weights`` values whose init rewrites the base weights (W := W - scale * B0 @ A0 for
# PiSSA, OLoRA and CorDA; a quantization residual for LoftQ) and which PEFT redoes when loading
# an adapter saved unconverted: its A and B were trained against that rewritten base, so applied
# to the unchanged one they give other outputs. PEFT's converted save
# (``path_initial_model_for_weight_conversion``) writes ``init_lora_weights: true`` and loads.
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq")
# Options whose non-default values change the math in ways the engine does not implement.
_REFUSED_OPTIONS = {"use_dora": (False, None), "bias": ("none", None), "lora_bias": (False, None),
                    "modules_to_save": (None, []), "layer_replication": (None, []),
                    "trainable_token_indices": (None, {}, []), "target_parameters": (None, []),
                    "alora_invocation_tokens": (None, [])}  # activated LoRA: the delta applies after a marker only


@dataclass(frozen=True)
class PeftAdapter:
    """An adapter read and checked: per layer, its fused projections' deltas (only those it
    targets), the largest rank it uses, and a digest of its files (the prefix-cache key)."""

    layers: tuple[dict[str, ProjectionDeltas], ...]
    max_rank: int
    fingerprint: str


def _refuse(path: Path, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"LoRA adapter {str(path)!r}: {message}")


def _read_bytes(path: Path, directory: ConfinedDirectory, name: str, limit: int, why: str) -> bytes:
    """The whole of file ``name`` of the adapter's opened ``directory`` (``confined.py``: no
    symlink swapped in since the path was checked is followed), read once, refused past ``limit``
    bytes (``why``), by its size before anything is read (a sparse 1 TB file costs nothing to
    refuse). Its digest and its parsed contents then come from the same bytes, whatever happens
    to the file meanwhile (an adapter rewritten in place by a training job)."""
    try:
        with directory.open(name) as stream:
            size = os.fstat(stream.fileno()).st_size
            if size > limit:
                raise _refuse(path, f"{name} is larger ({size} bytes) than {why} ({limit} bytes)")
            data = stream.read(limit + 1)
    except OSError as exc:  # unreadable, gone or swapped: R1's "not visible to the engine", not an engine fault
        raise _refuse(path, f"{name} cannot be read: {exc}") from None
    if len(data) > limit:  # grown since its size was read
        raise _refuse(path, f"{name} is larger than {why} ({limit} bytes)")
    return data


def _read_files(path: Path, roots: Sequence[str], weights_limit: int,
                weights_why: str) -> tuple[bytes, dict[str, Any], bytes]:
    """(config bytes, the config parsed, weights bytes), both files from the directory ``path``
    opened once inside ``roots``. The config is parsed before the weights are read (its faults
    come first), and the weights are refused unread past ``weights_limit`` bytes (``weights_why``)."""
    try:
        directory = ConfinedDirectory(roots, path)
    except OSError as exc:
        raise _refuse(path, f"the directory cannot be opened: {exc}") from None
    with directory:
        config_bytes = _read_bytes(path, directory, CONFIG_FILE, MAX_CONFIG_BYTES, "the most a config may hold")
        config = _read_config(path, config_bytes)
        weights_bytes = _read_bytes(path, directory, WEIGHTS_FILE, weights_limit, weights_why)
    return config_bytes, config, weights_bytes


def _read_config(path: Path, data: bytes) -> dict[str, Any]:
    try:
        config = json.loads(data.decode())
    # ValueError: also an integer over Python's 4,300-digit limit; RecursionError: deep nesting.
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _refuse(path, f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise _refuse(path, f"{CONFIG_FILE} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(path, f"peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise _refuse(path, f"init_lora_weights={init!r} is not supported: the adapter was trained against base "
                            "weights that init rewrote; save it converted to plain LoRA (PEFT's save_pretrained with "
                            "path_initial_model_for_weight_conversion)")
    for option, allowed in _REFUSED_OPTIONS.items():
        if config.get(option, allowed[0]) not in allowed:
            raise _refuse(path, f"{option}={config[option]!r} is not supported")
    for name in ("r", "lora_alpha"):
        if not _positive(config.get(name)):
            raise _refuse(path, f"{CONFIG_FILE}: {name} must be a finite number > 0, got {config.get(name)!r}")
    for name in ("rank_pattern", "alpha_pattern"):
        config[name] = _compiled_patterns(path, name, config.get(name) or {})
    return config


def _compiled_patterns(path: Path, name: str, patterns: Any) -> list[tuple[regex.Pattern, Any]]:
    """A ``rank_pattern``/``alpha_pattern`` map as (PEFT's pattern for a key, value) pairs, each key
    compiled once. At most ``MAX_PATTERN_KEYS`` keys (found by review: 40,000 harmless keys, each
    recompiled for each module, made one LoadLora run 10 s per module, holding up every other)."""
    if not isinstance(patterns, dict):
        raise _refuse(path, f"{CONFIG_FILE}: {name} must be an object")
    if len(patterns) > MAX_PATTERN_KEYS:
        raise _refuse(path, f"{CONFIG_FILE}: {name} has {len(patterns)} keys; the limit is {MAX_PATTERN_KEYS}")
    compiled = []
    for key, value in patterns.items():
        if not _positive(value):
            raise _refuse(path, f"{CONFIG_FILE}: {name}[{key!r}] must be a finite number > 0, got {value!r}")
        try:  # a pattern on its own; PEFT's rule: it applies to a module whose name ends with it (at a dot)
            regex.compile(key)
            compiled.append((regex.compile(rf"(.*\.)?({key})"), value))
        except (regex.error, RecursionError, OverflowError) as exc:  # deep nesting, huge repeat counts
            raise _refuse(path, f"{CONFIG_FILE}: {name} key {key!r} is not a regular expression: {exc}") from None
    return compiled


def _positive(value: Any) -> bool:
    """A finite number > 0 (JSON's NaN and Infinity parse as floats; a bool is not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:  # an integer past float's range
        return False


def _matches(path: Path, pattern: str | regex.Pattern, module: str) -> bool:
    """``re.fullmatch(pattern, module)`` under ``PATTERN_SECONDS``: the patterns come from the
    adapter's files, and Python's ``re`` backtracks exponentially on some (``(.*)*(.*)*x``) while
    holding the GIL -- one LoadLora froze the whole server. The ``regex`` module can time out."""
    try:
        return regex.fullmatch(pattern, module, timeout=PATTERN_SECONDS) is not None
    except (regex.error, RecursionError, OverflowError):  # not a pattern (a target_modules string is one)
        return False
    except TimeoutError:
        text = pattern if isinstance(pattern, str) else pattern.pattern
        raise _refuse(path, f"{CONFIG_FILE}: the pattern {text[:64]!r} took over {PATTERN_SECONDS} s "
                            f"to match {module!r}") from None


def _pattern_value(path: Path, patterns: list[tuple[regex.Pattern, Any]], module: str, default: Any) -> Any:
    """The value of the first pattern (``_compiled_patterns``) that matches ``module``, else ``default``."""
    for pattern, value in patterns:
        if _matches(path, pattern, module):
            return value
    return default


def _named(names: Any, module: str) -> bool:
    """``module`` is in the list ``names``, in full or by its last dotted parts."""
    return isinstance(names, list) and any(
        isinstance(name, str) and (module == name or module.endswith(f".{name}")) for name in names)


def _targeted(path: Path, config: dict[str, Any], module: str, layer: int) -> bool:
    """PEFT's rule (``check_target_module_exists``): ``exclude_modules`` (a list or a regular
    expression) wins; a ``target_modules`` list names modules by their last dotted parts,
    narrowed to ``layers_to_transform`` when set (the engine's layers are ``model.layers.<i>``,
    so ``layers_pattern`` is not checked); a string is a regular expression over the whole
    name ("all-linear": every projection); unset (PEFT's per-model default) is not checked."""
    excluded, target_modules = config.get("exclude_modules"), config.get("target_modules")
    if _matches(path, excluded, module) if isinstance(excluded, str) else _named(excluded, module):
        return False
    if target_modules is None or target_modules == "all-linear":
        return True
    if isinstance(target_modules, str):
        return _matches(path, target_modules, module)
    if not isinstance(target_modules, list):
        return False
    if module in target_modules:  # a full name: PEFT applies no layer filter to it
        return True
    layers = config.get("layers_to_transform")
    in_layers = layers in (None, []) or (layer == layers if isinstance(layers, int) else
                                         isinstance(layers, list) and layer in layers)
    return in_layers and _named(target_modules, module)


def _expected_shapes(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection."""
    q_out, kv_out = model.num_attention_heads * model.head_dim, model.num_key_value_heads * model.head_dim
    hidden, inter = model.hidden_size, model.intermediate_size
    return {"q": (hidden, q_out), "k": (hidden, kv_out), "v": (hidden, kv_out), "o": (q_out, hidden),
            "gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}


def _read_modules(path: Path, data: bytes, model: ModelConfig) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """(layer, projection letter) -> {"A": tensor, "B": tensor}, every key checked."""
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, KeyError, ValueError, RuntimeError) as exc:  # KeyError: a dtype torch lacks
        raise _refuse(path, f"{WEIGHTS_FILE} cannot be read: {exc!r}") from None
    modules: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise _refuse(path, f"tensor {key!r} is not a LoRA A/B weight of q/k/v/o/gate/up/down_proj "
                          "(embedding, lm_head, DoRA and bias tensors are not supported)")
        layer, attention, mlp, which = match.groups()
        if int(layer) >= model.num_hidden_layers:
            raise _refuse(path, f"tensor {key!r}: the model has {model.num_hidden_layers} layers")
        pair = modules.setdefault((int(layer), attention or mlp), {})
        if which in pair:
            raise _refuse(path, f"tensor {key!r}: another key names the same weight")
        pair[which] = tensor
    if not modules:
        raise _refuse(path, f"{WEIGHTS_FILE} holds no LoRA weights")
    return modules


def _scaled_pair(path: Path, layer: int, proj: str, pair: dict[str, torch.Tensor], config: dict[str, Any],
                 shapes: dict[str, tuple[int, int]], max_rank: int) -> LoraPair:
    block = "self_attn" if proj in "qkvo" else "mlp"
    module = f"model.layers.{layer}.{block}.{proj}_proj"
    if set(pair) != {"A", "B"}:
        raise _refuse(path, f"{module} has lora_{''.join(pair)} but not both lora_A and lora_B")
    if not _targeted(path, config, module, layer):
        options = {key: config[key] for key in ("target_modules", "layers_to_transform", "exclude_modules")
                   if config.get(key) is not None}
        raise _refuse(path, f"{module}: {WEIGHTS_FILE} holds its weights, but {options} does not target it "
                            "(PEFT would ignore them)")
    lora_a, lora_b = pair["A"], pair["B"]
    in_features, out_features = shapes[proj]
    rank = lora_a.shape[0] if lora_a.dim() == 2 else -1
    if lora_a.shape != (rank, in_features) or lora_b.shape != (out_features, rank):
        raise _refuse(path, f"{module}: lora_A {tuple(lora_a.shape)} / lora_B {tuple(lora_b.shape)} do not fit "
                      f"the model's projection (in {in_features}, out {out_features})")
    expected_rank = _pattern_value(path, config["rank_pattern"], module, config["r"])
    if rank != expected_rank:
        raise _refuse(path, f"{module}: rank {rank} but {CONFIG_FILE} says r={expected_rank}")
    if rank > max_rank:
        raise _refuse(path, f"{module}: rank {rank} is above this server's --max-lora-rank {max_rank}")
    alpha = _pattern_value(path, config["alpha_pattern"], module, config["lora_alpha"])
    scale = alpha / math.sqrt(rank) if config.get("use_rslora", False) else alpha / rank
    if lora_a.dtype not in WEIGHT_DTYPES or lora_b.dtype not in WEIGHT_DTYPES:
        raise _refuse(path, f"{module}: LoRA weights must be float16, bfloat16, float32 or float64, "
                            f"not {lora_a.dtype} / {lora_b.dtype}")
    # Both checked as kept (float32): a float64 value past float32's range becomes infinite there.
    kept_a = lora_a.to(torch.float32, copy=True)  # not a view of the read-only file bytes
    scaled_b = lora_b.float() * scale
    if not (torch.isfinite(kept_a).all() and torch.isfinite(scaled_b).all()):
        raise _refuse(path, f"{module}: lora_A, or lora_B times its scale {scale:g}, holds NaN or infinity "
                            "(in float32)")
    return LoraPair(kept_a, scaled_b)


def _digest(*contents: bytes) -> str:
    """One digest of several files: each is preceded by its length, so that bytes moved from the
    end of one file to the start of the next make another digest (without the lengths, the
    digest was that of the files' concatenation)."""
    digest = hashlib.sha256()
    for data in contents:
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()[:32]


def read_peft_adapter(path: Path, model: ModelConfig, max_rank: int, roots: Sequence[str]) -> PeftAdapter:
    """Read and check the adapter in directory ``path``, confined by the caller to ``roots`` (real
    paths), from which it is opened (``confined.ConfinedDirectory``)."""
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if odd := [f.name for f in (config_file, weights_file) if f.exists() and not f.is_file()]:
        raise _refuse(path, f"{odd[0]} is not a regular file")  # a FIFO or a directory: never opened
    if not config_file.is_file():
        raise _refuse(path, f"no {CONFIG_FILE} (a PEFT adapter directory is expected)")
    if not weights_file.is_file():
        pickled = (path / "adapter_model.bin").exists()
        raise _refuse(path, f"no {WEIGHTS_FILE}" + (" (adapter_model.bin is pickle, which is never loaded)"
                                                    if pickled else ""))
    shapes = _expected_shapes(model)
    # Every module at the largest rank in float64, plus a header: a bigger file cannot be a
    # valid adapter, and is refused before more than that is read into memory.
    limit = 8 * max_rank * model.num_hidden_layers * sum(i + o for i, o in shapes.values()) + MAX_CONFIG_BYTES
    config_bytes, config, weights_bytes = _read_files(
        path, roots, limit, f"any adapter of rank <= {max_rank} for this model can be")
    modules = _read_modules(path, weights_bytes, model)
    pairs = {key: _scaled_pair(path, *key, pair, config, shapes, max_rank) for key, pair in sorted(modules.items())}
    layers: list[dict[str, ProjectionDeltas]] = []
    for layer in range(model.num_hidden_layers):
        fused = {}
        for name, letters in FUSED_PROJECTIONS.items():
            parts = tuple(pairs.get((layer, letter)) for letter in letters)
            if any(part is not None for part in parts):
                fused[name] = ProjectionDeltas(parts)
        layers.append(fused)
    max_used = max(pair.lora_a.shape[0] for pair in pairs.values())
    # The key of its KV blocks: the digest of exactly the bytes its weights came from.
    return PeftAdapter(tuple(layers), max_used, _digest(config_bytes, weights_bytes))
