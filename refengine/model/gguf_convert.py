"""Convert a GGUF file, once, into a Hugging Face directory in the cache.

refengine serves every model from one on-disk shape (config.json, fp32 safetensors,
tokenizer.json + tokenizer_config.json), so the loader and the oracle tests know one
format only. A GGUF is dequantized (with the ``gguf`` package), renamed to Hugging
Face parameter names, and its q/k rows are put back in Hugging Face order: llama.cpp
permutes them for its interleaved RoPE layout, Hugging Face uses the rotate-half layout.
The tokenizer is built from the GGUF alone (``gguf_tokenizer``). Metadata the conversion
needs is checked first: a file without it is refused naming the file and the key.

The cache entry is written into a temporary sibling directory, the marker file last,
then renamed into place: a crash leaves no marker (and no final directory), so the
next start converts again; a complete entry loads in about a second.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from refengine.model.gguf_tokenizer import convert_tokenizer
from refengine.model.manifest import UnsupportedModelError

logger = logging.getLogger(__name__)

#: Bump when the output changes, so old cache entries are converted again.
CONVERTER_VERSION = 1
MARKER_FILE = ".refengine-converted.json"
MAX_SHARD_BYTES = 2 << 30

#: GGUF architecture -> (HF class, HF model_type, q/k rows permuted by llama.cpp?).
#: Mistral GGUFs say "llama" (same weights; the sliding window is not in the file).
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),  # NeoX RoPE: llama.cpp keeps HF row order
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def source_fingerprint(gguf_path: Path) -> str:
    """A cheap identity of a GGUF: its size plus its first and last MiB.

    The header (all metadata) is at the start, so a different model or quantization
    changes the hash; hashing the whole file would cost seconds on every start.
    """
    size = gguf_path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with gguf_path.open("rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read())
    return digest.hexdigest()[:32]


def is_converted(target: Path, fingerprint: str) -> bool:
    """Whether ``target`` is a complete conversion of the GGUF with ``fingerprint``."""
    try:
        marker = json.loads((target / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("source_fingerprint") == fingerprint and marker.get("converter") == CONVERTER_VERSION


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Serialize conversions of one entry across processes (e.g. parallel test workers)."""
    with lock_path.open("w") as f:  # closing the file releases the lock
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def ensure_converted(gguf_path: Path, target: Path) -> Path:
    """Return ``target``, converting ``gguf_path`` into it first unless already done."""
    fingerprint = source_fingerprint(gguf_path)
    if is_converted(target, fingerprint):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        if is_converted(target, fingerprint):  # another process finished while we waited
            return target
        for stale in target.parent.glob(f".{target.name}.tmp-*"):  # left by a crashed conversion
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; a shared cache must be readable
        try:
            started = time.perf_counter()
            logger.info("converting %s into %s (once; later starts load from there)", gguf_path, target)
            convert_gguf(gguf_path, tmp)
            seconds = round(time.perf_counter() - started, 2)
            marker = {"source": str(gguf_path), "source_fingerprint": fingerprint, "seconds": seconds}
            marker["converter"] = CONVERTER_VERSION
            for path in tmp.iterdir():
                path.chmod(0o644)
            (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2))  # last: marks completeness
            if target.exists():
                shutil.rmtree(target)  # incomplete, or converted from another file/version
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _meta(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value; float32 values are given their shortest decimal (1e-05, not 9.99e-06)."""
    field = reader.get_field(key)
    if field is None:
        return default
    value = field.contents()
    if isinstance(value, float):
        value = float(str(np.float32(value)))
    return value


def unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permute: rows (head, 2, half) back to HF's (head, half, 2).

    llama.cpp's converter does ``w.reshape(n_head, 2, rows // n_head // 2, ...)
    .swapaxes(1, 2)``; swapping the same two axes of the other grouping inverts it.
    """
    rows = weight.shape[0]
    grouped = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face parameter name of a GGUF tensor name."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart here")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.{suffix}"


def _required(reader: Any, gguf_path: Path, key: str) -> Any:
    """A metadata value the conversion cannot do without: a positive int or float, or
    UnsupportedModelError naming the file and the key (before any arithmetic uses it)."""
    value = _meta(reader, key)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise UnsupportedModelError(f"{gguf_path}: metadata {key} is {value!r}, a positive number is required")
    return value


