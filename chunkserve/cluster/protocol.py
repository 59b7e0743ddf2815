"""OpenAI-compatible HTTP schemas (the ingress's calls to a replica: chunkserve/replicas/wire.py).

Requests validate strictly (a string where a number belongs is a 400, not a coercion) but ignore
fields they do not know, as vLLM does, so clients that send newer OpenAI fields keep working.
Known fields whose non-default values we cannot honour (best_of, suffix, functions, ...) are a 400
naming the field rather than a silently different answer.

Structured outputs come in OpenAI's form (`response_format`: json_object, json_schema) and vLLM's
(`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, or `structured_outputs` with
json / regex / choice / grammar / json_object): at most one of them per request, as a
chunkserve.replicas.engine.guided.Guide in the sampling params. Chat's `tools` / `tool_choice` (cluster/tool_calls.py)
make one too where the calls are forced (`required`, a named function).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from chunkserve.cluster.tool_calls import tool_guide
from chunkserve.replicas.engine.guided import Guide
from chunkserve.replicas.engine.sequence import MAX_LOGPROBS, SEED_RANGE, SamplingParams
from chunkserve.replicas.wire import GenerateOutput

# -- requests --------------------------------------------------------------------------------

MAX_STOP_TOKEN_IDS = 4096
MAX_LOGIT_BIAS = 1024  # tokens a request may bias
MAX_N = 16  # choices a request may ask for
MAX_PROMPTS = 256  # prompts one /v1/completions request may batch
MAX_TOOLS = 128  # functions one chat request may offer (OpenAI's limit)
# JSON schemas (structured outputs, tools' parameters) nested deeper than this, counting every
# object and array of the schema's JSON, are refused: grammar compilation grows about cubically
# with depth (a chain of 270 objects, depth 541: 2.1 s to parse on a 2-core CPU; of 63, depth 127: 0.03 s)
MAX_SCHEMA_DEPTH = 128


class _NullMeansDefault(BaseModel):
    """An explicit null for a field with a non-null default means that default, as OpenAI's API
    and vLLM take it (openai-python sends null for arguments passed as None). Except max_tokens:
    null there is no limit but the context's, as in vLLM."""

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            fields = cls.model_fields
            return {
                k: v
                for k, v in data.items()
                if v is not None
                or k not in fields
                or fields[k].is_required()
                or fields[k].default is None
                or k == "max_tokens"
            }
        return data


class StreamOptions(_NullMeansDefault):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False  # one last chunk with `usage` and no choices


class JsonSchemaFormat(BaseModel):
    """response_format's json_schema: the schema the output follows (none: any JSON object)."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (free), json_object (any JSON object), json_schema."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs `json_schema`")
        return self


class StructuredOutputs(_NullMeansDefault):
    """vLLM's structured_outputs: one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(strict=True, extra="ignore")
    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    structural_tag: Any = None
    whitespace_pattern: Any = None

    @field_validator("structural_tag", "whitespace_pattern")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(f"{info.field_name} is not supported")
        return value


