"""The server's host time per decode step, on CPU: `kvstrata serve`'s real HTTP path and engine
thread over a model step that costs a fixed, known time.

    PYTHONPATH=. .venv/bin/python benchmarks/server_overhead.py [--streams 64 256] [--step-ms 30]
        [--output-len 160] [--profile]

For each N in --streams, a server process (the real `create_app` + uvicorn + `kvstrata.Engine`, its
scheduler and cache) is started whose model step is replaced by a fixed wait of --step-ms (a sleep,
which releases the GIL as a GPU sync does) returning random token ids of the SmolLM2 vocabulary,
as a random-weight model does. `kvstrata bench` (another process) then streams N requests at
concurrency N. Reported, for the steps where all N streams decode:

- ``step interval``: from one step's start to the next one's (the engine side's ITL);
- ``host/step``: interval - step-ms, the time the GPU would wait on the host every step;
- ``engine CPU``: CPU time of the engine thread per step outside the step (the rest of host/step
  is the engine thread waiting for the GIL or a core while the HTTP event loop runs);
- ``loop CPU``: CPU time of the HTTP event loop's thread per step (parsing, JSON, socket writes of
  N chunks; divided by N: ``loop us/chunk``). It competes with the engine thread for the GIL: with a
  step shorter than it (a fast GPU at large N) it is host time the GPU waits on;
- the client's median ITL and output tokens/s, and their excess over step-ms (the baseline: a
  server with no host work would stream one token per stream every step-ms).

With --profile the server also writes a cProfile of the event-loop thread and of the engine thread
(top functions by own time), printed after the table. The machine's other load shows in every figure;
compare runs of the same invocation. For a before/after, run this file with another checkout's
package first on PYTHONPATH (one without `set_flush_at_sync` runs as it is).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TINY_GEOMETRY = {
    "num_hidden_layers": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
}


def tiny_model_dir(root: Path) -> Path:
    """The embedded model's tokenizer with a one-layer config: its weights are never used."""
    from kvstrata.engine.loader import converted_dir
    from kvstrata.resources import default_model_path

    source = converted_dir(default_model_path())
    target = root / "tiny-smollm2"
    target.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, target / name)
    config = json.loads((source / "config.json").read_text())
    config.update(TINY_GEOMETRY)
    (target / "config.json").write_text(json.dumps(config))
    return target


class FixedStep:
    """Stands in for `StepRunner.run`: waits ``step_s`` and samples random ids; records step times."""

    def __init__(self, runner: Any, step_s: float, vocab: int, streams: int) -> None:
        self.runner, self.step_s, self.vocab, self.streams = runner, step_s, vocab, streams
        self.rng = random.Random(0)
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.cpu_starts: list[float] = []
        self.cpu_ends: list[float] = []
        self.full: list[bool] = []  # every stream decodes one token in this step
        # uvicorn's loop (None in an engine process: the loop runs in the server's)
        self.loop_clock: int | None = time.pthread_getcpuclockid(threading.main_thread().ident or 0)
        self.loop_cpu: list[float] = []

    def __call__(self, plan: Any) -> tuple[list[Any], Any, None]:
        from kvstrata.engine.sampler import SampleOutput

        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.thread_time())
        if self.loop_clock is not None:
            self.loop_cpu.append(time.clock_gettime(self.loop_clock))
        self.full.append(len(plan.reqs) == self.streams and all(n == 1 for n in plan.n_new))
        sampled = [r for r, n in zip(plan.reqs, plan.n_new, strict=True) if r.computed + n == r.tokens_len]
        before_sync = getattr(self.runner.sampler, "before_sync", None)  # None before it existed
        if before_sync is not None:  # as the sampler does once the step is launched
            before_sync()
        time.sleep(self.step_s)
        cache = self.runner.cache
        plan.batch.layers_done.update(range(cache.cfg.num_layers))  # no K/V written: never read
        cache.end_step(plan.batch)
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.thread_time())
        tokens = [self.rng.randrange(3, self.vocab) for _ in sampled]
        return sampled, SampleOutput(tokens=tokens, invalid=[False] * len(sampled)), None

    def summary(self) -> dict[str, Any]:
        """Medians over consecutive full decode steps (step i's start to step i+1's start)."""
        intervals, cpu, loop = [], [], []
        for i in range(len(self.starts) - 1):
            if self.full[i] and self.full[i + 1]:
                intervals.append(self.starts[i + 1] - self.starts[i])
                cpu.append(self.cpu_starts[i + 1] - self.cpu_ends[i])
                if self.loop_cpu:
                    loop.append(self.loop_cpu[i + 1] - self.loop_cpu[i])
        return {
            "steps": len(self.starts),
            "full_steps": len(intervals),
            "interval_ms": 1e3 * statistics.median(intervals) if intervals else float("nan"),
            "engine_cpu_ms": 1e3 * statistics.median(cpu) if cpu else float("nan"),
            "loop_cpu_ms": 1e3 * statistics.median(loop) if loop else float("nan"),
        }


