"""The URLs a batch may target, as the batch runner's `Endpoint`s: each checks a line's body with the
route's own request model and answers it with the route's own code (non-streamed), with the run in the
batch traffic class. Another endpoint (embeddings...) joins by adding its entry to `batch_endpoints`."""
from __future__ import annotations

import json
from typing import Awaitable, Callable

from pydantic import BaseModel, ValidationError

from chatloom.app.api.deps import AppContext
from chatloom.app.api.openai_schemas import ChatCompletionIn, CompletionIn
from chatloom.app.api.routes.openai import chat_answer, completion_answer
from chatloom.app.batch.lines import Endpoint
from chatloom.app.core.errors import ApiError
from chatloom.serving import BackendError, BackendNotReady, BadGenerationRequest, UnknownModel
from chatloom.serving.backend import ModelLoadFailed
from chatloom.store import User


def _check(model: type[BaseModel], convert: Callable[[BaseModel], object]) -> Callable[[dict], str | None]:
    def check(body: dict) -> str | None:
        try:
            convert(model.model_validate(body))
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "body"
            return f"body.{where}: {err['msg']}"
        except ApiError as exc:
            return f"body.{exc.param}: {exc.message}" if exc.param else exc.message
        return None
    return check


def _runner(ctx: AppContext, model: type[BaseModel], answer) -> Callable[[User, dict, str], Awaitable[dict]]:
    async def run(user: User, body: dict, request_id: str) -> dict:
        request = model.model_validate({**body, "stream": False})
        try:
            async with ctx.db.session() as session:
                response = await answer(ctx, request, user, session, batch=True)
        except (UnknownModel, BadGenerationRequest) as exc:  # as error_handlers.py answers them over HTTP
            raise ApiError(404 if isinstance(exc, UnknownModel) else 400, str(exc), exc.code, exc.param) from None
        except ModelLoadFailed as exc:  # no wait helps: the line fails
            raise ApiError(502, f"the model backend failed: {exc}", "backend_error") from None
        except BackendNotReady as exc:  # loading: the runner waits and runs the line again
            raise ApiError(503, str(exc), "model_not_ready", headers={"Retry-After": "1"}) from None
        except BackendError as exc:
            raise ApiError(502, f"the model backend failed: {exc}", "backend_error") from None
        return json.loads(response.body)
    return run


def batch_endpoints(ctx: AppContext) -> dict[str, Endpoint]:
    return {
        "/v1/chat/completions": Endpoint(_check(ChatCompletionIn, lambda b: (b.prompt(b.tool_use()), b.tool_use())),
                                         _runner(ctx, ChatCompletionIn, chat_answer)),
        "/v1/completions": Endpoint(_check(CompletionIn, lambda b: b.to_prompt()),
                                    _runner(ctx, CompletionIn, completion_answer)),
    }