def _hf_config(reader: Any, gguf_path: Path, arch: str, tied: bool, vocab_size: int) -> dict[str, Any]:
    """config.json contents from the GGUF metadata (``<arch>.*`` keys)."""
    hf_class, model_type, _ = _ARCHITECTURES[arch]
    if _meta(reader, f"{arch}.rope.scaling.type", "none") not in ("none", None):
        raise UnsupportedModelError("GGUF RoPE scaling is not supported; convert from the HF checkpoint")
    required = {name: _required(reader, gguf_path, f"{arch}.{name}") for name in (
        "embedding_length", "attention.head_count", "feed_forward_length", "block_count", "context_length",
        "attention.layer_norm_rms_epsilon")}
    hidden, heads = required["embedding_length"], required["attention.head_count"]
    eos = [_meta(reader, "tokenizer.ggml.eos_token_id")]
    eos += [v for k in ("eot", "eom") if (v := _meta(reader, f"tokenizer.ggml.{k}_token_id")) is not None]
    eos = list(dict.fromkeys(e for e in eos if e is not None))
    return {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": required["feed_forward_length"],
        "num_hidden_layers": required["block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": _meta(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _meta(reader, f"{arch}.attention.key_length", hidden // heads),
        "hidden_act": "silu",
        "max_position_embeddings": required["context_length"],
        "rms_norm_eps": required["attention.layer_norm_rms_epsilon"],
        "rope_theta": _meta(reader, f"{arch}.rope.freq_base", 10000.0),
        "tie_word_embeddings": tied,
        "bos_token_id": _meta(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else eos or None,  # None: the GGUF names no EOS
        "torch_dtype": "float32",
    }


def _plan_shards(sizes: list[int], max_bytes: int) -> list[int]:
    """Shard index of each tensor, filling shards in file order up to ``max_bytes``."""
    plan, shard, used = [], 0, 0
    for size in sizes:
        if used and used + size > max_bytes:
            shard, used = shard + 1, 0
        plan.append(shard)
        used += size
    return plan


def convert_gguf(gguf_path: Path, out_dir: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write config.json, generation_config.json, fp32 safetensors and the tokenizer to ``out_dir``."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(gguf_path)
    except (ValueError, OSError) as exc:  # the reader's own checks (magic, version, sizes)
        raise UnsupportedModelError(f"{gguf_path} is not a readable GGUF file: {exc}") from exc
    arch = _meta(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported ({sorted(_ARCHITECTURES)})")
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise UnsupportedModelError(f"{gguf_path} has no token_embd.weight tensor (the embeddings)")
    vocab_size = int(names["token_embd.weight"].shape[-1])
    config = _hf_config(reader, gguf_path, arch, tied="output.weight" not in names, vocab_size=vocab_size)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    permuted = _ARCHITECTURES[arch][2]

    sizes = [int(np.prod(t.shape)) * 4 for t in reader.tensors]
    plan = _plan_shards(sizes, max_shard_bytes)
    n_shards = plan[-1] + 1
    files = (
        ["model.safetensors"]
        if n_shards == 1
        else [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    )
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    bar = tqdm(total=sum(sizes), unit="B", unit_scale=True, desc=f"Converting {gguf_path.name}")
    with bar:
        for i, tensor in enumerate(reader.tensors):
            name = hf_tensor_name(tensor.name)
            weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
            if permuted and ".q_proj." in name:
                weight = unpermute_rows(weight, heads)
            elif permuted and ".k_proj." in name:
                weight = unpermute_rows(weight, kv_heads)
            shard[name] = torch.from_numpy(np.array(weight, dtype=np.float32, order="C"))  # owned copy
            weight_map[name] = files[plan[i]]
            bar.update(sizes[i])
            if i + 1 == len(plan) or plan[i + 1] != plan[i]:
                save_file(shard, out_dir / files[plan[i]], metadata={"format": "pt"})
                shard = {}
    if n_shards > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    convert_tokenizer(gguf_path, out_dir, config)
