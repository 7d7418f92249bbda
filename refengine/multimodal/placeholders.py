"""The ordered-placeholder contract: media item ``i`` fills the prompt's ``i``-th placeholder.

A placeholder is one image token id (a text prompt gets it from the tokenizer, which maps
the model's image marker, e.g. ``<image>``, to that id), expanded to the
``num_image_tokens`` embedding positions one image fills, or ``num_image_tokens`` of them
(a client that expanded it, as Hugging Face processors do), kept. Placeholders may be
adjacent, as transformers' LLaVA reads them: a maximal run of the id shorter than
``num_image_tokens`` is that many one-token placeholders ("<image><image>"), a run of a
multiple of it that many expanded ones; any other length (ambiguous), or a count of
placeholders other than the number of items, is refused (``InvalidRequestError``) before
acceptance.
"""

from __future__ import annotations

from collections.abc import Sequence

from refengine.types import InvalidRequestError


def placeholder_runs(prompt_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each maximal run of ``image_token_id``, in order."""
    runs: list[tuple[int, int]] = []
    for position, token in enumerate(prompt_ids):
        if token != image_token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == position:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((position, 1))
    return runs


def expand_placeholders(prompt_ids: Sequence[int], image_token_id: int, num_items: int,
                        num_image_tokens: int) -> tuple[list[int], list[int]]:
    """The prompt with every placeholder ``num_image_tokens`` long, and each item's first
    position in it."""
    placeholders = _placeholders(placeholder_runs(prompt_ids, image_token_id), num_image_tokens)
    if len(placeholders) != num_items:
        raise InvalidRequestError(
            f"the prompt has {len(placeholders)} image placeholder(s) (token id {image_token_id}) but the request "
            f"has {num_items} media item(s): each item fills one placeholder, in order")
    expanded: list[int] = []
    starts: list[int] = []
    previous_end = 0
    for start, length in placeholders:
        expanded.extend(prompt_ids[previous_end:start])
        starts.append(len(expanded))
        expanded.extend([image_token_id] * num_image_tokens)
        previous_end = start + length
    expanded.extend(prompt_ids[previous_end:])
    return expanded, starts


def _placeholders(runs: list[tuple[int, int]], num_image_tokens: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each placeholder, in order: every run split as the module docstring says."""
    placeholders: list[tuple[int, int]] = []
    for index, (start, length) in enumerate(runs):
        if length % num_image_tokens == 0:
            size = num_image_tokens
        elif length < num_image_tokens:
            size = 1
        else:
            raise InvalidRequestError(
                f"image placeholder {index} is {length} tokens long: a run of the image token must be one token "
                f"per image (expanded here, fewer than {num_image_tokens}) or {num_image_tokens} per image "
                "(already expanded)")
        placeholders.extend((offset, size) for offset in range(start, start + length, size))
    return placeholders
