"""The engine in its own process, as SGLang runs its scheduler: `EngineProcess` starts it and talks to
it over one pipe each way.

Why: in one process, the engine thread and uvicorn's event loop share one GIL. At 256 streams the loop
spends about as much CPU a step as the engine's own host work, and each waits on the other (measured
on CPU, docs/server.md, "The engine in its own process"; on one H200 the fp8 decode step went
host-bound and clients saw tokens two steps at a time). In its own process the engine thread plans,
launches and reads back without the loop, and the loop writes chunks without the engine.

Protocol (pickled tuples):

- server -> engine: ``("submit", key, kwargs)`` (answered by ``("accepted", key, rids | exception)``),
  ``("abort", rid)``, ``("call", key, method, args)`` (a method of the engine side's `EngineClient`,
  answered by ``("reply", key, ok, value | exception)``), ``("shutdown",)``.
- engine -> server: ``("ready", info)`` once loaded, or ``("failed", exception)``; ``("chunks", [(key,
  chunk), ...])`` once per engine step (the engine thread's mailbox flush: one write and one wake-up of
  the server's reader a step, however many streams); ``("event", event)`` for `Engine.subscribe`;
  ``("closed",)`` after shutdown.

The server side reads on its own thread and hands each step's chunks to the event loop with one
``call_soon_threadsafe``. If the engine process dies, every open stream ends with an abort and later
calls answer 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvstrata.server.config import ServerConfig

log = logging.getLogger("kvstrata.server")
ENGINE_EXITED = "the engine process exited"
# methods of the engine side's EngineClient the server may call (everything else stays local)
REMOTE_METHODS = frozenset(
    {"snapshot", "pin", "unpin", "flush_cache", "image_token_id", "image_extra_tokens", "image_limits"}
)


class EngineUnavailable(RuntimeError):
    """The engine process is gone (or not answering): the server answers 503."""


PIPE_BYTES = 1 << 20  # a step's chunks at 1,024 streams (~150 KB) in one write, not 64 KiB at a time


def _dump(message: tuple[Any, ...]) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def _write(conn: Connection, lock: threading.Lock, data: bytes) -> None:
    with lock:
        conn.send_bytes(data)


def _send(conn: Connection, lock: threading.Lock, message: tuple[Any, ...]) -> None:
    _write(conn, lock, _dump(message))  # pickled before the lock: other writers wait only for the write


def _pipe() -> tuple[int, int]:
    """An OS pipe, widened where the kernel allows it (Linux, up to its pipe-max-size)."""
    read_fd, write_fd = os.pipe()
    with contextlib.suppress(ImportError, AttributeError, OSError):
        import fcntl

        fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    return read_fd, write_fd


def _picklable(exc: BaseException) -> BaseException:
    """``exc`` if it survives a round trip through pickle, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


# ============================================================== engine side (the child process)
class PipeMailbox:
    """The engine thread's chunks for the server, sent once per step (the `LoopMailbox` interface:
    `EngineCore._deliver` registers it, `EngineCore._flush_outbox` calls `flush`)."""

    def __init__(self, conn: Connection, lock: threading.Lock) -> None:
        self.conn = conn
        self.lock = lock
        self.items: list[tuple[int, dict[str, Any]]] = []

    def flush(self) -> None:
        items, self.items = self.items, []  # engine thread only: no lock needed
        if items:
            with contextlib.suppress(OSError):  # the server is gone: nobody listens
                _send(self.conn, self.lock, ("chunks", items))


class PipeSink:
    """A request's result callback on the engine side: its chunks go out under the stream's key."""

    __slots__ = ("key", "mailbox")

    def __init__(self, mailbox: PipeMailbox, key: int) -> None:
        self.mailbox = mailbox
        self.key = key

    def __call__(self, chunk: dict[str, Any]) -> None:
        self.mailbox.items.append((self.key, chunk))


def child_main(inbox_fd: int, outbox_fd: int) -> None:
    """The engine process's entry point (``python -c``, so no ``__main__`` module is re-run as
    multiprocessing's spawn does): the config arrives first on the pipe."""
    for fd in (inbox_fd, outbox_fd):  # a process the engine starts must not hold the server's pipes open
        os.set_inheritable(fd, False)
    inbox, outbox = Connection(inbox_fd, writable=False), Connection(outbox_fd, readable=False)
    try:
        _, config, hook = pickle.loads(inbox.recv_bytes())
    except (EOFError, OSError):
        return
    engine_main(config, inbox, outbox, hook)


def _exit_if_orphaned(parent: int, loaded: threading.Event) -> None:
    """Until the engine is loaded (its pipe is not read before), end this process if the server dies:
    loading an 8B model and warming it up takes a minute of GPU memory nobody would use."""
    while not loaded.wait(1.0):
        if os.getppid() != parent:
            os._exit(1)


