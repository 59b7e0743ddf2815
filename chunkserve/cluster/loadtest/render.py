"""Workload specs -> the requests a client sends: token ids, or real text where the server has a tokenizer.

- tokens: each piece is `length` ids drawn from `token_range` by a generator seeded with the
  run's seed and the piece's key (pieces with one key get the same ids; a shorter one the first
  of them: a trace's partial last block). Sent to /v1/completions as a prompt of ids; a chat
  spec's turns are concatenated.
- text: each piece is real text of about `length` tokens of the served model: one /tokenize of
  a seeded corpus of English words, then per distinct piece a run of its tokens (at an offset
  of the piece key's own; a shorter piece of one key the first of those tokens) turned back
  into text by /detokenize. Chat specs go to
  /v1/chat/completions as messages, others as text prompts.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import httpx

from chunkserve.cluster.loadtest.workloads import Piece, Spec

FORMATS = ("auto", "text", "tokens")
ENDPOINTS = ("auto", "completions", "chat")

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there been one all we their has would when if so no will more can who out about time what "
    "up some into them other its only new could then these two may first any like now over such our man also did "
    "many before must through years where much your way well down should because each just those people how too "
    "little state good very make world still see own men work long here get both between life being under never "
    "day same another know while last might us great old year off come since against go came right used take three "
    "system model request server cache prefix token replica tenant session answer question tool schema example "
    "function value table record order account report data query result error field number name list item"
).split()


def corpus(seed: int, chars: int) -> str:
    """Seeded English-looking text of about `chars` characters: sentences of common words."""
    rng = random.Random(f"corpus/{seed}")
    out, n = [], 0
    while n < chars:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 18))]
        sentence = " ".join(words).capitalize() + rng.choice((". ", ". ", ". ", "? ", "! ", ".\n"))
        out.append(sentence)
        n += len(sentence)
    return "".join(out)


@dataclass(frozen=True)
class Request:
    """What the client sends for one spec: a prompt (ids or text) or chat messages."""

    index: int
    max_tokens: int
    prompt: list[int] | str | None = None
    messages: list[dict] | None = None
    tenant: str | None = None
    session: int | None = None
    after: int | None = None

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.messages is not None else "/v1/completions"


class Renderer:
    """Renders specs in one format; text needs `await prepare(...)` against the server first."""

    def __init__(self, fmt: str, seed: int = 0, token_range: tuple[int, int] = (32, 127), endpoint: str = "auto"):
        if fmt not in ("text", "tokens"):
            raise ValueError(f"format must be text or tokens, got {fmt!r}")
        lo, hi = token_range
        if not 0 <= lo < hi:
            raise ValueError(f"token range must satisfy 0 <= lo < hi, got {token_range}")
        if endpoint == "chat" and fmt == "tokens":
            raise ValueError("the chat endpoint takes text: use the text prompt format")
        self.fmt, self.seed, self.token_range, self.endpoint = fmt, seed, token_range, endpoint
        self._texts: dict[tuple[str, int], str] = {}  # text format: each (piece key, length)'s text
        self._ids: dict[str, list[int]] = {}  # each piece key's ids, as many as its longest piece's

    def ids(self, piece: Piece) -> list[int]:
        got = self._ids.get(piece.key)
        if got is None or len(got) < piece.length:
            rng = random.Random(f"{self.seed}/{piece.key}")
            lo, hi = self.token_range
            got = self._ids[piece.key] = [rng.randrange(lo, hi) for _ in range(piece.length)]
        return got[: piece.length]

    async def prepare(
        self,
        client: httpx.AsyncClient,
        url: str,
        specs: list[Spec],
        headers: dict[str, str],
        model: str | None = None,
        concurrency: int = 16,
    ) -> None:
        """Text format: make every distinct piece's text with the server's tokenizer (see above)."""
        if self.fmt != "text":
            return
        pieces = sorted(
            {(p.key, p.length) for s in specs for _, content in s.turns for p in content if isinstance(p, Piece)}
        )
        if not pieces:
            return
        keys = sorted({key for key, _ in pieces})
        need = max(length for _, length in pieces) + len(keys)
        ids: list[int] = []
        chars = 16 * need
        while len(ids) < need and chars < 64 * need:  # (a tokenizer of many characters a token)
            body = {
                "prompt": corpus(self.seed, chars),
                "add_special_tokens": False,
                **({"model": model} if model else {}),
            }
            ids = await _post(client, url, "/tokenize", body, headers, "tokens")
            chars *= 4
        rng = random.Random(f"offsets/{self.seed}")
        # distinct keys start at distinct places (pieces of equal start would share a prefix)
        starts = dict(
            zip(
                keys,
                rng.sample(range(len(ids)), len(keys))
                if len(keys) <= len(ids)
                else [rng.randrange(len(ids)) for _ in keys],
            )
        )
        sem = asyncio.Semaphore(concurrency)

        async def one(key: str, length: int) -> None:
            run = [ids[(starts[key] + i) % len(ids)] for i in range(length)]
            async with sem:
                self._texts[key, length] = await _post(
                    client,
                    url,
                    "/detokenize",
                    {"tokens": run, **({"model": model} if model else {})},
                    headers,
                    "prompt",
                )

        await asyncio.gather(*(one(key, length) for key, length in pieces))

    def request(self, spec: Spec) -> Request:
        labels = dict(
            index=spec.index, max_tokens=spec.max_tokens, tenant=spec.tenant, session=spec.session, after=spec.after
        )
        items = [x for _, content in spec.turns for x in content]
        as_ids = self.fmt == "tokens" and all(isinstance(x, Piece) for x in items)
        if as_ids or any(isinstance(x, tuple) for x in items):
            ids: list[int] = []  # (a trace's token-id prompt, or pieces as ids: a chat's turns concatenated)
            for x in items:
                ids += self.ids(x) if isinstance(x, Piece) else list(x)
            return Request(prompt=ids, **labels)
        chat = (
            spec.chat
            if spec.chat is not None
            else (self.endpoint == "chat" or (self.endpoint == "auto" and len(spec.turns) > 1))
        )
        if chat:
            messages = [{"role": role, "content": "".join(map(self._text, content))} for role, content in spec.turns]
            return Request(messages=messages, **labels)
        return Request(prompt="".join(map(self._text, items)), **labels)

    def _text(self, x: Piece | str) -> str:
        if isinstance(x, str):
            return x
        if (x.key, x.length) not in self._texts:
            raise RuntimeError("text prompts need Renderer.prepare against the server first")
        return self._texts[x.key, x.length]


async def _post(client: httpx.AsyncClient, url: str, path: str, body: dict, headers: dict[str, str], field: str):
    r = await client.post(url + path, json=body, headers=headers)
    if r.status_code != 200:
        raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:300]}")
    return r.json()[field]


async def server_has_tokenizer(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], model: str | None = None
) -> bool:
    """Whether the server tokenizes text (its /tokenize answers a probe): auto picks text then."""
    try:
        r = await client.post(
            url + "/tokenize", json={"prompt": "probe", **({"model": model} if model else {})}, headers=headers
        )
    except httpx.HTTPError:
        return False
    return r.status_code == 200
