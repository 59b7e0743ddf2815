"""Requests in: an HTTP body to the GenerateRequests the replicas run, or a 400 saying why not.

Owns everything between the bytes of a request and its token prompts: the body's size, content
type, UTF-8 and JSON (validated against chunkserve/cluster/protocol.py), the model's name, text
prompts tokenized and chat messages rendered through the model's chat template, token ids and
logit_bias against the vocabulary, the context length, stop strings, logprob entries, structured
outputs' grammars (parsed here, on a pool of their own, so a bad one is a 400), and the
GenerateRequests themselves: n choices, seeds, the router's prefix hashes, and the tenant's cache
salt (chunkserve/cluster/tenants.py). Large work runs off the event loop (OFF_LOOP_SIZE)."""

import asyncio
import dataclasses
import json
import re
import secrets
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from chunkserve.cluster.config import AppConfig
from chunkserve.cluster.errors import APIError
from chunkserve.cluster.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    template_tools,
)
from chunkserve.cluster.tenants import Tenant, cache_salt
from chunkserve.replicas.engine.guided import load_grammar_engine
from chunkserve.replicas.engine.sequence import Tenancy
from chunkserve.replicas.model.tokenizer import PLAIN_TEXT_ROLES
from chunkserve.replicas.wire import GenerateRequest
from chunkserve.router import direct as direct_routes
from chunkserve.router.hashing import cache_seed, chunk_hashes

# The event loop also drives every open stream, so no request may hold it. Bodies (bytes) and text
# (characters) past OFF_LOOP_SIZE are parsed, validated, tokenized and detokenized in worker
# threads, and grammars always are; a thread helps only while the call in it releases the
# interpreter lock. Measured on a 2-core CPU as the longest pause of a 5 ms ticker thread meanwhile:
# tokenizers' encode_batch, which Tokenizer.encode uses for long text, 2 M characters of tiny's in
# 1.3 s with pauses <= 45 ms (encode: one 1.3 s pause); xgrammar's schema parsing, a 270-object
# chain in 2.1 s with pauses <= 8 ms. JSON parsing and pydantic validation hold it: a 9.9 MB text
# body 0.1 s. So what could take longer is refused before any of it runs: text too long for any
# prompt the context takes (check_chars), schemas nested too deep (protocol.MAX_SCHEMA_DEPTH).
OFF_LOOP_SIZE = 16 << 10
GUIDE_DEADLINE_S = 10.0  # a structured output whose grammar takes longer than this to parse is refused


async def off_loop_if(big: bool, fn, *args):
    """fn(*args), in a worker thread when `big` (see OFF_LOOP_SIZE)."""
    return await asyncio.to_thread(fn, *args) if big else fn(*args)