class _SamplingRequest(_NullMeansDefault):
    """Fields common to /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(strict=True, extra="ignore")
    # field -> the values that mean "feature off"; anything else is refused
    NEUTRAL: ClassVar[dict[str, tuple]] = {
        # vLLM's extension we do not implement: its non-default values would change the answer
        "guided_whitespace_pattern": (None,),
    }
    # the structured-output fields, of which a request may give one
    GUIDES: ClassVar[tuple[str, ...]] = (
        "response_format",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
    )

    model: str  # the served model's name (/v1/models): required, as in OpenAI's API
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)  # extension; -1 or 0: whole vocabulary
    n: int = Field(1, ge=1, le=MAX_N)  # choices: n requests with the same prompt (the prefix tree holds it once)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)  # extension
    seed: int | None = Field(None, ge=SEED_RANGE.start, lt=SEED_RANGE.stop)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension
    return_token_ids: bool = False  # extension (as vLLM): token ids beside the text
    user: str | None = None  # accepted, unused (OpenAI's end-user id): it isolates nothing, cache_salt does
    # vLLM's: prompts share cached chunks only with requests of the same salt (and the tenant's
    # cache policy: chunkserve/cluster/tenants.py), so another client cannot time whether they are cached
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=100)  # extension (vLLM)
    min_p: float = Field(0.0, ge=0, le=1)  # extension (vLLM)
    logit_bias: dict[str, float] | None = Field(
        None, max_length=MAX_LOGIT_BIAS
    )  # token id (a string, as JSON keys are) -> bias
    min_tokens: int = Field(0, ge=0)  # extension (vLLM): no stop before this many tokens
    include_stop_str_in_output: bool = False  # extension (vLLM): the text ends after the stop string
    skip_special_tokens: bool = True  # extension (vLLM): False renders special tokens in the text
    # structured outputs (see the module's docstring)
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None  # extension (vLLM): a JSON schema
    guided_regex: str | None = None  # extension (vLLM)
    guided_choice: list[str] | None = None  # extension (vLLM)
    guided_grammar: str | None = None  # extension (vLLM): EBNF, rule `root`
    structured_outputs: StructuredOutputs | None = None  # extension (vLLM)
    guided_whitespace_pattern: Any = None
    _guide: Guide | None = PrivateAttr(None)  # of the structured-output field given (_one_guide)
    _guide_field: str | None = PrivateAttr(None)  # that field's name

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        # (how many, and how long in all: the server's limits, checked by the ingress)
        if stop is not None and any(s == "" for s in ([stop] if isinstance(stop, str) else stop)):
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for token, value in (bias or {}).items():
            if not (token.isascii() and token.isdigit()):
                raise ValueError(f"logit_bias keys are token ids, got {token!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias values are in [-100, 100], got {value!r} for token {token}")
        return bias

    @field_validator("stream_options")
    @classmethod
    def _stream_options_with_stream(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream", False):  # `stream` is declared (validated) first
            raise ValueError("stream_options is only allowed with stream=true")  # as OpenAI and vLLM
        return options

    @field_validator("*", mode="after")
    @classmethod
    def _neutral(cls, value: Any, info: ValidationInfo) -> Any:
        allowed = cls.NEUTRAL.get(info.field_name)
        if allowed is not None and value not in allowed:
            raise ValueError(f"{info.field_name}={value!r} is not supported")
        return value

    @field_validator(*GUIDES)
    @classmethod
    def _well_formed_guide(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            _make_guide(info.field_name, value)  # (ValueError: the 400 names the field)
        return value

    @model_validator(mode="after")
    def _one_guide(self) -> _SamplingRequest:
        given = [name for name in self.GUIDES if _make_guide(name, getattr(self, name)) is not None]
        if len(given) > 1:
            raise ValueError(f"at most one of {', '.join(self.GUIDES)} may be given, got {', '.join(given)}")
        if given:
            self._guide_field, self._guide = given[0], _make_guide(given[0], getattr(self, given[0]))
            if self.min_tokens:  # (a grammar that has ended allows only the EOS min_tokens holds off)
                raise ValueError(f"min_tokens cannot be combined with {given[0]}")
        return self

    @property
    def guide(self) -> Guide | None:
        """SamplingParams.guided: the request's structured output, if any."""
        return self._guide

    @property
    def guide_field(self) -> str | None:
        """The structured-output field the request gave, if any (errors name it)."""
        return self._guide_field

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def top_logprobs_wanted(self) -> int | None:
        """SamplingParams.logprobs: the most likely tokens' logprobs wanted per token (0: only the
        drawn one's), None: no logprobs."""
        return None

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        """SamplingParams.prompt_logprobs: the same for each prompt token (None: not wanted)."""
        return None

    def sampling_params(self, max_tokens: int, choice: int = 0, seed: int | None = None) -> SamplingParams:
        """The params of choice `choice` (0 .. n - 1): choice i draws with seed + i, the seed the
        request's, else `seed` (None: the engine keys it)."""
        base = self.seed if self.seed is not None else seed
        seed = None if base is None else base if choice == 0 else (base + choice) % 2**64
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_p=self.min_p,
            logit_bias={int(t): b for t, b in (self.logit_bias or {}).items()},
            min_tokens=self.min_tokens,
            logprobs=self.top_logprobs_wanted,
            guided=self.guide,
        )


def _choice_text(choice: Any) -> str:
    return f"{{function: {choice.function.name}}}" if isinstance(choice, NamedToolChoice) else str(choice)


def _make_guide(name: str, value: Any) -> Guide | None:
    """The Guide of structured-output field `name` given `value` (None: none asked for; ValueError:
    malformed; whether a schema, regex or grammar parses is checked against the grammar engine
    later: Guide.grammar)."""
    if value is None:
        return None
    if name == "response_format":
        if value.type == "text":
            return None
        schema = value.json_schema.json_schema if value.type == "json_schema" else None
        return Guide("json_object") if schema is None else _guide("json", schema)
    if name == "structured_outputs":
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(value, k) is not None]
        if value.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object")
        kind = given[0].rstrip("_")
        spec = getattr(value, given[0]) if kind != "json_object" else ""
        return _guide(kind, spec, not value.disable_any_whitespace)
    return _guide(name.removeprefix("guided_"), value)


