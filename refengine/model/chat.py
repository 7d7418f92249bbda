"""Chat prompts from a local model's template (OpenEngine v0.1.0 has no chat API, so a
client that wants chat applies the template itself before sending text)."""

from __future__ import annotations

from refengine.model.loader import load_tokenizer, resolve_model


def chat_prompt(model: str, message: str) -> str:
    """One user turn formatted with ``model``'s chat template (a manifest name or path
    resolvable on this machine), ready for generation."""
    try:
        tokenizer = load_tokenizer(resolve_model(model).path)
    except Exception as exc:  # noqa: BLE001 - any failure means: no local tokenizer
        raise ValueError(f"--chat with --remote needs model {model!r}'s chat template on this machine "
                         f"(OpenEngine v0.1.0 has no chat API): {exc}") from exc
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)
