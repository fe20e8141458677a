"""Normalise `Engine.generate` inputs: one prompt or a batch, text or ids, shared or per-prompt params."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class InputBatch:
    ids: list[list[int]]
    params: list[dict[str, Any]]
    rids: list[str | None]
    single: bool  # the caller passed one prompt, not a list


def _is_id_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def normalize_inputs(
    prompt: str | list[str] | None,
    input_ids: list[int] | list[list[int]] | None,
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None,
    rid: str | list[str] | None,
    tokenizer: Any,
) -> InputBatch:
    if (prompt is None) == (input_ids is None):
        raise ValueError("pass exactly one of prompt and input_ids")
    if prompt is not None:
        single = isinstance(prompt, str)
        texts = [prompt] if single else prompt
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ValueError("prompt must be a string or a list of strings")
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass input_ids")
        ids = [tokenizer.encode(t) for t in texts]
    else:
        single = _is_id_list(input_ids)
        ids = [input_ids] if single else input_ids
        if not isinstance(ids, list) or not all(_is_id_list(x) for x in ids):
            raise ValueError("input_ids must be a list of token ids or a list of such lists")
        ids = [list(x) for x in ids]
    if not ids:
        raise ValueError("the batch is empty")
    if isinstance(sampling_params, list):
        if len(sampling_params) != len(ids):
            raise ValueError(f"{len(sampling_params)} sampling_params for {len(ids)} prompts")
        params = sampling_params
    else:
        params = [sampling_params or {}] * len(ids)
    if isinstance(rid, list):
        if len(rid) != len(ids):
            raise ValueError(f"{len(rid)} rids for {len(ids)} prompts")
        rids: list[str | None] = list(rid)
    elif rid is not None:
        if len(ids) > 1:
            raise ValueError("a batch needs a list of rids")
        rids = [rid]
    else:
        rids = [None] * len(ids)
    return InputBatch(ids=ids, params=params, rids=rids, single=single)