def _check_content_type(request: Request) -> None:
    """415 unless the body is declared JSON (FastAPI's rule: application/json, application/*+json,
    or no Content-Type at all, which is read as JSON)."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media = declared.partition(";")[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise APIError(
        415,
        f"Content-Type {media or declared!r} is not supported: send the body as JSON with "
        "`Content-Type: application/json`",
        code="unsupported_media_type",
    )


# `\uD800`-`\uDFFF` escapes: the only way a strictly decoded UTF-8 body yields a surrogate
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _validate(body: bytes, model: type[BaseModel]) -> BaseModel:
    """The request body as `model`, or an APIError 400 saying what is wrong with it."""
    try:
        text = body.decode("utf-8")  # strict: JSON text is UTF-8 (RFC 8259), encoded surrogates refused
    except UnicodeDecodeError as e:
        raise APIError(
            400, f"the request body is not valid UTF-8 (byte {e.start}: {e.reason})", code="invalid_utf8"
        ) from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested too deep
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if _SURROGATE_ESCAPE.search(text):  # a pair is one character once parsed; a lone half is not text
        where = _lone_surrogate(data)
        if where is not None:
            raise APIError(
                400,
                f"`{'.'.join(map(str, where)) or 'body'}` holds a lone UTF-16 surrogate (an "
                "unpaired \\uD800-\\uDFFF escape): strings must be Unicode text",
                param=str(where[0]) if where else None,
                code="invalid_unicode",
            )
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        where = lambda err: ".".join(map(str, err["loc"])) or "body"  # noqa: E731
        message = "; ".join(f"{where(err)}: {err['msg']}" for err in errors)
        param = str(errors[0]["loc"][0]) if errors[0]["loc"] else None
        raise APIError(400, message, param=param) from None


def _lone_surrogate(data: Any) -> list | None:
    """The path (keys and indices) to a string (or key) of parsed JSON holding a surrogate, or None."""
    stack: list[tuple[list, Any]] = [([], data)]  # (not recursive: the body may nest deep)
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path
        elif isinstance(value, dict):
            for k, v in value.items():
                if _SURROGATE.search(k):
                    return path + [k]
                stack.append((path + [k], v))
        elif isinstance(value, list):
            stack += [(path + [i], v) for i, v in enumerate(value)]
    return None


def check_stop(stop: tuple[str, ...], config: AppConfig) -> None:
    """400 naming the limit when a request's stop strings are more, or longer in all, than the
    config allows (AppConfig.max_stop_strings, max_stop_chars)."""
    if len(stop) > config.max_stop_strings:
        raise APIError(
            400,
            f"{len(stop)} stop strings are more than this server takes: at most "
            f"{config.max_stop_strings} (max_stop_strings)",
            param="stop",
        )
    chars = sum(map(len, stop))
    if chars > config.max_stop_chars:
        raise APIError(
            400,
            f"stop strings of {chars} characters in all are longer than this server takes: at most "
            f"{config.max_stop_chars} characters over all of a request's stop strings (max_stop_chars)",
            param="stop",
        )


def check_logprob_entries(
    body: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]], limits: list[int], most: int
) -> None:
    """400 naming the limit when the response could carry more logprob entries than `most`
    (AppConfig.max_logprob_entries): per choice, k + 1 for each token it asks to generate
    (limits: each prompt's max_tokens; a request that sets none, whose output runs to the end of
    the context, is not refused for it: OpenAI's clients often leave it out, and its entries
    come as its tokens are made) and, with echo and logprobs, for each prompt token."""
    k, k_prompt = body.top_logprobs_wanted, body.prompt_logprobs_wanted
    if k is None and k_prompt is None:
        return
    asked = body.requested_max_tokens if isinstance(body, ChatCompletionRequest) else body.max_tokens
    if asked is None:
        limits = [0] * len(limits)
    entries = body.n * sum(
        (0 if k is None else (k + 1) * most_tokens) + (0 if k_prompt is None else (k_prompt + 1) * len(prompt))
        for prompt, most_tokens in zip(prompts, limits)
    )
    if entries > most:
        echoed = "" if k_prompt is None else " and each echoed prompt token"
        raise APIError(
            400,
            f"this request could return {entries} logprob entries, more than this server sends in one "
            f"response: at most {most} (max_logprob_entries). Per choice ({len(prompts)} prompt(s) x "
            f"n={body.n}), each token's and its {k if k is not None else k_prompt} most likely tokens', "
            f"for each of up to max_tokens={max(limits)} generated tokens{echoed}; lower max_tokens, n, "
            "the logprobs asked for or the prompts sent at once",
            param="top_logprobs" if isinstance(body, ChatCompletionRequest) and body.top_logprobs else "logprobs",
        )


class Prompts:
    """A model's requests checked and made into GenerateRequests (one per ingress replica).
    model_info: the replicas' {"max_model_len", "vocab_size"} (fetched once, by the caller)."""

    def __init__(self, config: AppConfig, tokenizer: Any, model_info: Callable[[], Awaitable[dict]]):
        self.config, self.model_name, self.tokenizer = config, config.model_name, tokenizer
        if tokenizer is not None:  # (structured outputs need one: their grammars parse here)
            load_grammar_engine()
        self._model_info = model_info
        # special tokens' text typed in a text prompt or a user's or tool's message is text (not
        # their ids: a user could forge the template's role markers), unless the operator allows it
        self._split_special_tokens = not config.allow_special_tokens_in_prompt
        # grammars parse on threads of their own, two at a time: a burst of schemas queues there,
        # not in front of the tokenizing in asyncio's default pool
        self._grammars = ThreadPoolExecutor(max_workers=2, thread_name_prefix="chunkserve-grammar")

    async def parse(self, request: Request, model: type[BaseModel]) -> BaseModel:
        _check_content_type(request)
        limit = self.config.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(
                413, f"request body of {declared} bytes exceeds the limit of {limit}", code="request_too_large"
            )
        body = bytearray()
        async for piece in request.stream():  # a missing or false Content-Length still stops at the limit
            body += piece
            if len(body) > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        return await off_loop_if(len(body) > OFF_LOOP_SIZE, _validate, bytes(body), model)

    def check_model(self, model: str | None) -> None:
        """404 unless `model` names the served model (None: left out where it may be, /tokenize's
        and /detokenize's as in vLLM; the completions' schemas require it, as OpenAI's API does)."""
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                param="model",
                code="model_not_found",
            )

    async def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        """The body's prompts as token ids (texts tokenized, ids checked against the vocabulary)."""
        sent = body.prompts
        if isinstance(sent[0], str):
            await self.check_chars(max(map(len, sent)), "prompt")
            encode, split = self.tokenizer_for("text prompts").encode, self._split_special_tokens
            return await off_loop_if(
                sum(map(len, sent)) > OFF_LOOP_SIZE, lambda: [encode(p, split_special_tokens=split) for p in sent]
            )
        vocab = (await self._model_info())["vocab_size"]
        for prompt in sent:
            bad = None if 0 <= min(prompt) and max(prompt) < vocab else next(t for t in prompt if not 0 <= t < vocab)
            if bad is not None:
                raise APIError(400, f"token id {bad} is out of range [0, {vocab})", param="prompt")
        return [list(p) for p in sent]

    def echo_hidden(self, sent: str | list[int], prompt: list[int]) -> frozenset[int]:
        """Positions of the prompt's tokens whose text its echo does not show: of a text prompt
        the special tokens the tokenizer added (every special one: typed ones are text; with
        allow_special_tokens_in_prompt, an added BOS only), of an id prompt every special token
        (its echo is decoded without them)."""
        tok = self.tokenizer
        if tok is None:
            return frozenset()
        if isinstance(sent, str) and not self._split_special_tokens:
            added_bos = prompt[:1] == [tok.bos_token_id] and not sent.startswith(tok.bos_token or "")
            return frozenset({0}) if added_bos else frozenset()
        return frozenset(i for i, t in enumerate(prompt) if t in tok.special_ids)

    def echo_text(self, sent: str | list[int], prompt: list[int]) -> str:
        """A prompt as echoed: as sent, or its token ids decoded ("" without a tokenizer)."""
        if isinstance(sent, str):
            return sent
        return "" if self.tokenizer is None else self.tokenizer.decode(prompt)

    def hidden_ids(self, body: CompletionRequest) -> frozenset[int]:
        """The generated ids whose text a completion's choices skip (its special tokens, unless asked)."""
        tok = self.tokenizer
        return tok.special_ids if tok is not None and body.skip_special_tokens else frozenset()

    async def text_prompt(self, text: str, add_special_tokens: bool) -> list[int]:
        """/tokenize's text prompt as token ids."""
        await self.check_chars(len(text), "prompt")
        return await off_loop_if(
            len(text) > OFF_LOOP_SIZE,
            self.tokenizer_for("text prompts").encode,
            text,
            add_special_tokens,
            self._split_special_tokens,
        )

    async def token_text(self, tokens: list[int]) -> str:
        """/detokenize's token ids as text; 400 for an id past the vocabulary."""
        vocab = (await self._model_info())["vocab_size"]
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of range [0, {vocab})", param="tokens")
        tokenizer = self.tokenizer_for("token texts")
        return await off_loop_if(len(tokens) > OFF_LOOP_SIZE, tokenizer.decode, tokens)

    async def chat_prompt(self, body: ChatCompletionRequest | TokenizeRequest) -> list[int]:
        """_render_chat, in a worker thread when the messages are long."""
        chars = sum(len(m.text()) for m in body.messages)
        await self.check_chars(chars, "messages")
        return await off_loop_if(chars > OFF_LOOP_SIZE, self._render_chat, body)

    async def check_chars(self, chars: int, param: str) -> None:
        """400 before tokenizing text of `chars` characters that no prompt the context takes is as
        long as: a token is at most the tokenizer's max_token_chars characters, so text has at
        least chars / max_token_chars tokens (allowed twice that: a normalizer may fold characters
        together, as NFC does an accent into its letter)."""
        if self.tokenizer is None:
            return  # (text is refused: tokenizer_for)
        max_len = (await self._model_info())["max_model_len"]
        limit = 2 * max_len * self.tokenizer.max_token_chars
        if chars > limit:
            raise APIError(
                400,
                f"this model's maximum context length is {max_len} tokens, and {param} of {chars} "
                f"characters is longer than any text that fits (at most {limit}); shorten it",
                param=param,
                code="context_length_exceeded",
            )

    def _render_chat(self, body: ChatCompletionRequest | TokenizeRequest) -> list[int]:
        tokenizer = self.tokenizer_for("chat")
        try:
            messages = [m.for_template() for m in body.messages]
            return tokenizer.encode_chat(
                messages,
                add_generation_prompt=True,
                tools=template_tools(body.tools),
                plain_roles=PLAIN_TEXT_ROLES if self._split_special_tokens else (),
            )
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None

    def tokenizer_for(self, what: str):
        if self.tokenizer is None:
            raise APIError(400, f"{what} need a tokenizer and model `{self.model_name}` has none: send token ids")
        return self.tokenizer

    async def check_logit_bias(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """400 when the body's logit_bias names a token past the vocabulary."""
        if body.logit_bias:
            vocab = (await self._model_info())["vocab_size"]
            bad = [t for t in body.logit_bias if int(t) >= vocab]
            if bad:
                raise APIError(400, f"logit_bias token id {bad[0]} is out of range [0, {vocab})", param="logit_bias")

    async def check_guide(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """400 when the body's structured output does not parse (a schema xgrammar cannot take, a
        bad regex or grammar), or the model has no tokenizer to guide text with."""
        guide = body.guide
        if guide is None:
            return
        self.tokenizer_for("structured outputs")
        parsed = asyncio.get_running_loop().run_in_executor(self._grammars, guide.grammar)
        try:
            await asyncio.wait_for(parsed, GUIDE_DEADLINE_S)  # (on time out, a parse not begun is dropped)
        except ValueError as e:
            raise APIError(400, str(e), param=body.guide_field) from None
        except TimeoutError:
            raise APIError(
                400,
                f"{body.guide_field}: its grammar took more than {GUIDE_DEADLINE_S:g} s to compile; simplify it",
                param=body.guide_field,
            ) from None

    async def check_length(self, prompt: list[int], max_tokens: int | None, param: str) -> int:
        """-> max_tokens (None: the rest of the context); 400 when prompt + max_tokens exceed it."""
        max_len = (await self._model_info())["max_model_len"]
        wanted = max(max_len - len(prompt), 1) if max_tokens is None else max_tokens
        if len(prompt) + wanted > max_len:
            raise APIError(
                400,
                f"this model's maximum context length is {max_len} tokens, but "
                f"{len(prompt) + wanted} were requested ({len(prompt)} in the prompt, {wanted} for "
                "the completion); shorten the prompt or lower the completion's length",
                param=param if max_tokens is not None else None,
                code="context_length_exceeded",
            )
        return wanted

    def generate_request(
        self,
        kind: str,
        prompts: list[list[int]],
        limits: list[int],
        body: CompletionRequest | ChatCompletionRequest,
        tenant: Tenant,
        think: tuple[int | None, int] | None = None,
        session: int | None = None,
    ) -> tuple[str, list[GenerateRequest]]:
        """-> (the response's id, one generate request per choice: prompt after prompt, each
        with its n choices); limits: each prompt's max_tokens; think: SamplingParams.think.
        The tenant's cache policy and the body's cache_salt make the salt its prompts' chunks
        are hashed (for the router) and cached (in the engine) under; session: the router's
        session hint (tenants.session_key)."""
        if body.stop_strings and self.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer; use stop_token_ids", param="stop")
        check_logprob_entries(body, prompts, limits, self.config.max_logprob_entries)
        if body.min_tokens > min(limits):  # (max_tokens: the request's, or what the context leaves)
            raise APIError(
                400,
                f"min_tokens={body.min_tokens} is more than the {min(limits)} tokens this completion may have",
                param="min_tokens",
            )
        # n choices: n requests with the same prompt and hashes (so the router sends them to the
        # replica that holds it, whose prefix tree stores it once), ids <id>-<k> (k = prompt * n +
        # choice), choice i seeded seed + i (unseeded choices get a random seed: the engine's own
        # keys come from its seed and the request's arrival, alike on every replica, so choices on
        # two replicas could draw alike)
        rid = f"{kind}-{uuid.uuid4().hex}"
        stop = body.stop_strings  # (one tuple for all: each call pickles it, the replica keeps one copy)
        seed = None if body.n == 1 or body.seed is not None else secrets.randbits(64)
        one = len(prompts) == 1 and body.n == 1
        salt = cache_salt(tenant, body.cache_salt)
        tenancy, seed_of_chain = Tenancy(tenant.name, salt, tenant.priority), cache_seed(self.model_name, salt)
        reqs = []
        for p, (prompt, max_tokens) in enumerate(zip(prompts, limits)):
            # the router's key (DESIGN §3): hashed once here; the router also reads the prompt's
            # length and params.max_tokens from this request
            hashes = tuple(
                chunk_hashes(prompt, self.config.engine.chunk_size, self.config.router.route_chunks, seed_of_chain)
            )
            params = [body.sampling_params(max_tokens, i, seed) for i in range(body.n)]
            if think is not None:
                params = [dataclasses.replace(one_params, think=think) for one_params in params]
            reqs += [
                GenerateRequest(
                    request_id=rid if one else f"{rid}-{p * body.n + i}",
                    prompt_token_ids=tuple(prompt),
                    params=params[i],
                    stop=stop,
                    model=self.model_name,
                    prefix_hashes=hashes,
                    skip_special_tokens=body.skip_special_tokens,
                    include_stop_str_in_output=body.include_stop_str_in_output,
                    tenancy=tenancy,
                    session=session,
                    router=direct_routes.ROUTER_ID,
                )
                for i in range(body.n)
            ]
        return rid, reqs
