"""Iteration-level scheduling: which sequences run this step, and how many tokens each.

Policy (FCFS, SARATHI-style chunked prefill under one token budget):
1. running decodes (one token each), then running prefills (a piece of at most the budget left);
2. waiting requests while the budget, `max_num_seqs` and free chunks allow, in arrival order
   (FCFS) when they are all of one tenant and priority; with several, the next is the lowest
   priority value, then the tenant with the fewest running sequences, then arrival (within a
   tenant FCFS), so one tenant's flood cannot starve another's (DESIGN §2). Admission stops at
   the first that does not fit: nobody overtakes it. But a request whose next uncached prompt
   chunk another running sequence is computing waits (`_inflight`): it stays in the queue,
   those behind it may be admitted, and once the chunk is in the tree it matches it instead of
   computing it again. It waits only while that chunk is pending: admission is reached only
   when every running prefill had its piece, so its computer progresses at each such step.
   A request that holds chunks copied back from the host tier in this schedule (by itself or
   another) is admitted, its chunks reserved, and runs from the next step: the copies run beside
   this one (PrefixTree.loading, DESIGN §6). The cached prefixes of the first `_TOUCH_AHEAD`
   still waiting are marked used at each step that may evict, so the pool evicts what nobody
   waits for first;
3. a running sequence that needs a chunk when none is available preempts the newest running
   sequence (recompute: its chunks are released, its full ones stay in the tree as cache, and
   it re-queues in arrival order); among tenants, the newest of the highest priority value and
   the tenant running the most. The request first in that order therefore always progresses:
   no deadlock, and at one priority no request waits forever (a higher priority value waits
   while lower ones keep coming, as under vLLM's priority scheduling).
The decode rows are ordered by tree path (DFS), so each node's sequences are one row range.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, deque
from typing import TYPE_CHECKING

from chunkserve.replicas.engine.prefix_tree import HOST, Node, PrefixTree
from chunkserve.replicas.engine.sequence import Batch, Sequence, Status
from chunkserve.replicas.engine.stats import EngineStats
from chunkserve.router.hashing import cache_seed, chunk_hashes

if TYPE_CHECKING:
    from chunkserve.replicas.engine.config import EngineConfig


class Scheduler:
    def __init__(self, tree: PrefixTree, config: EngineConfig, counters: EngineStats | None = None):
        """config: the engine's, resolved (its max_model_len set): the step's token budget and
        row cap, prefix sharing, and with graph_mixed_steps a mixed step's decode rows ordered
        so that those sharing its first prefill's prefix come last (see _sort_dfs): the
        prefill's tokens, after them, then extend the same DFS order (chunkserve/replicas/engine/
        attention.py plans them as decode rows). counters: the engine's, where preemptions are
        counted (None: one of its own)."""
        self.tree = tree
        self.prefill_rows_last = config.graph_mixed_steps
        self.max_model_len = config.max_model_len
        self.c = tree.c
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.sharing = config.enable_prefix_sharing
        self.waiting: deque[Sequence] = deque()  # arrival order
        # the waiting sequences by class (priority, tenant), each in arrival order: a class's first is
        # its queue's head, so a fair admission reads one sequence a class, not the whole queue
        self._queues: dict[tuple[int, str | None], deque[Sequence]] = {}
        self.running: list[Sequence] = []  # arrival order
        self.now = 0  # step counter: the tree's LRU clock
        self.counters = EngineStats() if counters is None else counters
        self.last_decode_paths: list[tuple[int, ...]] = []
        # prompt chunks some running sequence will compute, not in the tree yet: chained key
        # (`_chunk_keys`) -> (that sequence, the chunk's index). Registered at admission, dropped
        # as each enters the tree or its sequence releases its chunks (preempted, finished).
        self._inflight: dict[int, tuple[Sequence, int]] = {}
        # the matches of the queue's head (`_touch_waiting`), made once a sequence reaches it
        self._wait_paths: dict[Sequence, list[Node]] = {}

    # -- queue management -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        key = _class(seq)
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
        queue.append(seq)

    def _requeue(self, seq: Sequence) -> None:
        """Back into both queues by arrival (a preempted sequence is older than never-admitted ones)."""
        for queue in (self.waiting, self._queues.setdefault(_class(seq), deque())):
            i = 0
            while i < len(queue) and queue[i].arrival < seq.arrival:
                i += 1
            queue.insert(i, seq)

    def _unwait(self, seq: Sequence) -> None:
        self.waiting.remove(seq)  # (admission takes the first but those waiting for a chunk: found soon)
        self._wait_paths.pop(seq, None)
        key = _class(seq)
        queue = self._queues[key]
        queue.remove(seq)
        if not queue:
            del self._queues[key]

    def _next_waiting(self, running: Counter[str | None] | None, waits: set[Sequence]) -> Sequence | None:
        """The waiting sequence to admit next: the first (FCFS) while all are of one class
        (priority, tenant); else the first of each class, ranked by priority, then its tenant's
        running sequences (`running`: counts by tenant, kept by the caller), then arrival. Those
        in `waits` (this step's waits for a chunk being computed) are passed over; None: all are."""
        if running is None:
            return next((s for s in self.waiting if s not in waits), None)
        heads = (next((s for s in q if s not in waits), None) for q in self._queues.values())
        return min(
            (s for s in heads if s is not None),
            key=lambda s: (s.tenancy.priority, running[s.tenancy.tenant], s.arrival),
            default=None,
        )

    def _victim(self) -> Sequence:
        """The running sequence a preemption takes: the newest (of one class); among several, the
        newest of the highest priority value and of the tenant running the most."""
        running = Counter(s.tenancy.tenant for s in self.running)
        return max(self.running, key=lambda s: (s.tenancy.priority, running[s.tenancy.tenant], s.arrival))

    def finish(self, seq: Sequence, reason: str) -> None:
        """Release a sequence's chunks: full ones stay cached in the tree, the rest are freed."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status is Status.WAITING:
            self._unwait(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def _release(self, seq: Sequence) -> None:
        if seq.chunk_keys is not None:  # the prompt chunks it was to compute: nobody computes them now
            for key in seq.chunk_keys[len(seq.nodes) :]:
                self._uncompute(key, seq)
        self.tree.release(seq.nodes, self.now)
        for cid in seq.private:
            self.tree.pool.free(cid)
        seq.nodes, seq.private, seq.num_computed = [], [], 0
        seq.table_version += 1

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = Status.WAITING
        self._requeue(seq)
        self.counters.preemptions += 1

    # -- chunks -----------------------------------------------------------------------------
    def _coverable(self, seq: Sequence, keep: int) -> int:
        """How many more tokens `seq` could get K/V slots for, leaving `keep` chunks in hand."""
        chunks = seq.num_chunks + self.tree.num_available - keep
        return chunks * self.c - seq.num_computed

    def _chunks_needed(self, seq: Sequence, n: int) -> int:
        return max(0, -(-(seq.num_computed + n) // self.c) - seq.num_chunks)

    def _grow(self, seq: Sequence, n: int) -> int:
        """Reserve the chunks that `n` more tokens need, before the step runs, so the tree
        never changes inside a step; returns how many. Callers checked availability."""
        need = self._chunks_needed(seq, n)
        for _ in range(need):
            cid = self.tree.alloc()
            assert cid is not None, "availability was checked"
            seq.private.append(cid)
        return need

    def _reserve_ahead(self, decodes: list[Sequence]) -> None:
        """Give every decode row with less than a chunk of room past this step's token one more
        chunk, all together at a step where some row needed a new chunk anyway.

        The decode plan covers each row's whole table (reserved chunks included) and is rebuilt
        only when a table changes, so rows growing in step rebuild it about once per chunk of
        tokens instead of at every step where some row's tail fills (every step once the batch
        holds a chunk's worth of rows at staggered lengths). Costs at most one chunk per row,
        and only from chunks beyond the one per running sequence that admission keeps in hand.
        """
        for seq in decodes:
            room = seq.num_chunks * self.c - (seq.num_computed + 1)
            if room < self.c and self.tree.num_available > len(self.running):
                cid = self.tree.alloc()
                assert cid is not None, "availability was checked"
                seq.private.append(cid)

    # -- the step ---------------------------------------------------------------------------
    def schedule(self) -> Batch:
        self.now += 1
        self.tree.loading.clear()  # (the last step's loads: this step's kernels wait for them)
        budget = self.max_num_batched_tokens
        preemptions_before = self.counters.preemptions
        planned: dict[Sequence, int] = {}  # insertion order: decodes, then prefill pieces
        grew = False  # some decode row needed a new chunk this step
        decodes: list[Sequence] = []  # running order within each (one pass: this runs every step)
        prefills: list[tuple[Sequence, int]] = []
        c, limit = self.c, self.max_model_len or 1 << 62
        for seq in self.running:  # (num_pending inlined: this loop and the next run per row per step)
            out = len(seq.output_ids)
            if seq.ends_by_length(out, limit):
                # its last token is still on the device (the engine's asynchronous scheduling):
                # the sequence ends on it by length once it arrives, so it runs nothing more
                continue
            pending = len(seq.prompt_ids) + out - seq.num_computed
            (decodes if pending == 1 else prefills).append(seq)
        for decoding, seqs in ((True, decodes), (False, prefills)):
            for seq in seqs:
                if seq.status is not Status.RUNNING:  # preempted above
                    continue
                if budget == 0:
                    break
                if decoding and (len(seq.nodes) + len(seq.private)) * c > seq.num_computed:
                    planned[seq] = 1  # the token's slot is in the row's chunks: nothing to grow
                    budget -= 1
                    continue
                while self._coverable(seq, 0) < 1:  # not even one token fits: preempt the newest
                    victim = self._victim()
                    budget += planned.pop(victim, 0)
                    self._preempt(victim)
                    if victim is seq:
                        break
                if seq.status is Status.RUNNING:
                    n = min(seq.num_pending, budget, self._coverable(seq, 0))
                    grew |= self._grow(seq, n) > 0 and decoding
                    planned[seq] = n
                    budget -= n
        if grew:
            self._reserve_ahead([s for s, n in planned.items() if s.num_pending == 1 and n == 1])
        # after a preemption the pool is short: admitting now would only thrash
        admit = self.counters.preemptions == preemptions_before
        running: Counter[str | None] | None = None  # by tenant, once several classes wait
        waits: set[Sequence] = set()  # this step's, whose next chunk another sequence computes
        while admit and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if running is None and len(self._queues) > 1:
                running = Counter(s.tenancy.tenant for s in self.running)
            seq = self._next_waiting(running, waits)
            if seq is None:
                break
            n = self._admit(seq, budget)
            if n == _WAIT:
                waits.add(seq)
                self.counters.prefix_waits += 1
                continue
            if n == 0:
                break
            self._unwait(seq)
            if running is not None:
                running[seq.tenancy.tenant] += 1
            seq.status = Status.RUNNING
            self.running.append(seq)
            if self.tree.loading and any(node.id in self.tree.loading for node in seq.nodes):
                continue  # chunks it holds are copied back beside this step: it runs from the next
            planned[seq] = n
            budget -= n
        # (only where the next step may evict: a step takes at most its budget's chunks and two
        # a running row, a new one and one ahead)
        if self.sharing and self.waiting and self.tree.pool.num_free <= self._step_chunks():
            self._touch_waiting()
        batch = Batch()
        for seq, n in planned.items():
            if n == 1 and seq.num_pending == 1:
                batch.decodes.append(seq)
            else:
                batch.prefills.append((seq, n))
        # DFS order (the rows holding any node contiguous): sorted by each row's run of nodes
        # that more than one live sequence holds (a prefix of its path: a node's ancestors are
        # held at least as often), then arrival. Nodes only the row holds stay out of the key,
        # so a tail chunk entering the tree does not reorder the batch (and rebuild the plan).
        _sort_dfs(batch.decodes, batch.prefills[0][0] if self.prefill_rows_last and batch.prefills else None)
        self.last_decode_paths = [s.path_ids() for s in batch.decodes]  # for PrefixTree.check
        return batch

    def _step_chunks(self) -> int:
        return self.max_num_batched_tokens // self.c + 2 * len(self.running) + 2

    def _touch_waiting(self) -> None:
        """Mark the cached prefixes of the first `_TOUCH_AHEAD` waiting sequences used this step
        (`PrefixTree.touch`): on a replica whose queue backs up, the pool evicts the chunks that
        nobody waits for before those its next admissions will match, which LRU alone evicted
        first, being the oldest while they waited. A sequence is matched once, when it reaches
        the head; its nodes are then walked while they stay in the tree."""
        for seq in itertools.islice(self.waiting, _TOUCH_AHEAD):
            path = self._wait_paths.get(seq)
            if path is None:
                if seq.params.prompt_logprobs is not None:  # (it matches nothing)
                    continue
                path = self.tree.match(seq.token_ids, seq.num_tokens - 1, seq.tenancy.cache_salt)
                self._wait_paths[seq] = path
            self.tree.touch(path, self.now)

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Match the cache, reserve chunks for a first piece (as much of the prompt as the budget
        and the pool allow); 0 if nothing fits now; _WAIT (nothing changed) if another running
        sequence is computing the prompt chunk after the cached ones: a step or a few later
        the tree has it.

        Besides the piece, keep one chunk per running sequence in hand so that admitting a
        request does not immediately force a preemption when running decodes cross a chunk.
        """
        loaded = 0
        if self.sharing and seq.params.prompt_logprobs is None:  # (prompt logprobs: every token computed)
            # the last token always runs: its logits give the first output token
            path = self.tree.match(seq.token_ids, seq.num_tokens - 1, seq.tenancy.cache_salt)
            k = len(path)  # the next chunk it would compute, if it may match it and is the prompt's
            if k < min(seq.num_tokens - 1, len(seq.prompt_ids)) // self.c and self._inflight:
                if self._chunk_keys(seq)[k] in self._inflight:
                    return _WAIT
            on_gpu = next((i for i, n in enumerate(path) if n.tier == HOST), len(path))
            self.tree.acquire(path[:on_gpu], self.now)
            if on_gpu < len(path):
                # host nodes come back into GPU chunks (no token of the budget: their K/V is
                # copied, not computed), as many as leave a chunk for the first piece beyond the
                # one per running sequence kept in hand; the rest the piece recomputes
                room = self.tree.num_available - len(self.running) - 1
                loaded = self.tree.load(path[on_gpu : on_gpu + max(0, room)], self.now)
            seq.nodes = path[: on_gpu + loaded]
            seq.num_computed = len(seq.nodes) * self.c
        n = min(seq.num_pending, budget, self._coverable(seq, keep=len(self.running)))
        if n < 1:
            self._release(seq)
            return 0
        if seq.num_cached_prompt is None:
            seq.num_cached_prompt = min(seq.num_computed, len(seq.prompt_ids))
            seq.num_cached_prompt_host = min(loaded * self.c, seq.num_cached_prompt)
        self._grow(seq, n)
        if self.sharing:  # its prompt chunks past the cached ones: those it will compute
            for k, key in enumerate(self._chunk_keys(seq)[len(seq.nodes) :], len(seq.nodes)):
                self._inflight.setdefault(key, (seq, k))  # (one sequence's suffices to wait for)
        return n

    def _chunk_keys(self, seq: Sequence) -> list[int]:
        """Chained keys of the full chunks of `seq`'s prompt under its cache salt (made once):
        equal keys, equal salts and prompts up to that chunk's end. xxh3, process-independent
        (chunkserve.router.hashing), so tensor-parallel ranks decide alike."""
        if seq.chunk_keys is None:
            seed = cache_seed(0, seq.tenancy.cache_salt)
            seq.chunk_keys = chunk_hashes(seq.prompt_ids, self.c, len(seq.prompt_ids) // self.c, seed)
        return seq.chunk_keys

    def _uncompute(self, key: int, seq: Sequence) -> None:
        entry = self._inflight.get(key)
        if entry is not None and entry[0] is seq:
            del self._inflight[key]

    def advance(self, batch: Batch) -> None:
        """After the forward pass: the new tokens' K/V are in the cache; chunks that became full
        enter the tree (deduplicated against identical chunks computed concurrently). A sequence
        that finished while the step ran (the engine's asynchronous scheduling) has released its
        chunks: it has none to insert."""
        for seq in batch.decodes:  # one token each (Batch.items would build the pairs)
            seq.num_computed += 1
        for seq, n in batch.prefills:
            seq.num_computed += n
        if self.sharing:
            for seq in batch.decodes:
                self._insert_full_chunks(seq)
            for seq, _ in batch.prefills:
                self._insert_full_chunks(seq)

    def _insert_full_chunks(self, seq: Sequence) -> None:
        c = self.c
        while seq.private and (len(seq.nodes) + 1) * c <= seq.num_computed:
            k = len(seq.nodes)
            tokens = tuple(seq.token_at(i) for i in range(k * c, (k + 1) * c))
            parent = seq.nodes[-1] if seq.nodes else self.tree.root_for(seq.tenancy.cache_salt)
            cid = seq.private.pop(0)
            seq.nodes.append(self.tree.insert(parent, tokens, cid, self.now))
            if seq.chunk_keys is not None and k < len(seq.chunk_keys):  # in the tree: matched from now on
                self._uncompute(seq.chunk_keys[k], seq)
            if seq.nodes[-1].chunk_id != cid:  # deduplicated: the table changed in place
                seq.table_version += 1

    def check(self) -> None:
        """Assert that every chunk registered as being computed is so: a prompt chunk of a running
        sequence, past its nodes in the tree (LLMEngine.check calls it)."""
        running = set(self.running)
        for key, (seq, k) in self._inflight.items():
            assert seq in running and seq.status is Status.RUNNING, f"{seq.request_id}: not running, chunk {k} pending"
            assert len(seq.nodes) <= k and seq.chunk_keys is not None and seq.chunk_keys[k] == key, (
                f"{seq.request_id}: chunk {k} in the tree or misfiled, still pending"
            )
        assert self.sharing or not self._inflight, "chunks pending without sharing"
        for seq in self._wait_paths:
            assert seq.status is Status.WAITING, f"{seq.request_id}: a head-of-queue match, not waiting"


_WAIT = -1  # _admit: wait for a chunk another sequence is computing
# waiting sequences whose cached prefixes each step keeps as if used (in the routing simulator's
# engine model, 4 gave most of what 8 did: chunkserve/router/tools/records, simulate-2026-12-07c)
_TOUCH_AHEAD = 8


def _class(seq: Sequence) -> tuple[int, str | None]:
    return seq.tenancy.priority, seq.tenancy.tenant


def _sort_dfs(rows: list[Sequence], last: Sequence | None = None) -> None:
    """Sort decode rows by their shared runs' paths, then arrival (see Scheduler.schedule).

    The rows' shared runs end at a few distinct nodes: those are ranked by path once and the rows
    sorted by (rank, arrival), instead of comparing paths row against row (less than half the
    host time at 256 rows: chunkserve/cluster/loadtest/records/README.md, 'Figures behind the code').
    last: a sequence whose rows will follow these; the DFS visits, at each node, the child on
    its path last (that node's id ranks past every sibling's), so every row holding one of its
    nodes is in the batch's last rows.
    """
    deepest = {}  # row -> the last node of its shared run (None: it shares nothing)
    paths: dict = {}  # that node -> its path
    for seq in rows:
        k = len(seq.nodes)  # the shared run is a prefix of the path: scan back over the row's own nodes
        while k and seq.nodes[k - 1].ref <= 1:
            k -= 1
        node = seq.nodes[k - 1] if k else None
        deepest[seq] = node
        if node not in paths:
            paths[node] = seq.path_ids()[:k]
    key = paths.__getitem__
    if last is not None:
        along = last.path_ids()

        def key(node) -> tuple:
            path = paths[node]
            k = next((i for i, (a, b) in enumerate(zip(path, along)) if a != b), min(len(path), len(along)))
            return (math.inf,) * k + tuple(path[k:])

    rank = {node: i for i, node in enumerate(sorted(paths, key=key))}
    rows.sort(key=lambda seq: (rank[deepest[seq]], seq.arrival))
