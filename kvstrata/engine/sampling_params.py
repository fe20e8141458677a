"""Sampling parameters, with SGLang's names, validated with messages a server can return as HTTP 400."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

MAX_TOP_LOGPROBS = 20
# Below this a temperature only overflows float32 logits / T: sample greedily instead, as SGLang does.
GREEDY_BELOW_TEMPERATURE = 1e-5
# Penalties below this turn logits of seen tokens into inf; top_k beyond int32 cannot be a tensor index.
MIN_REPETITION_PENALTY = 0.01
MAX_TOP_K = 2**31 - 1
# The engine thread checks every stop string against the tail of the text each step: bound the work.
MAX_STOP_CHARS = 1024


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    skip_special_tokens: bool = True

    @classmethod
    def from_dict(cls, params: dict[str, Any] | SamplingParams | None) -> SamplingParams:
        """Build from a dict (unknown keys are an error), then validate."""
        if isinstance(params, SamplingParams):
            params.validate()
            return params
        params = dict(params or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        if isinstance(params.get("stop"), str):
            params["stop"] = [params["stop"]]
        if params.get("stop") is None:
            params.pop("stop", None)
        if params.get("stop_token_ids") is None:
            params.pop("stop_token_ids", None)
        out = cls(**params)
        out.validate()
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def needs_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def validate(self) -> None:
        def number(name: str, value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            return float(value)

        def integer(name: str, value: Any) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            return value

        if integer("max_new_tokens", self.max_new_tokens) < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if number("temperature", self.temperature) < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < number("top_p", self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not -1 <= integer("top_k", self.top_k) <= MAX_TOP_K:
            raise ValueError(f"top_k must be -1 (off) or in [1, {MAX_TOP_K}], got {self.top_k}")
        if not 0.0 <= number("min_p", self.min_p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if number("repetition_penalty", self.repetition_penalty) < MIN_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be > 0 (at least {MIN_REPETITION_PENALTY}), "
                f"got {self.repetition_penalty}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= number(name, getattr(self, name)) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"each stop string must be at most {MAX_STOP_CHARS} characters")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        if integer("n", self.n) < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.seed is not None:
            integer("seed", self.seed)
        if not 0 <= integer("top_logprobs_num", self.top_logprobs_num) <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs_num}"
            )
        for name in ("ignore_eos", "return_logprob", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
