"""The ordered-placeholder contract: media item ``i`` fills the prompt's ``i``-th placeholder.

A placeholder is a maximal run of the model's image token id in the prompt's token ids (a
text prompt gets it from the tokenizer, which maps the model's image marker, e.g.
``<image>``, to that id). A run of one token is expanded to the ``num_image_tokens``
embedding positions one image fills; a run already of that length (a client that expanded
it, as Hugging Face processors do) is kept; any other length, or a count of runs other than
the number of items, is refused (``InvalidRequestError``) before acceptance.
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
    runs = placeholder_runs(prompt_ids, image_token_id)
    if len(runs) != num_items:
        raise InvalidRequestError(
            f"the prompt has {len(runs)} image placeholder(s) (token id {image_token_id}) but the request has "
            f"{num_items} media item(s): each item fills one placeholder, in order")
    expanded: list[int] = []
    starts: list[int] = []
    previous_end = 0
    for index, (start, length) in enumerate(runs):
        if length not in (1, num_image_tokens):
            raise InvalidRequestError(
                f"image placeholder {index} is {length} tokens long: it must be 1 token (expanded here) or "
                f"{num_image_tokens} (already expanded)")
        expanded.extend(prompt_ids[previous_end:start])
        starts.append(len(expanded))
        expanded.extend([image_token_id] * num_image_tokens)
        previous_end = start + length
    expanded.extend(prompt_ids[previous_end:])
    return expanded, starts
