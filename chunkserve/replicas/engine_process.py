"""The engine core in a process of its own: the replica's front talks to it over one pipe.

A replica's engine step is mostly host work (Python, kernel launches). Run in a thread of the
Serve replica's process, every other thing that process does (Serve's request plumbing, each
streamed output's serialization, the event loop, metrics) took the interpreter lock from it,
and decoding through Serve ran far slower than the engine alone (figures:
chunkserve/cluster/loadtest/records/README.md, 'Figures behind the code'). As vLLM v1 (EngineCore) and
SGLang (the scheduler process) do, the engine runs in its own process and steps back to back;
the replica keeps only the front:

    replica process (Serve, asyncio)                 engine process (python -m chunkserve.replicas.engine_process)
    EngineProcess()  ── StartEngine ──▶              builds the engine (warms it up)
                     ◀── EngineReady | StartFailed
    EngineProcess.add / abort / compile / close      commands applied between two steps:
       ── AddRequest, AbortRequest, CompileGuide, CloseEngine ──▶
    receiver thread  ◀── StepOutputs, one a step ──  engine.step() back to back while there is work;
      └─ loop.call_soon_threadsafe(on_step, step)    blocked on the pipe while idle
                     ◀── GuideCompiled, EngineCrashed

The messages are chunkserve/replicas/wire.py's (each side refuses any other type). One StepOutputs
a step carries every request's new outputs (batched, one pickle), the adds it accepted or refused
(the engine's ValueError text), the engine's stats, and the routing events of its prefix tree
since the last message (chunkserve/router/events.py: the chunk hashes it stored and evicted, or a
snapshot; None when nothing changed). Guided requests' grammars compile in a thread of the engine
process (CompileGuide, answered by GuideCompiled), so a large schema never holds up the steps.

The engine process dies with the replica (PR_SET_PDEATHSIG on Linux, and the pipe's end), and a
replica whose engine process died reports it (`EngineProcess.error`): its health check fails
and Serve replaces it. Tensor parallelism: the engine process is rank 0 and joins the ranks'
group itself (`tp_rendezvous`); the replica starts ranks 1 .. n-1 (chunkserve/replicas/deployment.py).
No Ray here.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import itertools
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

from chunkserve.replicas.engine.llm_engine import EngineConfig
from chunkserve.replicas.engine.sequence import SamplingParams, Tenancy
from chunkserve.replicas.wire import (
    ENGINE_COMMANDS,
    ENGINE_REPLIES,
    AbortRequest,
    AddRequest,
    CloseEngine,
    CompileGuide,
    EngineCommand,
    EngineCrashed,
    EngineDied,
    EngineReady,
    EngineReply,
    GuideCompiled,
    StartEngine,
    StartFailed,
    StepOutputs,
    check,
)

__all__ = ["EngineProcess"]


class EngineProcess:
    """The replica's side: start the engine process, send it requests, receive its steps."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        warm_up: bool = False,
        route_events: tuple[str, int] | None = None,
        tp_rendezvous: tuple[str, int] | None = None,
        ready_timeout_s: float = 3600.0,
        while_waiting: Callable[[], None] | None = None,
    ):
        """Start the process and wait until its engine is built (and warmed up): raises
        EngineDied with the engine's error if it fails. route_events: (served model name,
        route_chunks) to record the tree's routing events with (LLMEngine.record_route_events),
        or None. while_waiting: called about every second meanwhile (the replica checks its
        tensor-parallel ranks there)."""
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # (Ray's working dirs too)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "chunkserve.replicas.engine_process", "--fd", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._compiles: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self.error: str | None = None  # why the engine process is gone, once it is
        self._closed = False
        self._send(StartEngine(config, warm_up, route_events, tp_rendezvous))
        deadline = time.monotonic() + ready_timeout_s
        while not self._conn.poll(1.0):
            if self._proc.poll() is not None:
                raise EngineDied(f"the engine process exited with {self._proc.returncode} while starting")
            if time.monotonic() > deadline:
                self.close()
                raise EngineDied(f"the engine process was not ready within {ready_timeout_s:.0f} s")
            if while_waiting is not None:
                try:
                    while_waiting()
                except BaseException:
                    self.close()
                    raise
        ready = self._recv()
        if not isinstance(ready, EngineReady):
            self.close()
            raise EngineDied(f"the engine failed to start: {ready.error if isinstance(ready, StartFailed) else ready}")
        self.info = ready
        self._reader: threading.Thread | None = None

    # -- replica -> engine --------------------------------------------------------------------
    def add(self, request_id: str, prompt: list[int], params: SamplingParams, tenancy: Tenancy | None = None) -> None:
        """Queued for the engine's next step; the outcome comes in a step message (accepted or rejected)."""
        self._send(AddRequest(request_id, prompt, params, tenancy))

    def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))

    async def compile(self, guide) -> None:
        """Compile a guided request's grammar in the engine process (its add then finds it
        cached); raises the engine's ValueError for a guide it cannot take."""
        token = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._compiles[token] = future
        self._send(CompileGuide(token, guide))
        await future

    def close(self) -> None:
        """End the engine process (it also ends on its own when this process dies)."""
        if self._closed:
            return
        self._closed = True
        if self._proc.poll() is None:
            try:
                self._send(CloseEngine())
                self._proc.wait(10)
            except (OSError, EngineDied, subprocess.TimeoutExpired):
                self._proc.kill()
        self._conn.close()

    # -- engine -> replica --------------------------------------------------------------------
    def start_receiving(
        self, loop: asyncio.AbstractEventLoop, on_step: Callable[[StepOutputs], None], on_death: Callable[[str], None]
    ) -> None:
        """Deliver each StepOutputs to on_step on `loop`, from a receiver thread; on_death(reason)
        once if the engine process goes."""

        def deliver(fn: Callable, *args) -> None:
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

        def receive() -> None:
            try:
                while True:
                    match self._recv():
                        case StepOutputs() as step:
                            deliver(on_step, step)
                        case GuideCompiled(token, error):
                            deliver(self._compiled, token, error)
                        case EngineCrashed(reason):
                            raise EngineDied(reason)
                        case other:
                            raise EngineDied(f"the engine process sent {type(other).__name__} {other!r:.100}")
            except (EngineDied, EOFError, OSError) as e:
                if self._closed or loop.is_closed():
                    return  # (closed on purpose)
                code = self._proc.poll()
                reason = (
                    str(e)
                    if isinstance(e, EngineDied)
                    else (f"the engine process exited ({'code ' + str(code) if code is not None else 'pipe closed'})")
                )
                self.error = reason
                deliver(self._fail_compiles, reason)
                deliver(on_death, reason)

        self._reader = threading.Thread(target=receive, name="engine-receiver", daemon=True)
        self._reader.start()

    def _compiled(self, token: int, error: str | None) -> None:
        future = self._compiles.pop(token, None)
        if future is None or future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(ValueError(error))

    def _fail_compiles(self, reason: str) -> None:
        for future in self._compiles.values():
            if not future.done():
                future.set_exception(EngineDied(reason))
        self._compiles.clear()

    # -- the pipe -----------------------------------------------------------------------------
    def _send(self, message: EngineCommand) -> None:
        check(message, ENGINE_COMMANDS, "the engine pipe")
        if self.error is not None:
            raise EngineDied(self.error)
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except OSError as e:
            raise EngineDied(f"the engine process is gone ({e})") from None

    def _recv(self) -> EngineReply:
        return pickle.loads(self._conn.recv_bytes())


