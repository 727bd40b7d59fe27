"""A server over a Session: the engine thread and uvicorn, started and stopped together.

    server = Server(session, port=0)     # binds now (port 0: an ephemeral port), checks every option
    server.run()                         # the CLI: blocks until Ctrl-C, then shuts down cleanly
    server.start(); server.url; server.stop()   # in the background (tests, tools/serve_load.py)

Every option is checked here, before a socket is bound (ConfigurationError; the CLI checks
them before it loads the model): the limits of limits.py, batch, queue, host and port.
Shutdown order: uvicorn stops accepting and lets requests in flight finish (at most
GRACEFUL_SECONDS, the engine still running so they can), then the engine thread fails what
is left with 503 and closes its batcher. The Session belongs to the caller.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import socket
import threading
import time

from .. import validation
from ..errors import ConfigurationError, MissingDependencyError
from .limits import Limits
from .logs import log_to_stderr

DEPENDENCIES = ("starlette", "uvicorn", "jinja2")
GRACEFUL_SECONDS = 10


def require_dependencies() -> None:
    missing = [name for name in DEPENDENCIES if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingDependencyError(f"ortspec serve needs {', '.join(missing)}, which are not installed: "
                                     "pip install 'ortspec[serve]'.")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: one the OS picks), or a ConfigurationError saying why not."""
    if not isinstance(host, str) or not host:
        raise ConfigurationError(f"host={host!r} must be an address such as 127.0.0.1 or 0.0.0.0.")
    port = validation.integer("port", port, ConfigurationError, 0)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except (OSError, OverflowError) as exc:
        raise ConfigurationError(f"cannot listen on {host}:{port} ({exc}); pick another --host or --port.") from None
    return sock


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
LIMIT_OPTIONS = ("request_timeout", "max_body_bytes", "max_prompt_chars", "body_timeout", "header_timeout",
                 "send_timeout", "max_connections")


def check_options(max_batch_size, max_queue, log_level, **limits) -> Limits:
    """The server's options checked (ConfigurationError naming the bad one); returns the limits."""
    validation.integer("max_batch_size", max_batch_size, ConfigurationError, 1)
    validation.integer("max_queue", max_queue, ConfigurationError, 1)
    if log_level not in LOG_LEVELS:
        raise ConfigurationError(f"log_level={log_level!r} is unknown; use one of {', '.join(LOG_LEVELS)}.")
    return Limits(**limits)


class Service:
    """The engine (not started) and the ASGI app over a Session, every option checked: what a
    Server serves on its socket, and what each Ray Serve replica serves (ray.py). engine: None
    for an engine thread over the Session; or an EngineProcess (engine_process.py), session
    then being its Front."""

    def __init__(self, session, max_batch_size: int = 8, max_queue: int = 64, model_name: str | None = None,
                 log_level: str = "warning", engine=None, **limits) -> None:
        require_dependencies()
        from .app import create_app
        from .chat import ChatTemplate
        from .engine import Engine

        self.limits = check_options(max_batch_size, max_queue, log_level, **limits).with_model(session)
        log_to_stderr(log_level)
        self.engine = engine if engine is not None else Engine(session, int(max_batch_size), int(max_queue))
        self.model_name = model_name or session.manifest.dir.name
        self.app = create_app(session, self.engine, self.model_name, self.limits,
                              ChatTemplate.from_model_dir(session.manifest.dir))


def serving(engine):
    """uvicorn's Server class; an engine process's pipe is read on its loop while it serves."""
    import uvicorn

    from .engine_process import EngineProcess

    if not isinstance(engine, EngineProcess):
        return uvicorn.Server

    class Serving(uvicorn.Server):
        async def serve(self, sockets=None) -> None:
            engine.read_on(asyncio.get_running_loop())
            try:
                await super().serve(sockets)
            finally:
                engine.read_off()

    return Serving


class Server:
    def __init__(self, session, host: str = "127.0.0.1", port: int = 8000, max_batch_size: int = 8,
                 max_queue: int = 64, request_timeout: float = 600.0, model_name: str | None = None,
                 log_level: str = "warning", max_body_bytes: int = Limits.max_body_bytes,
                 max_prompt_chars: int | None = None, body_timeout: float = Limits.body_timeout,
                 header_timeout: float = Limits.header_timeout, send_timeout: float = Limits.send_timeout,
                 max_connections: int | None = None, engine=None) -> None:
        require_dependencies()
        import uvicorn

        from .limits import MAX_HEADER_BYTES, http_stack, limited_protocol

        service = Service(session, max_batch_size, max_queue, model_name, log_level, engine, request_timeout=request_timeout,
                          max_body_bytes=max_body_bytes, max_prompt_chars=max_prompt_chars,
                          body_timeout=body_timeout, header_timeout=header_timeout, send_timeout=send_timeout,
                          max_connections=max_connections)
        self.limits, self.engine, self.model_name, app = service.limits, service.engine, service.model_name, service.app
        self.socket = bind(host, port)
        self.host, self.port = host, self.socket.getsockname()[1]
        self.parser, self.loop = http_stack()
        self.uvicorn = serving(self.engine)(uvicorn.Config(
            app, log_level=log_level, lifespan="off", loop=self.loop, ws="none",  # no WebSocket routes: plain HTTP
            http=limited_protocol(self.parser, self.limits),  # its connection cap, not uvicorn's limit_concurrency
            h11_max_incomplete_event_size=MAX_HEADER_BYTES, timeout_graceful_shutdown=GRACEFUL_SECONDS))
        self._thread: threading.Thread | None = None

    @classmethod
    def spawned(cls, model_dir, session_options: dict, **options) -> "Server":
        """A Server whose Session and engine run in a child process (engine_process.py: the HTTP
        side's Python then never waits for the engine's interpreter lock): what ``ortspec serve``
        runs. session_options: Session's keywords; options: this class's. The options are
        checked first, then the child opens the model (its errors raise here)."""
        from ..manifest import Manifest
        from ..prompts import Prompts
        from .engine_process import EngineProcess, Front

        require_dependencies()
        given = inspect.signature(cls).bind(None, **options)
        given.apply_defaults()
        settings = given.arguments
        check_options(settings["max_batch_size"], settings["max_queue"], settings["log_level"],
                      **{name: settings[name] for name in LIMIT_OPTIONS})
        manifest = Manifest.load(validation.model_dir(model_dir))
        engine = EngineProcess(manifest.dir, session_options, settings["max_batch_size"], settings["max_queue"],
                               settings["log_level"])
        ready = engine.start()
        try:
            return cls(Front(Prompts(manifest, ready.reserved), engine), engine=engine, **options)
        except BaseException:
            engine.stop()
            raise

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        """Serves until interrupted (SIGINT / SIGTERM), then shuts down."""
        self.engine.start()
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            self._close()

    def start(self, timeout: float = 30.0) -> "Server":
        """Serves from a background thread; returns once it accepts connections."""
        self.engine.start()
        self._thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.socket]},
                                        name="ortspec-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._close()
                raise RuntimeError(f"the HTTP server did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stops accepting, lets requests in flight finish, then stops the engine (idempotent)."""
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._close()

    def _close(self) -> None:
        self.engine.stop()
        self.socket.close()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