def profile_report(prof: cProfile.Profile, title: str, top: int) -> str:
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
    return f"--- {title}: top {top} by own time\n" + "\n".join(lines[-(top + 1) :])


FIXED_STEP_ENV = "KVSTRATA_BENCH_FIXED_STEP"


def attach_fixed_step(engine: Any, step_ms: float, streams: int, flush: str) -> FixedStep:
    """Replace ``engine``'s model step by a `FixedStep`, with chunks handed over as ``flush`` says."""
    if hasattr(engine.core, "set_flush_at_sync"):  # a checkout before it: the baseline
        engine.core.set_flush_at_sync(flush == "at-sync")
    step = FixedStep(engine.core.runner, step_ms / 1e3, engine.config.vocab_size, streams)
    engine.core.runner.run = step
    return step


def run_until_interrupted(server: Any, on_stop: Callable[[], None]) -> float:
    """Run a uvicorn server until the SIGINT that stops it, then ``on_stop()``; returns the CPU seconds
    this thread (the event loop's) spent in it."""
    start = time.thread_time()
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT that stopped it
        pass
    finally:
        loop_cpu = time.thread_time() - start
        on_stop()
    return loop_cpu


def install_fixed_step(engine: Any) -> None:
    """`EngineProcess`'s engine hook (in the engine process): the fixed step of ``FIXED_STEP_ENV``'s
    settings; its summary is written to their result file when the engine shuts down."""
    opts = json.loads(os.environ[FIXED_STEP_ENV])
    step = attach_fixed_step(engine, opts["step_ms"], opts["streams"], opts["flush"])
    step.loop_clock = None
    shutdown = engine.shutdown

    def shutdown_and_report() -> None:
        shutdown()
        Path(opts["result"]).write_text(json.dumps(step.summary()))

    engine.shutdown = shutdown_and_report


def engine_setup(args: argparse.Namespace, n: int) -> tuple[int, dict[str, Any]]:
    """Pool and prefill sizes for ``n`` streams: (max total tokens, engine keyword arguments)."""
    per_seq = args.input_len + args.output_len + 64
    return n * per_seq + 1024, {
        "kv_cache_dtype": "auto",
        "max_running_requests": n,
        "chunked_prefill_size": n * args.input_len,
        "kv_plan": "off",
    }


def serve_engine_process(args: argparse.Namespace) -> dict[str, Any]:
    """`serve` with the engine in its own process (`kvstrata serve --engine-process on`)."""
    import uvicorn

    from kvstrata.server.app import create_app, freeze_startup_objects
    from kvstrata.server.config import ServerConfig
    from kvstrata.server.engine_process import EngineProcess
    from kvstrata.server.transport import uvicorn_options

    n = args.streams[0]
    total, kwargs = engine_setup(args, n)
    config = ServerConfig(
        model=args.model_dir, load_format="dummy", max_total_tokens=total, skip_server_warmup=True, **kwargs
    )
    engine_result = Path(args.result).with_suffix(".engine.json")
    os.environ[FIXED_STEP_ENV] = json.dumps(
        {"step_ms": args.step_ms, "streams": n, "flush": args.flush, "result": str(engine_result)}
    )
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    engine = EngineProcess(config, engine_hook="server_overhead:install_fixed_step")
    app = create_app(engine, config)
    freeze_startup_objects()
    transport = uvicorn_options()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning", **transport)
    )
    loop_cpu = run_until_interrupted(server, engine.shutdown)
    result = json.loads(engine_result.read_text())
    result["loop_cpu_total_s"] = loop_cpu
    result["transport"] = f"loop {transport['loop']}, {transport['http']}, engine in its own process"
    result["profile"] = []
    return result