def _call_hook(hook: str, engine: Any) -> None:
    """``"module:function"``: ``function(engine)`` on the built engine (benchmarks replace its step)."""
    import importlib

    module, _, name = hook.partition(":")
    getattr(importlib.import_module(module), name)(engine)


def engine_main(config: ServerConfig, inbox: Connection, outbox: Connection, hook: str | None = None) -> None:
    """The engine process: build the engine as `kvstrata serve` would, then serve the server's commands.
    The server owns its lifetime: SIGINT and SIGTERM (a Ctrl-C or a ``kill`` of the process group) are
    left to the server, which then asks for a shutdown (so the engine's step timeline is closed whole);
    a server gone without asking closes the pipe, which ends this process the same way."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s"
    )
    from kvstrata import Engine
    from kvstrata.server.app import freeze_startup_objects
    from kvstrata.server.cli import apply_process_settings
    from kvstrata.server.engine_client import EngineClient

    lock = threading.Lock()
    loaded = threading.Event()
    threading.Thread(target=_exit_if_orphaned, args=(os.getppid(), loaded), daemon=True).start()
    apply_process_settings(config, log)
    try:
        engine = Engine(**config.engine_kwargs(), warmup=config.warmup_mode())
        client = EngineClient(engine, config.served_model_name, config.context_length)
        if hook is not None:
            _call_hook(hook, engine)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            _send(outbox, lock, ("failed", _picklable(exc)))
        return
    finally:
        loaded.set()
    mailbox = PipeMailbox(outbox, lock)
    workers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvstrata-rpc")

    def forward(event: object) -> None:
        with contextlib.suppress(OSError):
            _send(outbox, lock, ("event", event))

    def call(key: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            if method not in REMOTE_METHODS:
                raise AttributeError(f"not an engine method: {method}")
            data = _dump(("reply", key, True, getattr(client, method)(*args)))
        except BaseException as exc:  # a result that does not pickle is an error too
            data = _dump(("reply", key, False, _picklable(exc)))
        with contextlib.suppress(OSError):
            _write(outbox, lock, data)

    engine.subscribe(forward)
    info = {
        "tokenizer": getattr(engine.tokenizer, "inner", engine.tokenizer),
        "server_info": engine.get_server_info(),
    }
    freeze_startup_objects()
    try:
        _send(outbox, lock, ("ready", info))
        while True:
            try:
                message = pickle.loads(inbox.recv_bytes())
            except (EOFError, OSError):  # the server is gone
                break
            kind = message[0]
            if kind == "submit":
                key, kwargs = message[1], message[2]
                try:
                    rids = engine.submit(sink=PipeSink(mailbox, key), **kwargs)
                    reply: tuple[Any, ...] = ("accepted", key, rids)
                except Exception as exc:
                    reply = ("accepted", key, _picklable(exc))
                _send(outbox, lock, reply)
            elif kind == "abort":
                engine.abort(message[1])
            elif kind == "call":
                workers.submit(call, *message[1:])
            elif kind == "shutdown":
                break
    except OSError:  # the server is gone
        pass
    finally:
        workers.shutdown(wait=False, cancel_futures=True)
        engine.shutdown()
        with contextlib.suppress(OSError):
            _send(outbox, lock, ("closed",))


# ============================================================== server side
class RemoteStream:
    """``async for chunk in stream``: one `submit`'s chunks, in the engine's order; ``aclose()`` aborts
    what has not finished (as ``Engine.async_generate(stream=True)``'s generator does). Its state
    changes on its event loop only: the reader thread hands everything over with ``call_soon_threadsafe``."""

    def __init__(
        self, owner: EngineProcess, key: int, loop: asyncio.AbstractEventLoop, group_rids: list[str] | None
    ) -> None:
        self.owner = owner
        self.key = key
        self.loop = loop
        self.group_rids = list(group_rids or [])  # what to abort before the engine names its requests
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.accepted: asyncio.Future[list[str]] = loop.create_future()
        self.index: dict[str, int] = {}
        self.unfinished: set[str] = set()
        self.closed = False

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self.closed:
            raise StopAsyncIteration
        await self.wait_accepted()
        while self.unfinished:
            chunk = await self.queue.get()
            rid = chunk["meta_info"]["id"]
            if rid not in self.unfinished:  # an abort for a request whose finish came first
                continue
            chunk["index"] = self.index[rid]
            if chunk["finished"]:
                self.unfinished.discard(rid)
                if not self.unfinished:
                    self.owner.streams.pop(self.key, None)
            return chunk
        raise StopAsyncIteration

    async def wait_accepted(self) -> None:
        """Raise what the engine raised at submission (``ValueError`` for bad input)."""
        await asyncio.shield(self.accepted)

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.owner.streams.pop(self.key, None)
        if not self.accepted.done():
            self.accepted.cancel()
            pending = self.group_rids  # the engine may still take them: the abort follows the submit
        else:
            pending = sorted(self.unfinished)
        for rid in pending:
            self.owner.abort(rid)

    # --- on the loop, from the reader thread -----------------------------------------------------
    def _accept(self, result: list[str] | BaseException) -> None:
        if self.accepted.done():
            return
        if isinstance(result, BaseException):
            self.owner.streams.pop(self.key, None)
            self.accepted.set_exception(result)
            return
        self.index = {rid: i for i, rid in enumerate(result)}
        self.unfinished = set(result)
        self.accepted.set_result(result)

    def _fail(self, message: str) -> None:
        """The engine is gone: every request not finished yet ends aborted."""
        self._accept(EngineUnavailable(message))
        for rid in self.unfinished:
            reason = {"type": "abort", "message": message}
            meta = {"id": rid, "finish_reason": reason, "prompt_tokens": 0, "completion_tokens": 0}
            self.queue.put_nowait({"text": "", "output_ids": [], "meta_info": meta, "finished": True})


class EngineProcess:
    """The server's handle on an engine running in a child process (``kvstrata serve
    --engine-process``). Offers what `EngineClient` needs of an `Engine`: ``tokenizer``,
    ``get_server_info()``, ``apply_chat_template()``, ``async_generate(stream=True)``, ``abort()``,
    ``subscribe()``, ``shutdown()``; and ``call(method, *args)`` for the engine side's `EngineClient`."""

    def __init__(
        self, config: ServerConfig, start_timeout: float | None = None, engine_hook: str | None = None
    ) -> None:
        """Start the engine process and wait until its engine is built (and warmed up); raise what its
        construction raised. ``engine_hook`` (``"module:function"``) is called there with the engine
        before it serves."""
        from kvstrata.engine.tokenizer import thread_safe

        # A fresh interpreter (CUDA cannot be used in a forked child), given the pipes' ends by number;
        # -P and the server's own package root: the child imports the kvstrata the server runs, never
        # one in its working directory.
        to_engine_r, to_engine_w = _pipe()
        from_engine_r, from_engine_w = _pipe()
        root = str(Path(__file__).resolve().parents[2])
        entry = (
            f"import sys; sys.path.insert(0, {root!r}); "
            "from kvstrata.server.engine_process import child_main; child_main(*map(int, sys.argv[1:]))"
        )
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-P", "-c", entry, str(to_engine_r), str(from_engine_w)],
                pass_fds=(to_engine_r, from_engine_w),
            )
        except BaseException:
            for fd in (to_engine_w, from_engine_r):
                os.close(fd)
            raise
        finally:
            os.close(to_engine_r)
            os.close(from_engine_w)
        self._to_engine = Connection(to_engine_w, readable=False)
        self._from_engine = Connection(from_engine_r, writable=False)
        self._send_lock = threading.Lock()
        self._dead_lock = threading.Lock()
        self._keys = itertools.count()
        self.streams: dict[int, RemoteStream] = {}
        self._calls: dict[int, Future[Any]] = {}
        self._subscribers: list[Callable[[object], None]] = []
        self.alive = True
        self._closed = threading.Event()
        try:
            self._post(("config", config, engine_hook))
            info = self._wait_ready(start_timeout)
        except BaseException:
            self.alive = False
            self.process.kill()
            self.process.wait(10)
            self._to_engine.close()
            self._from_engine.close()
            raise
        self.tokenizer = thread_safe(info["tokenizer"])
        self.server_info: dict[str, Any] = info["server_info"]
        self._reader = threading.Thread(target=self._read, name="kvstrata-engine-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout: float | None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._from_engine.poll(0.2):
            if self.process.poll() is not None:
                break  # what it wrote before it went is still read below
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the engine process did not start in {timeout} s")
        try:
            message = pickle.loads(self._from_engine.recv_bytes())
        except (EOFError, OSError):
            code = self.process.wait(30)
            raise RuntimeError(f"the engine process exited while starting (exit code {code})") from None
        if message[0] == "failed":
            raise message[1]
        return message[1]

    # --- Engine's surface -------------------------------------------------------------------------
    def get_server_info(self) -> dict[str, Any]:
        return dict(self.server_info)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tokenize: bool = False
    ) -> Any:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize
        )

    def async_generate(
        self,
        input_ids: list[list[int]],
        sampling_params: dict[str, Any],
        stream: bool = True,
        rid: list[str] | None = None,
        image_data: Any = None,
    ) -> RemoteStream:
        """Submit on the event loop; the engine's answer (its rids, or a ``ValueError``) arrives
        without blocking the loop: ``await stream.wait_accepted()``."""
        if not stream:
            raise ValueError("the engine process streams: pass stream=True")
        loop = asyncio.get_running_loop()
        key = next(self._keys)
        remote = RemoteStream(self, key, loop, rid)
        self.streams[key] = remote
        try:
            if not self.alive:
                raise EngineUnavailable(ENGINE_EXITED)
            kwargs = {"input_ids": input_ids, "sampling_params": sampling_params, "rid": rid}
            self._post(("submit", key, {**kwargs, "image_data": image_data}))
        except EngineUnavailable as exc:  # answered by wait_accepted(), as a refusal would be
            remote._accept(exc)
        return remote

    def abort(self, rid: str) -> None:
        if self.alive:
            with contextlib.suppress(EngineUnavailable):  # the engine is gone: nothing runs any more
                self._post(("abort", rid))

    def subscribe(self, fn: Callable[[object], None]) -> Callable[[], None]:
        self._subscribers.append(fn)
        return lambda: self._subscribers.remove(fn) if fn in self._subscribers else None

    def call(self, method: str, *args: Any, timeout: float = 300.0) -> Any:
        """Run ``method(*args)`` of the engine side's `EngineClient` and return (or raise) its result;
        `EngineUnavailable` when the engine is gone or does not answer within ``timeout`` s. Blocks:
        not on the event loop (use ``asyncio.to_thread``)."""
        key = next(self._keys)
        future: Future[Any] = Future()
        self._calls[key] = future  # before the check: a death after it fails this future too
        try:
            if not self.alive:
                raise EngineUnavailable(ENGINE_EXITED)
            self._post(("call", key, method, args))
            try:
                return future.result(timeout)
            except TimeoutError:
                raise EngineUnavailable(
                    f"the engine process did not answer {method} in {timeout} s"
                ) from None
        finally:
            self._calls.pop(key, None)

    def shutdown(self, timeout: float = 60.0) -> None:
        """Ask the engine to shut down (its requests end aborted), wait for it, then stop it anyway."""
        if self.alive:
            with contextlib.suppress(EngineUnavailable):
                self._post(("shutdown",))
            self._closed.wait(timeout)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not exit: killing it")
            self.process.kill()
            self.process.wait(10)
        self._mark_dead(ENGINE_EXITED)
        self._to_engine.close()

    def _post(self, message: tuple[Any, ...]) -> None:
        try:
            _send(self._to_engine, self._send_lock, message)
        except OSError as exc:
            self._mark_dead(ENGINE_EXITED)
            raise EngineUnavailable(ENGINE_EXITED) from exc

    # --- the reader thread ------------------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                try:
                    message = pickle.loads(self._from_engine.recv_bytes())
                except (EOFError, OSError):
                    break
                if message[0] == "closed":
                    break
                self._handle(message)
        except Exception:
            log.exception("reading the engine process's pipe failed")
        finally:
            if self.process.poll() not in (None, 0):
                log.error("the engine process exited with code %s", self.process.returncode)
            self._mark_dead(ENGINE_EXITED)

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "chunks":
            self._dispatch(message[1])
        elif kind == "accepted":
            stream = self.streams.get(message[1])
            if stream is not None:
                self._on_loop(stream.loop, stream._accept, message[2])
        elif kind == "reply":
            future = self._calls.get(message[1])
            if future is not None:
                _settle(future, message[3], ok=message[2])
        elif kind == "event":
            for fn in list(self._subscribers):
                try:
                    fn(message[1])
                except Exception:
                    log.exception("an engine event subscriber failed")

    def _dispatch(self, items: list[tuple[int, dict[str, Any]]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RemoteStream, dict[str, Any]]]] = {}
        for key, chunk in items:
            stream = self.streams.get(key)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, chunk))
        for loop, pairs in by_loop.items():
            self._on_loop(loop, _put_all, pairs)

    def _mark_dead(self, message: str) -> None:
        with self._dead_lock:
            if not self.alive:
                return
            self.alive = False
        self._closed.set()
        for future in list(self._calls.values()):
            _settle(future, EngineUnavailable(message), ok=False)
        for stream in list(self.streams.values()):
            self._on_loop(stream.loop, stream._fail, message)

    @staticmethod
    def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
            loop.call_soon_threadsafe(fn, *args)


def _settle(future: Future[Any], value: Any, ok: bool) -> None:
    """Resolve a call's future once (its answer and an engine's death may race)."""
    with contextlib.suppress(InvalidStateError):
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)


def _put_all(pairs: list[tuple[RemoteStream, dict[str, Any]]]) -> None:
    for stream, chunk in pairs:
        stream.queue.put_nowait(chunk)
