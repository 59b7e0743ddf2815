"""Tokenizer (HF tokenizer.json or the presets' byte-level one), chat templates, streaming detokenizer.

Both kinds run on the `tokenizers` library, so special-token splitting, skipping and lossy UTF-8
decoding behave the same way. Chat prompts follow HF/vLLM: the template already contains any BOS,
so render with `apply_chat_template` and encode with `add_special_tokens=False`.
"""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from chunkserve.replicas.model.config import read_json

LONG_TEXT = 4096  # characters past which encode() lets other threads run (see Tokenizer.encode)
# the roles whose content is the user's (or a tool's) text: special tokens' text in it is text
PLAIN_TEXT_ROLES = ("user", "tool")
BYTE_SPECIALS = ("<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")  # ids 256..261
# Tools in a system turn and calls as Hermes' <tool_call> blocks (chunkserve/cluster/tool_calls.py's `hermes`
# parser reads them back); a tool's answer is a user turn in <tool_response>.
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    '<|system|>You may call these functions, each as <tool_call>{"name": ..., "arguments": {...}}</tool_call>:'
    "{% for t in tools %}{{ '\\n' }}{{ (t['function'] if t['function'] is defined else t) | tojson }}{% endfor %}<|end|>"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role ' ~ m['role']) }}"
    "{% endif %}"
    "{% if m['role'] == 'tool' %}"
    "<|user|><tool_response>{{ m['content'] }}</tool_response><|end|>"
    "{% else %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}"
    "<tool_call>{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor %}"
    "<|end|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class Tokenizer:
    """encode/decode/apply_chat_template over a `tokenizers` backend; `eos_token_ids` are the ids
    that end generation, `vocab_size` counts the ids it knows (a model's vocabulary may be larger)."""

    def __init__(
        self, backend: _Backend, *, bos_token: str | None, eos_tokens: tuple[str, ...], chat_template: str | None
    ):
        self._backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.bos_token_id = None if bos_token is None else self._token_id(bos_token)
        self.eos_token_ids: tuple[int, ...] = tuple(self._token_id(t) for t in eos_tokens)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template  # the Jinja source
        self._template = None if chat_template is None else _compile_template(chat_template)
        added = backend.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)  # (decode skips their text)
        specials = sorted(
            (t.content for t in added.values() if t.special), key=len, reverse=True
        )  # (longest first: the one matched where two start alike)
        self._special_text = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._plain: _Backend | None = None  # the backend reading special tokens' text as text (_plain_backend)
        # the most characters one token stands for (a byte-level token's, in bytes: at least its characters)
        self.max_token_chars = max(map(len, backend.get_vocab(with_added_tokens=True)), default=1)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """tokenizer.json (its post-processor decides which special tokens encode() adds; like
        transformers 5, add_bos_token/add_eos_token in tokenizer_config.json do not override it),
        tokenizer_config.json (bos/eos tokens, chat_template), chat_template.jinja (preferred)."""
        path = Path(path)
        try:
            backend = _Backend.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the Rust side raises a bare Exception for unreadable files
            raise ValueError(f"cannot load {path / 'tokenizer.json'}: {e}") from e
        cfg = read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
        bos, eos = _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token"))
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        else:
            template = cfg.get("chat_template")
            if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
                template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(backend, bos_token=bos, eos_tokens=() if eos is None else (eos,), chat_template=template)

    @classmethod
    def byte(cls) -> Tokenizer:
        """ids 0..255 are bytes, then BYTE_SPECIALS; ends of text and of a chat turn both stop generation."""
        # Byte-level BPE with no merges: every byte is its own token and its id is the byte value.
        vocab = {ch: b for b, ch in _byte_to_unicode().items()}
        backend = _Backend(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_SPECIALS])
        backend.post_processor = processors.TemplateProcessing(
            single="<|bos|>:0 $A:0", special_tokens=[("<|bos|>", 256)]
        )
        return cls(backend, bos_token="<|bos|>", eos_tokens=("<|eos|>", "<|end|>"), chat_template=BYTE_CHAT_TEMPLATE)

    @property
    def backend(self) -> _Backend:
        """The `tokenizers` tokenizer underneath (its vocabulary, for guided decoding)."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        """text's ids; add_special_tokens: those the post-processor adds (BOS); split_special_tokens:
        special tokens' text in `text` is tokenized as text (transformers' option of the name),
        else it is their ids."""
        backend = self._plain_backend() if split_special_tokens else self._backend
        if len(text) > LONG_TEXT:  # encode_batch releases the interpreter lock (encode holds it): threads run meanwhile
            return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        plain_roles: tuple[str, ...] = PLAIN_TEXT_ROLES,
    ) -> list[int]:
        """The chat's ids as its template renders it (BOS included: encoded with
        add_special_tokens=False). Special tokens' text inside the content of messages of
        plain_roles is tokenized as text, so a user who types `<|system|>` sends those characters,
        not the role marker; the template's own markers stay special.

        Each such text in such content is wrapped in markers before rendering; the rendered chat,
        markers removed, is encoded piece by piece: what lies between marked texts with special
        tokens (the tokenizer splits the text at special tokens anyway), the marked texts as text."""
        plain = lambda m: m.get("role") in plain_roles and isinstance(m.get("content"), str)  # noqa: E731
        special = self._special_text
        found = 0 if special is None else sum(len(special.findall(m["content"])) for m in messages if plain(m))
        if not found:
            return self.encode(
                self.apply_chat_template(messages, add_generation_prompt, tools), add_special_tokens=False
            )
        mark = f"\ue000{secrets.token_hex(8)}\ue001"  # (private-use characters: text no template changes)
        marked = [
            {**m, "content": self._special_text.sub(lambda t: f"{mark}{t.group()}{mark}", m["content"])}
            if plain(m)
            else m
            for m in messages
        ]
        pieces = self.apply_chat_template(marked, add_generation_prompt, tools).split(mark)
        if len(pieces) != 2 * found + 1:  # the template rewrote the content (a filter, an escape)
            raise ValueError(
                "message content holds special tokens' text and this chat template transforms "
                "content, so it cannot be kept as text: remove it"
            )
        ids: list[int] = []
        for i, piece in enumerate(pieces):  # even: the template's and the content's text; odd: a marked text
            if piece:
                ids += self.encode(piece, add_special_tokens=False, split_special_tokens=i % 2 == 1)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # Incomplete UTF-8 decodes to U+FFFD; ids outside the vocabulary (padded model rows) decode to "".
        if len(ids) > LONG_TEXT:  # (as encode: decode_batch lets other threads run)
            return self._backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """The chat as the template renders it; tools: OpenAI's tool objects, as transformers
        passes them (the template decides whether and how it shows them)."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                tools=tools,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from e

    def _plain_backend(self) -> _Backend:
        if self._plain is None:  # (a race builds it twice, harmlessly)
            plain = _Backend.from_str(self._backend.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def _token_id(self, token: str) -> int:
        i = self._backend.token_to_id(token)
        if i is None:
            raise ValueError(f"special token {token!r} is not in the tokenizer's vocabulary")
        return i


class IncrementalDetokenizer:
    """Turns generated ids into text deltas, never splitting a multi-byte character.

    Decodes a short window of ids before the unread ones so merges and leading spaces render as in
    the full text, and holds text back while it ends in U+FFFD (a character still incomplete).
    """

    CONTEXT = 5  # prompt ids kept as decoding context

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens  # False: special tokens' text too (vLLM's option of the name)
        self.ids = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - self.CONTEXT, 0)  # window start
        self.read_offset = len(self.ids)  # ids before this have been emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        seen = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        text = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip)
        if len(text) <= len(seen) or text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(seen) :]

    def flush(self) -> str:
        """At the end of a generation: the text still held back (an incomplete character, as U+FFFD)."""
        seen = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        text = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip)
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(seen) :]


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + n) for n, b in enumerate(others)})
    return table


def _compile_template(source: str) -> jinja2.Template:
    # The environment HF gives chat templates: sandboxed, trimmed blocks, loop controls, these helpers.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not parse: {e}") from e


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _token_str(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token  # AddedToken dicts or plain strings
