"""PrefixAffinityRouter: the Ray Serve glue of the prefix-aware policy (DESIGN §3).

Selected per deployment through Serve's `request_router_config` (chunkserve/cluster/app.py does it when
`router.policy: prefix`):

    request_router_config:
      request_router_class: chunkserve.router.serve_router:PrefixAffinityRouter
      request_router_kwargs: {chunk_size: 64, host_hit_credit: 0.8}
      request_routing_stats_period_s: 1

Everything it decides comes from `router.policy.PrefixPolicy`; this module only translates Serve's
callbacks:

  choose_replicas     the pending request's GenerateRequest (its first positional argument) carries
                      the chunk hashes, prompt length and max_tokens computed once by the ingress;
                      PrefixPolicy.choose ranks replicas, returned one per rank so Serve tries them
                      in that order (a rank whose replica is full is skipped; the last rank is two
                      random others, so a saturated choice spills instead of stalling). Calls
                      without a GenerateRequest (model_info, stats, health) get power of two on
                      Serve's queue lengths; a GenerateRequest shorter than one chunk gets the
                      policy's load-only power of two.
  on_request_routed   -> PrefixPolicy.on_routed (a ticket per request), and
  on_request_completed -> PrefixPolicy.on_finished (the request's work leaves the loads). Serve
                      (ray 2.60) calls on_request_routed only once the replica has accepted, and a
                      short request's completion callback can run before that (it is queued from
                      another thread): the ticket is then released by the result's own done
                      callback, so no completed request's work stays in a replica's load.
  update_replicas     membership: replicas joining or leaving are applied to the policy; a large
                      join (a router starting against a big deployment) builds the rendezvous table
                      in a worker thread and swaps it in, so the event loop never blocks for long.
                      Routing stats (`record_routing_stats` of chunkserve/replicas/deployment.py, refreshed
                      every request_routing_stats_period_s) carry the replica's load and its
                      tree's routing `events` (chunkserve/router/events.py: deltas of the chained
                      chunk hashes it holds, snapshots now and then), applied to the policy's
                      index (PrefixIndex.apply_events). Before a replica's events arrive the
                      policy relies on its own recent decisions (chunkserve/router/index.py).

                      Each routed request's prediction (the prompt tokens the policy counted as
                      cached on its replica) is left for the ingress in chunkserve/router/direct.py.
route_direct        the ingress's direct stream (chunkserve/replicas/direct_stream.py): the same choice made
                      for a request that will not go through Serve (the first rank only, if its
                      routing stats publish a `stream_address`; else None and the request takes
                      Serve's path), with the ticket the ingress releases when the stream ends.
                      The ingress finds its process's router through chunkserve/router/direct.py (Serve
                      pickles this module by value: its globals are not the ingress's).

share_decisions (router.share_decisions): the router joins the deployment's other routers
(chunkserve/router/peers.py: a PeerLink on its loop, found through GcsRegistry) and books their
decisions and completions as its own; the replicas' reports of those routers' work are then not
added (PeerBook.mirrored_keys).

Load units: the policy counts outstanding work in prefill tokens. A replica reports what it holds
by router (`held_by_router`, keyed by each ingress process's `direct.ROUTER_ID`, which the ingress
puts on every GenerateRequest): the other routers' share, converted to work, is added to this
router's exact count of its own (PrefixPolicy.set_others). A replica without that report gives
requests (running + waiting), converted with the mean work of the requests this router routed
lately.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import random
import time
from collections.abc import Callable
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from chunkserve.router import direct
from chunkserve.router.direct import DirectRoute
from chunkserve.router.peers import Peer, PeerBook, PeerLink, PeerLog, RegistryGone
from chunkserve.router.policy import PolicyConfig, PrefixPolicy, Rendezvous, ReplicaView, Ticket

logger = logging.getLogger("ray.serve")  # Serve's logger: its replicas' log files

# Joins above this many replicas at once build the rendezvous table off the event loop (a join
# costs O(SLOTS) vectorised per replica: ~1 ms each; building for 1024 replicas takes seconds).
INLINE_JOIN_LIMIT = 16


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the router's loop is closed: nothing keeps its loads any more
        pass


def _generate_request(pending_request: PendingRequest | None) -> Any:
    """The call's request to route by (chunkserve.replicas.wire.GenerateRequest, read by its attributes:
    prefix_hashes, prompt_token_ids, params.max_tokens), or None for a call without one."""
    if pending_request is None:
        return None
    for a in (*pending_request.args, *pending_request.kwargs.values()):
        if hasattr(a, "prefix_hashes") and hasattr(a, "prompt_token_ids"):
            return a
    return None


def _build_rendezvous(replica_ids: list[str]) -> Rendezvous:
    """Runs in a worker thread: a fresh table touched by nothing else until it is swapped in."""
    hrw = Rendezvous()
    hrw.add(replica_ids)
    return hrw


class GcsRegistry:
    """Where a deployment's routers find each other (peers.Registry): Ray's GCS key-value store,
    one key per router under the deployment's prefix. Its calls block (gRPC): PeerLink runs them
    off its loop."""

    NAMESPACE = "chunkserve_router_peers"

    def __init__(self, app_name: str, deployment_name: str):
        self._prefix = f"{app_name}/{deployment_name}/"

    def put(self, router: str, address: tuple[str, int, str]) -> None:
        from ray.experimental import internal_kv

        if not internal_kv._internal_kv_initialized():  # ray.shutdown() in this process
            raise RegistryGone("Ray is not initialized in this process")
        internal_kv._internal_kv_put(
            self._prefix + router, pickle.dumps(address), overwrite=True, namespace=self.NAMESPACE
        )

    def others(self, router: str) -> dict[str, tuple[str, int, str]]:
        from ray.experimental import internal_kv

        out = {}
        for key in internal_kv._internal_kv_list(self._prefix, namespace=self.NAMESPACE):
            name = (key.decode() if isinstance(key, bytes) else key)[len(self._prefix) :]
            if name != router:
                value = internal_kv._internal_kv_get(key, namespace=self.NAMESPACE)
                if value is not None:
                    out[name] = pickle.loads(value)
        return out

    def remove(self, router: str) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(self._prefix + router, namespace=self.NAMESPACE)


class PrefixAffinityRouter(RequestRouter):
    """Routes requests sharing a prompt prefix to the replica(s) caching it, with bounded load."""

    def initialize_state(
        self, chunk_size: int = 64, seed: int = 0, share_decisions: bool = False, **policy_options: Any
    ) -> None:
        """request_router_kwargs: chunk_size (the replicas' tree chunk size, as the ingress hashes
        with), seed (of the policy's random choices), share_decisions (book the deployment's other
        routers' decisions as this one's own: chunkserve/router/peers.py), and any other
        PolicyConfig field."""
        self._policy = PrefixPolicy(PolicyConfig(chunk_size=chunk_size, **policy_options), seed=seed)
        # (share_decisions) this router's decisions for the others, theirs booked here, the link
        self._share = share_decisions
        self._log: PeerLog | None = PeerLog() if share_decisions else None
        self._book: PeerBook | None = PeerBook(self._policy) if share_decisions else None
        self._link: PeerLink | None = None
        self._joining = False  # the link's start is under way (or done)
        self._rng = random.Random(seed)
        self._by_uid: dict[str, RunningReplica] = {}  # live replicas by unique id (the policy's ids)
        self._tickets: dict[str, tuple[Ticket, int]] = {}  # internal request id -> (ticket, PeerLog number)
        self._stats_seen: dict[str, Any] = {}  # replica -> the last routing stats applied
        self._mean_cost = 0.0  # EWMA of routed requests' work: replica-reported requests -> work
        self._building: asyncio.Task | None = None  # an off-loop rendezvous build in progress
        self._policy_ids: set[str] = set()
        self._home: asyncio.AbstractEventLoop | None = None  # the loop Serve runs this router on

    # -- membership and routing stats ---------------------------------------------------------
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        if self._home is None:  # (Serve calls this on the router's loop: direct routes go there)
            try:
                self._home = asyncio.get_running_loop()
                direct.register(self._deployment_id.app_name, self._deployment_id.name, self, self._home)
                # a router in a replica (an ingress) joins the others now, to know their placements
                # before its first request; one in a driver or script only once it routes (most
                # never do: a handle made to read or test would receive every decision and send none)
                if self._share and getattr(self._handle_source, "name", "UNKNOWN") != "UNKNOWN":
                    self._join()
            except RuntimeError:
                pass
        self._by_uid = {r.replica_id.unique_id: r for r in replicas}
        self._sync_membership()
        self._apply_routing_stats(replicas)

    def _join(self) -> None:
        """Start the link on the router's loop (share_decisions), once."""
        if not self._joining and self._home is not None:
            self._joining = True
            _call_soon(self._home, lambda: self._home.create_task(self._start_link()))  # type: ignore[union-attr]

    async def _start_link(self) -> None:
        """Join the deployment's other routers (share_decisions): listen, register, connect."""
        import ray

        assert self._log is not None and self._book is not None
        try:
            me = Peer(direct.ROUTER_ID + "." + hex(id(self))[2:], direct.ROUTER_ID, ray.util.get_node_ip_address())
            registry = GcsRegistry(self._deployment_id.app_name, self._deployment_id.name)
            link = PeerLink(me, self._log, self._book, registry)
            await link.start()
            self._link = link
        except Exception:
            logger.exception("PrefixAffinityRouter: sharing decisions failed to start; the reports alone count")

    def peer_stats(self) -> list[int] | None:
        """[routers this one sends to, the others' decisions booked here], or None without sharing."""
        if self._book is None:
            return None
        return [len(self._link.peers()) if self._link is not None else 0, self._book.booked]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        uid = replica_id.unique_id
        self._by_uid.pop(uid, None)
        if uid in self._policy_ids:
            self._policy_ids.discard(uid)
            self._policy.remove_replica(uid)
        self._stats_seen.pop(uid, None)

    def _sync_membership(self) -> None:
        live = set(self._by_uid)
        if live == self._policy_ids:
            return
        if self._building is not None:  # the build's end applies the membership of that time
            return
        added = live - self._policy_ids
        if len(added) > INLINE_JOIN_LIMIT:
            self._building = self._event_loop.create_task(self._build_off_loop(sorted(live)))
            return
        self._apply_membership()

    def _apply_membership(self) -> None:
        live = set(self._by_uid)
        for uid in self._policy_ids - live:
            self._stats_seen.pop(uid, None)
        self._policy.update_replicas(ReplicaView(uid) for uid in self._by_uid)
        self._policy_ids = live

    async def _build_off_loop(self, replica_ids: list[str]) -> None:
        try:
            hrw = await asyncio.get_running_loop().run_in_executor(None, _build_rendezvous, replica_ids)
            # Members the policy knows already keep their loads; the fresh table replaces the old
            # one, and update_replicas then only adds/removes what changed during the build
            # (Rendezvous.add and .remove skip ids already present or absent).
            for uid in self._policy_ids - set(replica_ids):
                self._policy.remove_replica(uid)
            self._policy_ids &= set(replica_ids)
            for uid in set(replica_ids) - set(self._by_uid):  # left while the table was built
                hrw.remove(uid)
            self._policy.swap_rendezvous(hrw)
            self._apply_membership()  # synchronously: the table and the policy's members agree
        except Exception:
            logger.exception("PrefixAffinityRouter: building the rendezvous table failed; joining inline")
            self._apply_membership()
        finally:
            self._building = None
        self._apply_routing_stats(list(self._by_uid.values()))

    def _apply_routing_stats(self, replicas: list[RunningReplica]) -> None:
        """Feed new routing stats (events, load) of policy members to the policy. Every broadcast
        repeats all replicas' stats; a report is applied once (keyed by its `as_of`, or its
        contents when it has none)."""
        if not self._policy_ids:
            return
        wall, mono = time.time(), time.monotonic()
        views: dict[str, ReplicaView] = {}
        for r in replicas:
            uid = r.replica_id.unique_id
            stats = r.routing_stats
            if not stats or uid not in self._policy_ids:
                continue
            key = stats.get("as_of")
            if key is None:
                key = tuple(sorted((k, v) for k, v in stats.items() if isinstance(v, (int, float))))
            if self._stats_seen.get(uid) == key:
                continue
            self._stats_seen[uid] = key
            load = None
            others = self._others_work(stats.get("held_by_router"))
            if others is None and self._mean_cost > 0 and "running" in stats:
                load = (stats.get("running", 0) + stats.get("waiting", 0)) * self._mean_cost
            events = stats.get("events")
            if events is not None:
                # the replica's wall clock -> this router's monotonic clock (clocks assumed synced)
                as_of = mono - max(0.0, wall - float(stats.get("as_of", wall)))
                self._policy.index.apply_events(uid, events, as_of)
            if others is not None:
                views[uid] = ReplicaView(uid, others=others)
            elif load is not None:
                views[uid] = ReplicaView(uid, load)
        if views:  # one pass over the members, not one per report
            self._policy.update_replicas(views.get(u) or ReplicaView(u) for u in self._policy_ids)

    def _others_work(self, held: Any) -> float | None:
        """The work a replica reported holding from the other routers (its `held_by_router`:
        router id -> [requests, prompt tokens, cached tokens, max_tokens]), in the policy's units;
        None if it reports none (an older replica: its running + waiting count stands in)."""
        if not isinstance(held, dict):
            return None
        dw, work = self._policy.config.decode_weight, 0.0
        # (routers whose decisions are booked here already: not added again)
        mirrored = self._book.mirrored_keys() if self._book is not None else frozenset()
        for router, (_, prompt, cached, max_tokens) in held.items():
            if router != direct.ROUTER_ID and router not in mirrored:
                work += prompt - cached + dw * max_tokens
        return work

    # -- decisions ------------------------------------------------------------------------------
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        req = _generate_request(pending_request)
        by_uid = self._by_uid
        if req is not None and self._policy_ids:
            ranked = self._policy.choose(
                req.prefix_hashes, len(req.prompt_token_ids), req.params.max_tokens, time.monotonic(), req.session
            )
            ranks = [[by_uid[uid]] for uid in ranked if uid in by_uid]
            if ranks:
                chosen = {rank[0].replica_id for rank in ranks}
                if len(chosen) < len(candidate_replicas):  # spill rank: two others, lowest queue wins
                    others = self._sample(candidate_replicas, 2, exclude=chosen)
                    if others:
                        ranks.append(others)
                return ranks
        return [self._sample(candidate_replicas, 2)]  # Serve's power of two on queue lengths

    def _sample(self, candidates: list[RunningReplica], k: int, exclude: set = frozenset()) -> list[RunningReplica]:
        """Up to k distinct replicas not in `exclude`, O(k) expected for a small exclude set."""
        n = len(candidates)
        out: list[RunningReplica] = []
        tries = 0
        while len(out) < k and tries < 8 * k + 8:
            tries += 1
            r = candidates[self._rng.randrange(n)]
            if r.replica_id not in exclude and r not in out:
                out.append(r)
        if len(out) < k and n <= 64:  # few candidates: take whatever is left
            out += [r for r in candidates if r.replica_id not in exclude and r not in out][: k - len(out)]
        return out

    def route_direct(self, req: Any) -> DirectRoute | None:
        """See route_direct (on this router's event loop)."""
        if not self._policy_ids:
            return None
        now = time.monotonic()
        ranked = self._policy.choose(
            req.prefix_hashes, len(req.prompt_token_ids), req.params.max_tokens, now, req.session
        )
        replica = self._by_uid.get(ranked[0]) if ranked else None
        address = (replica.routing_stats or {}).get("stream_address") if replica is not None else None
        if address is None:
            return None
        uid = replica.replica_id.unique_id
        booked = self._routed(uid, req, now)
        loop = self._home
        assert loop is not None
        return DirectRoute(uid, address, lambda: _call_soon(loop, self._finish, booked))

    def _routed(self, uid: str, req: Any, now: float) -> tuple[Ticket, int]:
        """-> the policy's ticket and the decision's number among those shared (0: not shared)."""
        ticket = self._policy.on_routed(
            uid, req.prefix_hashes, len(req.prompt_token_ids), req.params.max_tokens, now, req.session
        )
        self._mean_cost += 0.05 * (ticket.cost - self._mean_cost) if self._mean_cost else ticket.cost
        direct.predict(req.request_id, ticket.matched)  # (the ingress compares it with the replica's count)
        n = 0
        if self._log is not None:
            if not self._joining:
                self._join()
            n = self._log.routed(
                uid, req.prefix_hashes, len(req.prompt_token_ids), req.params.max_tokens, req.session, ticket.matched
            )
        return ticket, n

    def _finish(self, booked: tuple[Ticket, int]) -> None:
        """A routed request ended: its work leaves this router's loads (and the others')."""
        ticket, n = booked
        self._policy.on_finished(ticket)
        if n and self._log is not None:
            self._log.finished(n)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        req = _generate_request(pending_request)
        uid = replica_id.unique_id
        if req is None or uid not in self._policy_ids:
            return
        booked = self._routed(uid, req, time.monotonic())
        request_id = pending_request.metadata.internal_request_id
        self._tickets[request_id] = booked
        if result is not None:
            # on_request_completed may have run already (then the ticket would stay, and the
            # replica's load with it: a short request finishes before Serve reports it routed);
            # a done callback fires at once on a finished result, from Ray's or gRPC's thread
            loop = self._event_loop
            result.add_done_callback(lambda _: loop.call_soon_threadsafe(self._release, request_id, booked))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        booked = self._tickets.pop(internal_request_id, None)
        if booked is not None:
            self._finish(booked)

    def _release(self, request_id: str, booked: tuple[Ticket, int]) -> None:
        """The result's done callback: release its ticket unless on_request_completed has."""
        if self._tickets.get(request_id) is booked:
            del self._tickets[request_id]
            self._finish(booked)
