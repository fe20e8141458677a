"""`kvstrata serve`: the OpenAI-compatible server over the built-in engine (FastAPI + uvicorn)."""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from typing import Any

from kvstrata.server.config import ServerConfig, add_flags

HELP = "Start the OpenAI-compatible server (flags also from KVSTRATA_<FLAG> environment variables)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser)


def apply_process_settings(config: ServerConfig, log: logging.Logger) -> None:
    """The interpreter settings of the server process: the GIL switch interval and the garbage
    collector's thresholds (at 1,024 streams, Python's default ran a 240-307 ms full collection every
    3.6 s on one H200; docs/engine.md, "1,024 concurrent requests")."""
    if config.switch_interval is not None:
        sys.setswitchinterval(config.switch_interval)
        log.info("GIL switch interval %.6f s", sys.getswitchinterval())
    if config.gc_threshold is not None:
        gc.set_threshold(*config.gc_threshold)
        log.info("garbage collector thresholds %s", gc.get_threshold())


def run(args: argparse.Namespace) -> int:
    config = ServerConfig.from_namespace(args)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log = logging.getLogger("kvstrata.server")
    apply_process_settings(config, log)
    import uvicorn

    from kvstrata import Engine
    from kvstrata.server.app import create_app, freeze_startup_objects
    from kvstrata.server.engine_process import EngineProcess
    from kvstrata.server.transport import uvicorn_options

    try:
        if config.separate_engine():
            engine: Any = EngineProcess(config)
        else:
            engine = Engine(**config.engine_kwargs(), warmup=config.warmup_mode())
    except (ValueError, KeyError, FileNotFoundError) as exc:
        print(f"kvstrata serve: cannot start the engine: {exc}", file=sys.stderr)
        return 2
    try:
        app = create_app(engine, config)
        info = engine.get_server_info()
        transport = uvicorn_options()
        freeze_startup_objects()
        log.info(
            "serving %s on http://%s:%d (kv %s, window %s, %s tokens of KV, auth %s, %s + %s, engine %s)",
            app.state.kvstrata.client.model_name,
            config.host,
            config.port,
            info["kv_cache_dtype"],
            info["recent_window"],
            info["max_total_tokens"],
            "on" if config.api_key else "off",
            transport["loop"],
            transport["http"],
            "in its own process" if isinstance(engine, EngineProcess) else "in this process",
        )
        uvicorn.run(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            access_log=False,
            **transport,
        )
    finally:
        engine.shutdown()
    return 0
