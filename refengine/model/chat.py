"""Chat prompts from a local model's template (OpenEngine v0.1.0 has no chat API, so a
client that wants chat applies the template itself before sending text)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from refengine.model.loader import load_tokenizer, resolve_model

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def chat_prompt(model: str, message: str) -> str:
    """One user turn formatted with ``model``'s chat template (a manifest name or path
    resolvable on this machine), ready for generation."""
    try:
        tokenizer = load_tokenizer(resolve_model(model).path)
    except Exception as exc:  # noqa: BLE001 - any failure means: no local tokenizer
        raise ValueError(f"--chat with --remote needs model {model!r}'s chat template on this machine "
                         f"(OpenEngine v0.1.0 has no chat API): {exc}") from exc
    return apply_chat_template(tokenizer, model, message)


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, model: str, message: str) -> str:
    """One user turn in ``tokenizer``'s chat template. ValueError naming ``model`` when it has
    none or the template does not render (a syntax error, a template that raises)."""
    if not tokenizer.chat_template:
        raise ValueError(f"model {model!r} has no chat template: --chat needs one (send a plain prompt instead)")
    try:
        return tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                             add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - the template is code: '{{ 1 / 0 }}' raises ZeroDivisionError, not TemplateError
        raise ValueError(f"model {model!r}: its chat template does not render: {exc}") from exc
