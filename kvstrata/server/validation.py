"""From an HTTP request to engine inputs: body parsing, model check, prompt ids, sampling params.

Everything that can be wrong with a request is found here, before the engine sees it, and raised as
an ``APIError`` (400/404) with OpenAI's ``param`` and ``code``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.server.engine_client import EngineClient
from kvstrata.server.errors import APIError, validation_error
from kvstrata.server.protocol import MAX_N, ChatCompletionRequest, ChatMessage, CompletionRequest, PinRequest

M = TypeVar("M", bound=BaseModel)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


async def parse_body(request: Request, model: type[M]) -> M:
    """Strict UTF-8, strict JSON (no NaN/Infinity, no lone surrogates), then strict pydantic."""
    raw = await request.body()
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(
            400, f"the request body is not valid UTF-8 (byte {exc.start})", code="invalid_utf8"
        ) from exc
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        detail = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise APIError(400, f"malformed JSON in the request body: {detail}", code="invalid_json") from exc
    except RecursionError as exc:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(
            400, "the request holds a lone UTF-16 surrogate (invalid UTF-8)", code="invalid_utf8"
        ) from exc
    except RecursionError as exc:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from exc


def check_model(client: EngineClient, name: str | None) -> None:
    if name is not None and name != client.model_name:
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {client.model_name!r}",
            param="model",
            code="model_not_found",
        )


@dataclass
class Job:
    """The prompts of one API request and the sampling params they share (``n`` choices each)."""

    prompts: list[list[int]]
    params: dict[str, Any]
    images: list[list[Any]] | None = None  # per prompt: decoded images (PIL), vision-language models

    @property
    def n(self) -> int:
        return int(self.params.get("n", 1))


def _max_new_tokens(
    client: EngineClient, prompt_len: int, requested: int | None, param: str, prompt_param: str
) -> int:
    ctx = client.context_length
    if prompt_len >= ctx:
        raise APIError(
            400,
            f"this model's maximum context length is {ctx} tokens, but the prompt has {prompt_len} tokens",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return ctx - prompt_len
    if prompt_len + requested > ctx:
        raise APIError(
            400,
            f"this model's maximum context length is {ctx} tokens; you asked for {prompt_len + requested} "
            f"({prompt_len} in the prompt, {requested} to generate): lower {param}",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def _sampling(req: CompletionRequest | ChatCompletionRequest, max_new: int, top_logprobs: int | None) -> dict:
    params: dict[str, Any] = {"max_new_tokens": max_new}
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        value = getattr(req, name)
        if value is not None:
            params[name] = value
    if req.stop_list:
        params["stop"] = req.stop_list
    if req.stop_token_ids:
        params["stop_token_ids"] = list(req.stop_token_ids)
    if req.ignore_eos:
        params["ignore_eos"] = True
    if top_logprobs is not None:
        params["return_logprob"] = True
        params["top_logprobs_num"] = top_logprobs
    if req.n > 1:
        params["n"] = req.n
    if req.seed is not None:
        params["seed"] = req.seed
    try:
        SamplingParams.from_dict(params)
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc
    return params


def completion_job(client: EngineClient, req: CompletionRequest) -> Job:
    prompt = req.prompt
    if isinstance(prompt, str):
        id_lists = [client.encode(prompt)]
    elif isinstance(prompt[0], str):
        id_lists = [client.encode(p) for p in prompt]  # type: ignore[arg-type]
    elif isinstance(prompt[0], int):
        id_lists = [list(prompt)]  # type: ignore[arg-type]
    else:
        id_lists = [list(p) for p in prompt]  # type: ignore[union-attr]
    if len(id_lists) * req.n > MAX_N:
        message = f"n ({req.n}) times the number of prompts ({len(id_lists)}) must be at most {MAX_N}"
        raise APIError(400, message, param="n", code="invalid_value")
    vocab = client.vocab_size
    max_new = 0
    for ids in id_lists:
        if not ids:
            raise APIError(400, "prompt: the prompt is empty after tokenization", param="prompt")
        if max(ids) >= vocab:
            raise APIError(
                400, f"prompt: token id {max(ids)} is outside the vocabulary ({vocab})", param="prompt"
            )
        max_new = _max_new_tokens(client, len(ids), req.max_tokens, "max_tokens", "prompt")
    if req.max_tokens is None:  # shared params: the longest prompt sets the default
        max_new = min(client.context_length - len(ids) for ids in id_lists)
    return Job(id_lists, _sampling(req, max_new, req.logprobs))


def chat_prompt(client: EngineClient, messages: list[ChatMessage]) -> tuple[list[int], list[Any]]:
    """Chat template ids and the decoded images of ``image_url`` parts (a bad image is a 400 here,
    before the engine or its cache sees anything). Length: with each image's placeholder span."""
    urls = [url for m in messages for url in m.image_urls()]
    images = [client.load_image(url) for url in urls]
    if client.template_takes_image_parts():
        # The processors' templates of llava-hf / SmolVLM checkpoints render {"type": "image"} parts.
        ids = client.chat_ids([{"role": m.role, "content": m.parts()} for m in messages])
    else:
        image_text = client.image_text() if urls else ""
        ids = client.chat_ids([{"role": m.role, "content": m.text(image_text)} for m in messages])
    if urls:
        placed = ids.count(client.image_token_id())
        if placed != len(urls):
            raise APIError(
                400,
                f"messages: the chat template placed {placed} image tokens for {len(urls)} images",
                param="messages",
                code="invalid_image",
            )
    return ids, images


def pin_prompt(client: EngineClient, req: PinRequest) -> tuple[list[int], list[Any]]:
    """The ids (and images) of a ``POST /v1/cache/pins`` body, within the served context length."""
    images: list[Any] = []
    if req.messages is not None:
        ids, images = chat_prompt(client, req.messages)
        param = "messages"
    elif req.prompt is not None:
        ids, param = client.encode(req.prompt), "prompt"
    else:
        ids, param = list(req.input_ids or []), "input_ids"
    length = len(ids) + client.image_extra_tokens(images)
    _max_new_tokens(client, length, 1, param, param)
    return ids, images


def chat_job(client: EngineClient, req: ChatCompletionRequest) -> Job:
    ids, images = chat_prompt(client, req.messages)
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    length = len(ids) + client.image_extra_tokens(images)
    max_new = _max_new_tokens(client, length, req.max_new_tokens, param, "messages")
    top = (req.top_logprobs or 0) if req.logprobs else None
    return Job([ids], _sampling(req, max_new, top), [images] if images else None)
