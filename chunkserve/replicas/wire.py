"""The ingress's calls to a replica and what the replica streams back: the wire types between
chunkserve/cluster/ingress.py and chunkserve/replicas/deployment.py (pickled by Ray), read by the router too
(chunkserve/router/serve_router.py: the request's prefix hashes). The OpenAI HTTP schemas are apart, in
chunkserve/cluster/protocol.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from chunkserve.replicas.sequence import SamplingParams, Tenancy

__all__ = ["GenerateOutput", "GenerateRequest"]


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    stop: tuple[str, ...]  # stop strings: the text ends before the first one, finish_reason "stop"
    model: str
    prefix_hashes: tuple[int, ...] = ()  # chained chunk hashes of the prompt's head, for the router
    skip_special_tokens: bool = True  # the text without special tokens' (vLLM's)
    include_stop_str_in_output: bool = False  # the text through the stop string (vLLM's)
    # its tenant, cache salt (the prefix tree it shares; prefix_hashes are seeded by it too) and
    # priority (chunkserve/cluster/tenants.py)
    tenancy: Tenancy = Tenancy()


@dataclass(frozen=True)
class GenerateOutput:
    """What a replica streams back: everything new since its previous output for the request."""

    replica_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # None until the last output: "stop" | "length" | "abort"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int  # so far
    # with SamplingParams.logprobs, per token of token_ids: (its logprob, the most likely tokens'
    # (id, logprob))
    logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] | None = None
    # with SamplingParams.prompt_logprobs, in the first output: the same per prompt token (None
    # for the first)
    prompt_logprobs: tuple | None = None
    # in the first output: seconds from the replica receiving the request to this output (the
    # ingress's Server-Timing `replica`)
    first_output_s: float | None = None
