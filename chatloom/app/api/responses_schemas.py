"""The Responses API's request body (POST /v1/responses) and the ask it becomes: sampling, function tools and
tool_choice, text.format (text, json_object, json_schema) as the engine's constraint, and reasoning.effort as
the reasoning class. The items of `input` are read by app/responses/items.py.

Built-in tools (web_search, file_search, code_interpreter, mcp) are read by api/hosted_tools_in.py and run on
the server; their specs join the function tools the model is offered. `include` picks what their items
show. Unknown fields (prompt_cache_key, service_tier...) are accepted and ignored, as on the other OpenAI
routes; fields that would change the answer in a way this server cannot honour (`background`, `truncation`
"auto", tool types it does not know) are refused with a 400 naming them.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from chatloom.app.api.hosted_tools_in import is_hosted, shown as shown_tool
from chatloom.app.api.openai_schemas import checked
from chatloom.app.core.errors import ApiError
from chatloom.app.generation.pipeline import Ask
from chatloom.app.generation.tool_calls import ToolSpec, ToolUse
from chatloom.serving import Constraint
from chatloom.store import User

LENIENT = ConfigDict(extra="ignore")
# OpenAI's efforts, mapped onto the reasoning class's dial (traffic/reasoning.py): none turns thinking off.
EFFORTS = {"none": None, "minimal": "low", "low": "low", "medium": "medium", "high": "high"}
MAX_METADATA = 16


class FunctionToolIn(BaseModel):
    model_config = LENIENT
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(BaseModel):
    model_config = LENIENT
    type: Literal["function"]
    name: str


class TextFormatIn(BaseModel):
    model_config = LENIENT
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)  # json_schema
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def shown(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "name": self.name, "schema": self.schema_, "description": self.description,
                "strict": self.strict}


class TextIn(BaseModel):
    model_config = LENIENT
    format: TextFormatIn | None = None


class ReasoningIn(BaseModel):
    model_config = LENIENT
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class ResponseCreateIn(BaseModel):
    model_config = LENIENT
    model: str = Field(min_length=1)
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=64)
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextIn | None = None
    reasoning: ReasoningIn | None = None
    metadata: dict[str, str] | None = None
    store: bool = True
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=64)
    stream: bool = False
    user: str | None = Field(default=None, max_length=256)
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = Field(default=None, max_length=16)

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return v
        if len(v) > MAX_METADATA:
            raise ValueError(f"at most {MAX_METADATA} keys")
        for key, value in v.items():
            if len(key) > 64 or len(value) > 512:
                raise ValueError("keys may have at most 64 characters and values at most 512")
        return v

    def refuse_unsupported(self) -> None:
        if self.background:
            raise ApiError(400, "background responses are not supported; leave background out or false",
                           "unsupported_value", "background")
        if self.truncation == "auto":
            raise ApiError(400, "truncation 'auto' is not supported: a thread that does not fit the context "
                           "window is refused with context_length_exceeded", "unsupported_value", "truncation")

    def function_tools(self) -> list[FunctionToolIn]:
        out = []
        for i, raw in enumerate(self.tools or []):
            kind = raw.get("type")
            if is_hosted(raw):
                continue
            if kind != "function":
                raise ApiError(400, f"tools[{i}] is of type {kind!r}; this endpoint takes function tools and the "
                               "built-in web_search, file_search, code_interpreter and mcp", "unsupported_value",
                               "tools")
            try:
                out.append(FunctionToolIn.model_validate(raw))
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(x) for x in err["loc"])
                raise ApiError(400, f"tools[{i}].{where}: {err['msg']}", "invalid_value", "tools") from None
        return out

    def tool_use(self, hosted: list[ToolSpec] = ()) -> ToolUse | None:
        """The function tools (and the `hosted` built-ins' specs) and tool_choice, checked: 400 for an
        unknown name or a bad schema."""
        tools = self.function_tools()
        choice = self.tool_choice or "auto"
        if not tools and not hosted:
            if choice not in ("auto", "none"):
                raise ApiError(400, "tool_choice needs tools", "invalid_value", "tool_choice")
            return None
        specs = [ToolSpec(t.name, t.description or "", t.parameters if t.parameters is not None
                          else {"type": "object", "properties": {}}) for t in tools]
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ApiError(400, "tool names must be unique", "invalid_value", "tools")
        taken = [s.name for s in hosted if s.name in names]
        if taken:
            raise ApiError(400, f"the function {taken[0]!r} has the name of a built-in tool of this request; "
                           "rename it", "invalid_value", "tools")
        if isinstance(choice, FunctionChoice):
            if choice.name not in names:
                raise ApiError(400, f"tool_choice names the function {choice.name!r}, which is not in tools "
                               f"({', '.join(names)})", "invalid_value", "tool_choice")
            choice = choice.name
        for spec in specs:  # the built-ins' own schemas are the server's (or its MCP server's) to check
            checked(Constraint.json_schema(spec.parameters), f"the parameters of tool {spec.name!r}", "tools")
        return ToolUse(tuple(specs) + tuple(hosted), choice, self.parallel_tool_calls is not False)

    def constraint(self, tools: ToolUse | None) -> Constraint | None:
        """What the engine must enforce: forced tool calls, or text.format."""
        fmt = self.text.format if self.text is not None else None
        if tools is not None and tools.forced:
            if fmt is not None and fmt.type != "text":
                raise ApiError(400, "text.format cannot be combined with a forced tool_choice", "invalid_value",
                               "text.format")
            return checked(tools.constraint(), "the tools", "tools")
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return Constraint.json_object()
        if fmt.schema_ is None or not fmt.name:
            raise ApiError(400, "text.format of type json_schema needs a name and a schema", "invalid_value",
                           "text.format")
        return checked(Constraint.json_schema(fmt.schema_), "text.format's JSON schema", "text.format")

    @property
    def effort(self) -> str | None:
        return EFFORTS[self.reasoning.effort] if self.reasoning and self.reasoning.effort else None

    def to_ask(self, user: User, request_id: str, tools: ToolUse | None) -> Ask:
        self.refuse_unsupported()
        constraint = self.constraint(tools)
        if constraint is not None and self.effort is not None:
            raise ApiError(400, "reasoning.effort cannot be combined with constrained output (text.format or a "
                           "forced tool_choice)", "invalid_value", "reasoning.effort")
        return Ask(user=user, model=self.model, max_tokens=self.max_output_tokens, temperature=self.temperature,
                   top_p=self.top_p, reasoning_effort=self.effort, request_id=request_id, param="input",
                   constraint=constraint, tools=tools)

    def shown(self) -> dict:
        """The request's settings as the response object echoes them."""
        functions, tools = iter(self.function_tools()), []
        for raw in self.tools or []:
            if is_hosted(raw):
                tools.append(shown_tool(raw))
            else:
                t = next(functions)
                tools.append({"type": "function", "name": t.name, "description": t.description,
                              "parameters": t.parameters, "strict": t.strict})
        choice = self.tool_choice or "auto"
        fmt = self.text.format if self.text is not None and self.text.format is not None else None
        return {"max_output_tokens": self.max_output_tokens, "metadata": self.metadata or {},
                "parallel_tool_calls": self.parallel_tool_calls is not False,
                "reasoning": {"effort": self.reasoning.effort if self.reasoning else None, "summary": None},
                "store": self.store, "text": {"format": fmt.shown() if fmt else {"type": "text"}},
                "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
                "tools": tools, "truncation": "disabled", "user": self.user}


class InputItemsQuery(BaseModel):
    """GET /v1/responses/{id}/input_items: a page of the items, newest first unless order is asc."""

    after: str | None = None
    limit: int = Field(default=20, ge=1, le=100)
    order: Literal["asc", "desc"] = "desc"