# -- the engine process -----------------------------------------------------------------------


def _die_with_parent() -> None:
    """SIGKILL this process when the replica's process dies (Linux; elsewhere the pipe's EOF)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _Core:
    """The engine process's loop: commands between steps, one message a step."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.lock = threading.Lock()
        self.compiler = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")

    def send(self, message: EngineReply) -> None:
        check(message, ENGINE_REPLIES, "the engine pipe")
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self.lock:
            self.conn.send_bytes(data)

    def start(self) -> None:
        start = pickle.loads(self.conn.recv_bytes())
        try:
            if not isinstance(start, StartEngine):
                raise TypeError(f"the engine process began with {type(start).__name__} {start!r:.100}, not StartEngine")
            self.engine = _build(start.config, start.tp_rendezvous)
            warm = None
            if start.warm_up:
                from chunkserve.replicas.engine.warmup import warmup

                warm = warmup(self.engine)
            if self.engine.tokenizer is not None:
                # the grammar engine and the vocabulary's token info now: built at the first guided
                # request, their import and build held the interpreter lock from the steps running
                self.engine.guides()
        except BaseException as e:  # noqa: BLE001 - the replica raises it
            self.send(StartFailed(f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            traceback.print_exc()
            os._exit(1)
        if start.route_events is not None:  # (after warmup: its synthetic requests' chunks are the first snapshot's)
            self.engine.record_route_events(*start.route_events)
        self.send(
            EngineReady(
                self.engine.max_model_len,
                self.engine.model_config.vocab_size,
                warm,
                self.engine.stats(),
                self.engine.take_route_events(),
            )
        )

    def _compile(self, token: int, guide) -> None:
        try:
            self.engine.guides().compile(guide)
            error = None
        except ValueError as e:
            error = str(e)
        self.send(GuideCompiled(token, error))

    def run(self) -> None:
        engine, conn = self.engine, self.conn
        while True:
            accepted, rejected = [], []
            idle = not engine.has_unfinished()
            # while idle, wait for a command; else take what came during the last step
            while conn.poll(None if idle else 0):
                idle = False
                match pickle.loads(conn.recv_bytes()):
                    case AddRequest(rid, prompt, params, tenancy):
                        try:
                            engine.add_request(rid, prompt, params, tenancy)
                            accepted.append(rid)
                        except ValueError as e:
                            rejected.append((rid, str(e)))
                    case AbortRequest(rid):
                        engine.abort(rid)
                    case CompileGuide(token, guide):
                        self.compiler.submit(self._compile, token, guide)
                    case CloseEngine():
                        return
                    case other:  # (the replica's side checks what it sends: a bug there, or a stranger)
                        raise TypeError(f"the engine process got {type(other).__name__} {other!r:.100}, not a command")
            outputs = engine.step() if engine.has_unfinished() else []
            self.send(StepOutputs(outputs, accepted, rejected, engine.stats(), engine.take_route_events()))


def _build(config: EngineConfig, tp: tuple[str, int] | None):
    from chunkserve.replicas.engine.llm_engine import LLMEngine

    if config.tp_size == 1:
        return LLMEngine(config)
    from chunkserve.replicas.engine.distributed import init_group
    from chunkserve.replicas.parallel import TPEngine, rank_device

    addr, port = tp
    init_group(0, config.tp_size, addr, port, rank_device(config))
    return TPEngine(LLMEngine(config))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m chunkserve.replicas.engine_process", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--fd", type=int, required=True, help="the replica's end of the pipe (inherited)")
    args = ap.parse_args(argv)
    _die_with_parent()
    core = _Core(Connection(args.fd))
    core.start()
    code = 0
    try:
        core.run()
    except (EOFError, OSError):
        pass  # the replica went away
    except BaseException as e:  # noqa: BLE001 - reported to the replica
        traceback.print_exc()
        code = 1
        try:
            core.send(EngineCrashed(f"{type(e).__name__}: {e}"))
        except OSError:
            pass
    finally:
        if isinstance(core.engine, _tp_engine()):
            core.engine.close()  # end the worker ranks' loops
    os._exit(code)  # (no interpreter teardown: threads, CUDA and process groups go with the process)


def _tp_engine() -> type:
    from chunkserve.replicas.parallel import TPEngine

    return TPEngine


if __name__ == "__main__":
    main()
