"""The OpenAI-compatible wire format as the fleet speaks it: request fields to sampling parameters,
error bodies, server-sent-event framing. Shared by the replica's HTTP face (which parses requests) and
the remote backend (which writes them), so both sides agree on names, including vLLM's extra
sampling fields (top_k, min_tokens, ignore_eos, stop_token_ids, return_token_ids).
"""
from __future__ import annotations

import json
from typing import Any

from chatloom.engine.sampling_params import InvalidRequest, SamplingParams
from chatloom.serving.backend import BadGenerationRequest, EmbedInput

# OpenAI's default for /v1/completions; chat answers default to the rest of the context window.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def embedding_inputs(value: object) -> list[EmbedInput]:
    """/v1/embeddings' `input`: a string, a list of strings, a list of token ids, or a list of such
    lists, as a list of inputs. BadGenerationRequest (param `input`) names what is wrong."""
    def ids(v: object) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    if isinstance(value, str):
        value = [value]
    elif ids(value):
        value = [value]
    if not isinstance(value, list) or not value:
        raise BadGenerationRequest("input must be a string, a list of strings, a list of token ids, or a list "
                                   "of token-id lists, and not empty", param="input")
    for i, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise BadGenerationRequest(f"input[{i}] is an empty string", param="input")
        elif not ids(item):
            raise BadGenerationRequest(f"input[{i}] must be a non-empty string or a non-empty list of token ids",
                                       param="input")
    return list(value)


def _number(body: dict, name: str, kind: type, default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise BadGenerationRequest(f"{name} must be a{'n integer' if kind is int else ' number'}", param=name)
    return kind(value)


def sampling_from_body(body: dict, default_max_tokens: int) -> SamplingParams:
    """SamplingParams from an OpenAI/vLLM request body; BadGenerationRequest names a bad field."""
    if _number(body, "n", int, 1) != 1:
        raise BadGenerationRequest("only n=1 is supported", param="n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", int, default_max_tokens)
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadGenerationRequest("stop must be a string or a list of strings", param="stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise BadGenerationRequest("stop_token_ids must be a list of integers", param="stop_token_ids")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadGenerationRequest("seed must be an integer", param="seed")
    # chatloom's own: keep the KV cache when the answer ends under a handle (kv_handle), or adopt the one
    # kept under kv_resume_of (the tool loop's hold, engine/kv_holds.py).
    kv = {name: body.get(name) for name in ("kv_handle", "kv_resume_of")}
    for name, value in kv.items():
        if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 200):
            raise BadGenerationRequest(f"{name} must be a string of 1 to 200 characters", param=name)
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=_number(body, "temperature", float, 1.0),
            top_p=_number(body, "top_p", float, 1.0), top_k=_number(body, "top_k", int, 0), seed=seed,
            min_tokens=_number(body, "min_tokens", int, 0), ignore_eos=bool(body.get("ignore_eos", False)),
            stop=list(stop), stop_token_ids=list(stop_ids), keep_kv=kv["kv_handle"] is not None,
            resume_of=kv["kv_resume_of"])
    except InvalidRequest as exc:
        raise BadGenerationRequest(str(exc)) from None


def sampling_to_body(params: SamplingParams) -> dict:
    """The request fields for `params` (the inverse of sampling_from_body)."""
    body: dict[str, Any] = {"max_tokens": params.max_tokens, "temperature": params.temperature,
                            "top_p": params.top_p}
    if params.top_k > 0:
        body["top_k"] = params.top_k
    if params.seed is not None:
        body["seed"] = params.seed
    if params.min_tokens:
        body["min_tokens"] = params.min_tokens
    if params.ignore_eos:
        body["ignore_eos"] = True
    if params.stop:
        body["stop"] = list(params.stop)
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if params.resume_of is not None:
        body["kv_resume_of"] = params.resume_of
    return body


def error_body(message: str, type_: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "code": code, "param": param}}


def error_message(payload: Any) -> str | None:
    """The message of an OpenAI-style ({"error": {...}}) or older vLLM-style ({"message": ...}) error."""
    if isinstance(payload, dict):
        err = payload.get("error", payload)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        if isinstance(payload.get("detail"), str):
            return payload["detail"]
    return None


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"
