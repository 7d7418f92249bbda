"""The tokenizer of a GGUF, built once by transformers and saved as Hugging Face files.

transformers builds it from the GGUF's own metadata (vocabulary, merges, special tokens, chat
template). It is asked to do so in a temporary directory that holds only a link to the GGUF:
called on the GGUF's own folder it would also read whatever else sits there -- another model's
tokenizer_config.json (its chat template, its EOS) or an ``auto_map`` naming code in that
folder, which it offers to run. ``trust_remote_code=False`` refuses such code in any case.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from refengine.model.manifest import UnsupportedModelError


def convert_tokenizer(gguf_path: Path, out_dir: Path, config: dict[str, Any]) -> None:
    """Let transformers build the fast tokenizer from the GGUF once, and save it as files.

    The chat template goes into tokenizer_config.json (``save_jinja_files=False``), where
    every Hugging Face directory of this generation keeps it. The special-token ids are
    checked after a reload, because a wrong bos/eos silently breaks prompts and stopping.
    """
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="refengine-gguf-") as isolated:
        (Path(isolated) / gguf_path.name).symlink_to(gguf_path.resolve())
        tokenizer = AutoTokenizer.from_pretrained(
            isolated, gguf_file=gguf_path.name, local_files_only=True, trust_remote_code=False
        )
    tokenizer.model_max_length = config["max_position_embeddings"]
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    config_path = out_dir / "tokenizer_config.json"
    saved = json.loads(config_path.read_text())
    for load_time_key in ("is_local", "local_files_only"):  # how it was loaded, not what it is
        saved.pop(load_time_key, None)
    config_path.write_text(json.dumps(saved, indent=2, ensure_ascii=False))

    reloaded = AutoTokenizer.from_pretrained(out_dir, local_files_only=True, trust_remote_code=False)
    eos = config["eos_token_id"]
    first_eos = eos[0] if isinstance(eos, list) else eos
    if (reloaded.bos_token_id, reloaded.eos_token_id) != (config["bos_token_id"], first_eos):
        raise UnsupportedModelError(
            f"tokenizer from {gguf_path.name} has bos/eos {reloaded.bos_token_id}/{reloaded.eos_token_id}, "
            f"the GGUF metadata says {config['bos_token_id']}/{first_eos}"
        )