def _guide(kind: str, spec: Any, any_whitespace: bool = True) -> Guide:
    """A Guide from vLLM's forms: a JSON schema as a dict or its text, choices as a list."""
    if kind == "json" and isinstance(spec, dict):
        check_schema_depth(spec)
        spec = json.dumps(spec)
    elif kind == "json" and isinstance(spec, str):
        try:
            check_schema_depth(json.loads(spec))
        except (json.JSONDecodeError, RecursionError):
            pass  # (not JSON: the grammar engine says so, Guide.grammar)
    return Guide(kind, tuple(spec) if kind == "choice" else spec, any_whitespace)


def check_schema_depth(schema: Any) -> None:
    """ValueError when a JSON schema nests deeper than MAX_SCHEMA_DEPTH objects and arrays."""
    level, depth = [schema] if isinstance(schema, (dict, list)) else [], 0
    while level:  # the containers of one depth (breadth first: no recursion however deep)
        depth += 1
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the JSON schema nests more than {MAX_SCHEMA_DEPTH} objects and arrays deep")
        level = [
            v
            for node in level
            for v in (node.values() if isinstance(node, dict) else node)
            if isinstance(v, (dict, list))
        ]


def _prompt_form(prompt: Any) -> str:
    """Which of the prompt's forms a value is, from its first element: only that form is
    validated (the union tried every form, and a form that fails collects an error per element:
    a 3 M id prompt took 3 s)."""
    if not isinstance(prompt, list) or not prompt:
        return "text" if isinstance(prompt, str) or not isinstance(prompt, list) else "ids"
    return "texts" if isinstance(prompt[0], str) else "batch" if isinstance(prompt[0], list) else "ids"


class CompletionRequest(_SamplingRequest):
    NEUTRAL: ClassVar[dict[str, tuple]] = {
        **_SamplingRequest.NEUTRAL,
        "suffix": (None, ""),
        "best_of": (None, 1),
    }

    # text, [texts], token ids, or [token id lists]: a list is a batch of prompts, each with its n
    # choices (choice index: prompt * n + choice)
    prompt: Annotated[
        Annotated[str, Tag("text")]
        | Annotated[list[str], Tag("texts")]
        | Annotated[list[int], Tag("ids")]
        | Annotated[list[list[int]], Tag("batch")],
        Discriminator(_prompt_form),
    ]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    # each token's logprob and the logprobs most likely tokens' (OpenAI allows 5, vLLM 20)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt tokens' too)
    suffix: Any = None
    best_of: Any = None

    @property
    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        return self.logprobs if self.echo else None  # the prompt's logprobs too (its whole prompt computed)

    def sampling_params(self, max_tokens: int, choice: int = 0, seed: int | None = None) -> SamplingParams:
        params = super().sampling_params(max_tokens, choice, seed)
        if self.prompt_logprobs_wanted is not None:
            params = dataclasses.replace(params, prompt_logprobs=self.prompt_logprobs_wanted)
        return params

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt):
        if isinstance(prompt, list):
            if len(prompt) == 0:
                raise ValueError("prompt must not be empty")
            if isinstance(prompt[0], (str, list)) and len(prompt) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
            if isinstance(prompt[0], list) and any(len(p) == 0 for p in prompt):
                raise ValueError("prompt must not be empty")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts (a batch: OpenAI's list of texts or of token id lists)."""
        p = self.prompt
        return list(p) if isinstance(p, list) and isinstance(p[0], (str, list)) else [p]


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: str | None = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, kind: str) -> str:
        if kind != "text":
            raise ValueError(f"content parts of type {kind!r} are not supported (only 'text')")
        return kind


class FunctionCallIn(BaseModel):
    """A function call an earlier assistant turn made: `arguments` is JSON text, as OpenAI sends it."""

    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str


class ToolCallIn(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str  # the chat template decides which roles it knows
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text or "" for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (as vLLM and transformers pass it): role and
        content text, and the tool fields given, a call's arguments parsed to an object (the form
        the templates of tool-calling models render with `tojson`)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        out |= {k: getattr(self, k) for k in ("tool_call_id", "name") if getattr(self, k) is not None}
        return out