def serve(args: argparse.Namespace) -> None:
    """The server process: engine with a fixed-time step, the real app, uvicorn on --port."""
    if args.engine_process:
        Path(args.result).write_text(json.dumps(serve_engine_process(args)))
        return
    import uvicorn

    from kvstrata.engine import core as core_module
    from kvstrata.engine.engine import Engine
    from kvstrata.engine.loader import load_model
    from kvstrata.server.app import create_app
    from kvstrata.server.config import ServerConfig

    profiles: dict[str, cProfile.Profile] = {}
    if args.profile:
        loop_fn = core_module.EngineCore._loop

        def profiled_loop(self: Any) -> None:
            prof = profiles["engine thread"] = cProfile.Profile()
            prof.enable()
            try:
                loop_fn(self)
            finally:
                prof.disable()

        core_module.EngineCore._loop = profiled_loop  # type: ignore[method-assign]
    if os.environ.get("SWITCH_INTERVAL"):
        sys.setswitchinterval(float(os.environ["SWITCH_INTERVAL"]))
    n = args.streams[0]
    model = load_model(args.model_dir, load_format="dummy", device="cpu")
    total, kwargs = engine_setup(args, n)
    engine = Engine(model, max_total_tokens=total, **kwargs)
    step = attach_fixed_step(engine, args.step_ms, n, args.flush)
    app = create_app(engine, ServerConfig())
    with contextlib.suppress(ImportError):  # a checkout before it: no freeze, as its server did
        from kvstrata.server.app import freeze_startup_objects

        freeze_startup_objects()  # as `kvstrata serve` does before it listens
    try:
        from kvstrata.server.transport import uvicorn_options
    except ImportError:  # a checkout before it: uvicorn's defaults
        transport = {}
    else:
        transport = uvicorn_options()
    config = uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning", **transport)
    server = uvicorn.Server(config)
    if args.profile:
        prof = profiles["event loop thread"] = cProfile.Profile()
        prof.enable()

    def stop() -> None:
        if args.profile:
            profiles["event loop thread"].disable()
        engine.shutdown()

    loop_cpu = run_until_interrupted(server, stop)
    result = step.summary()
    result["loop_cpu_total_s"] = loop_cpu
    result["transport"] = f"loop {transport.get('loop', config.loop)}, {config.http_protocol_class.__name__}"
    result["profile"] = [profile_report(p, name, args.top) for name, p in profiles.items()]
    Path(args.result).write_text(json.dumps(result))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_health(port: int, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("server not ready")


def measure(args: argparse.Namespace, n: int, model_dir: Path, work: Path) -> dict[str, Any]:
    port = free_port()
    result_file = work / f"server_{n}.json"
    bench_file = work / f"bench_{n}.jsonl"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, __file__, "--serve", "--model-dir", str(model_dir), "--port", str(port),
           "--streams", str(n), "--step-ms", str(args.step_ms), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--result", str(result_file),
           "--top", str(args.top), "--flush", args.flush]  # fmt: skip
    if args.profile:
        cmd.append("--profile")
    if args.engine_process:
        cmd.append("--engine-process")
    server = subprocess.Popen(cmd, env=env)
    try:
        wait_health(port, server)
        subprocess.run(
            [sys.executable, "-m", "kvstrata", "bench", "--base-url", f"http://127.0.0.1:{port}",
             "--tokenizer", str(model_dir), "--dataset-name", "random-ids",
             "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
             "--random-range-ratio", "1.0", "--num-prompts", str(n), "--max-concurrency", str(n),
             "--seed", "1", "--warmup-requests", "1", "--disable-tqdm", "--output-file", str(bench_file)],
            env=env, check=True, stdout=subprocess.DEVNULL, timeout=args.timeout,
        )  # fmt: skip
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)
    result = json.loads(result_file.read_text())
    result["bench"] = json.loads(bench_file.read_text().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--step-ms", type=float, default=30.0, help="the model step's fixed cost")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=160)
    ap.add_argument(
        "--flush",
        choices=("at-sync", "after-step"),
        default="at-sync",
        help="where the engine hands chunks to the loop: as on CUDA (at-sync) or on CPU (after-step)",
    )
    ap.add_argument("--profile", action="store_true", help="cProfile the event loop and engine threads")
    ap.add_argument(
        "--engine-process",
        action="store_true",
        help="the engine in its own process (kvstrata serve --engine-process on); loop CPU is then only "
        "the run's mean (the loop is in another process than the step's clock readings)",
    )
    ap.add_argument("--timeout", type=float, default=300, help="seconds one bench run may take")
    ap.add_argument("--top", type=int, default=25, help="profile lines per thread")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.profile and args.engine_process:
        ap.error("--profile profiles the threads of one process: leave out --engine-process")
    if args.serve:
        serve(args)
        return
    rows, profiles, transports = [], [], set()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model_dir(Path(tmp))
        for n in args.streams:
            r = measure(args, n, model_dir, Path(tmp))
            b = r["bench"]
            rows.append(
                f"| {n} | {args.step_ms:.1f} | {r['full_steps']} | {r['interval_ms']:.1f} "
                f"| {r['interval_ms'] - args.step_ms:.1f} | {r['engine_cpu_ms']:.1f} "
                f"| {r['loop_cpu_ms']:.1f} | {1e3 * r['loop_cpu_ms'] / n:.0f} "
                f"| {1e3 * r['loop_cpu_total_s'] / max(r['steps'], 1):.1f} "
                f"| {b['median_itl_ms']:.1f} | {b['median_itl_ms'] - args.step_ms:.1f} "
                f"| {b['output_throughput']:,.0f} | {n * 1e3 / args.step_ms:,.0f} |"
            )
            profiles.extend(f"=== {n} streams\n{p}" for p in r["profile"])
            transports.add(r["transport"])
    for p in profiles:
        print(p)
    print("server:", "; ".join(sorted(transports)))
    print(
        "| streams | step ms | full steps | step interval ms | host/step ms | engine CPU ms | loop CPU ms "
        "| loop us/chunk | loop CPU ms/step, run mean "
        "| client median ITL ms | ITL - step ms | output tok/s | baseline tok/s (N / step) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    threading.current_thread().name = "main"
    main()