def template_tools(tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    """Tools as chat templates take them (transformers' `tools`: OpenAI's tool objects)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"a tool call's arguments must be JSON text, got {text[:80]!r}") from None


class FunctionDefinition(BaseModel):
    """A tool the model may call: `parameters` is a JSON schema of its arguments (none: any object)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _bounded(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        if parameters is not None:
            check_schema_depth(parameters)
        return parameters


class ChatTool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    """tool_choice naming the one function the model must call."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    NEUTRAL: ClassVar[dict[str, tuple]] = {
        **_SamplingRequest.NEUTRAL,
        "functions": (None, []),
        "function_call": (None, "none", "auto"),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # newer name of max_tokens; wins over it
    max_tokens: int | None = Field(None, ge=1)  # None: the rest of the context
    logprobs: bool = False  # each token's logprob
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # and the most likely tokens' (needs logprobs)
    # tool calling (chunkserve/cluster/tool_calls.py): the functions the model may call, and whether it must
    # (`required`: one or more of them, or the one named) or may (`auto`, the default with tools:
    # the server's tool_call_parser finds calls in its text)
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # `required`: more than one call allowed
    functions: Any = None  # the deprecated form of tools
    function_call: Any = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:  # as OpenAI and vLLM
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    @model_validator(mode="after")
    def _tool_choice_with_its_tools(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            raise ValueError("tools must have distinct function names")
        choice = self.tool_choice
        if self.forced_tool_calls and not names:
            raise ValueError(f"tool_choice={_choice_text(choice)} needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not in tools")
        if self.forced_tool_calls:
            if self.guide is not None:
                raise ValueError(f"tool_choice={_choice_text(choice)} cannot be combined with {self.guide_field}")
            if self.min_tokens:
                raise ValueError(f"min_tokens cannot be combined with tool_choice={_choice_text(choice)}")
            self._guide, self._guide_field = tool_guide(self.tools, choice, self.parallel_tool_calls), "tools"
        return self

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """tool_choice, its default filled in: `auto` when tools are given, else `none` (OpenAI's);
        `none` without tools whatever it says (no text is read as calls of no tools)."""
        if not self.tools:
            return "none"
        return "auto" if self.tool_choice is None else self.tool_choice

    @property
    def forced_tool_calls(self) -> bool:
        """The output must be tool calls (`required` or a named function): a guide makes it one."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_NullMeansDefault):
    """vLLM's POST /tokenize: a prompt's token ids, or a chat's as its template renders them."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True  # (a prompt's: BOS; a chat's template holds its own)
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)  # a chat's tools, as the template renders them

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        return self


class DetokenizeRequest(_NullMeansDefault):
    """vLLM's POST /detokenize: token ids' text."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int]


# -- responses -------------------------------------------------------------------------------


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the replica's prefix tree (both tiers)
    # ours, not OpenAI's: of cached_tokens, those whose KV was copied back from the replica's host
    # tier (engine.host_cache_tokens) rather than found in GPU memory
    cached_tokens_host: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, lasts: list[GenerateOutput], n: int = 1) -> Usage:
        """From each choice's latest output (n choices a prompt, prompt after prompt): each prompt
        counted once (its first choice's, cached tokens too), the completions' tokens summed, as
        OpenAI counts n choices and batched prompts."""
        firsts, completion = lasts[::n], sum(o.completion_tokens for o in lasts)
        prompt = sum(o.prompt_tokens for o in firsts)
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=sum(o.cached_tokens for o in firsts),
                cached_tokens_host=sum(o.cached_tokens_host for o in firsts),
            ),
        )


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class CompletionLogprobs(BaseModel):
    """/v1/completions' per-token logprobs (OpenAI's legacy form)."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []  # (None: an echoed prompt's first token)
    top_logprobs: list[dict[str, float] | None] = []  # per token: the most likely tokens' text -> logprob
    text_offset: list[int] = []  # each token's first character in the choice's text


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None
    token_ids: list[int] | None = None  # with return_token_ids
    prompt_token_ids: list[int] | None = None  # with return_token_ids, non-streaming


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # streaming: only on the include_usage chunk


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatChoiceMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: the turn is tool calls (or thinking) only
    # a reasoning model's thinking (AppConfig.reasoning_parser), absent when there is none (vLLM's)
    reasoning_content: str | None = Field(None, exclude_if=lambda text: text is None)
    # as OpenAI's: absent when there are none
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=lambda calls: calls is None)


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatChoiceMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    # {"role": "assistant", "content": ""} first, then {"content": ...}, last {}; thinking comes as
    # {"reasoning_content": ...} (chunkserve/cluster/reasoning.py), tool calls as
    # {"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}, a call's later
    # deltas with its index and more of its arguments' text only (chunkserve/cluster/tool_calls.py)
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "chunkserve"
    root: str  # what was loaded: preset name or directory
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str  # invalid_request_error | authentication_error | not_found_error | server_error | ...
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
