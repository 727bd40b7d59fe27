"""Scale-out on Ray Serve: N replicas, each a Session with its own engine thread behind the
same OpenAI routes (app.py, wrapped with ``serve.ingress``), Serve's router spreading requests.

    ortspec serve out/model --replicas 2 --threads 1      # CPU: 2 replicas, 1 core each
    ortspec serve out/model --replicas 4 --provider cuda  # one replica per GPU
    with deploy("out/model", replicas=2, port=8000) as served:   # from Python
        served.url

A replica asks Ray for one GPU (provider cuda) or for --threads CPUs (default 1), so Ray
places replicas where those are free; the model directory must exist at the same path on each
node. Every response names its replica in the ``x-ortspec-replica`` header (and /health does).
Serve's proxy, not ours, handles connections: the body and prompt limits hold (the app checks
them), the header and send timeouts are Serve's own, and --max-connections is refused (nothing
here could enforce it). Needs the ray extra (pip install 'ortspec[ray]').
"""

from __future__ import annotations

import importlib.util
import signal
import threading

from .. import validation
from ..errors import ConfigurationError, MissingDependencyError
from .server import check_options, require_dependencies

APP_NAME = "ortspec"
REPLICA_HEADER = b"x-ortspec-replica"


def require_ray() -> None:
    require_dependencies()
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise MissingDependencyError("ortspec serve --replicas runs on Ray Serve, which is not installed: "
                                     "pip install 'ortspec[ray]'.")


class Replica:
    """One replica: a Session, its engine thread and the routes. Serve builds the app after the
    constructor (``__serve_build_asgi_app__``), and calls ``__del__`` when it stops the replica."""

    def __init__(self, model_dir: str, session_options: dict, service_options: dict) -> None:
        from ray import serve

        from ..session import Session
        from .server import Service

        self.replica_id = serve.get_replica_context().replica_tag
        self.session = Session(model_dir, **session_options)
        self.service = Service(self.session, **service_options)
        self.service.engine.start()

    def __serve_build_asgi_app__(self):
        return with_header(self.service.app, REPLICA_HEADER, self.replica_id.encode())

    def __del__(self) -> None:
        service, session = getattr(self, "service", None), getattr(self, "session", None)
        if service is not None:
            service.engine.stop()
        if session is not None:
            session.close()


def with_header(app, name: bytes, value: bytes):
    """The ASGI app with one more header on every HTTP response."""

    async def wrapped(scope, receive, send):
        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (name, value)]}
            await send(message)

        await app(scope, receive, send_with_header if scope["type"] == "http" else send)

    return wrapped


class Deployed:
    """A running deployment: ``url``, and ``stop()`` (or the end of a with block) deletes it,
    shutting Serve and Ray down where deploy started them."""

    def __init__(self, url: str, replicas: int, started_ray: bool) -> None:
        self.url, self.replicas, self._started_ray = url, replicas, started_ray

    def stop(self) -> None:
        import ray
        from ray import serve

        serve.delete(APP_NAME)
        if self._started_ray:
            serve.shutdown()
            ray.shutdown()

    def run(self) -> None:
        """Serves until SIGINT / SIGTERM, then stops."""
        stopping = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stopping.set())
        try:
            stopping.wait()
        finally:
            self.stop()

    def __enter__(self) -> "Deployed":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def deploy(model_dir, replicas: int = 2, host: str = "127.0.0.1", port: int = 8000, address: str | None = None,
           provider: str = "cpu", threads: int | None = None, num_speculative_tokens=0, commit: str = "select",
           exact: bool = False, exact_batch_size: int = 16, max_batch_size: int = 8, max_queue: int = 64,
           model_name: str | None = None, log_level: str = "warning", prefill_thread: bool | None = None,
           **limits) -> Deployed:
    """Deploys `replicas` replicas of ortspec serve on Ray Serve, listening on host:port (Serve's
    proxy), and returns once every replica serves. address: an existing Ray cluster ("auto", or
    "ray://head:10001"); None starts a local one. threads: CPU cores per replica (provider cpu).
    The rest as for ``ortspec serve``; every option is checked before Ray starts."""
    require_ray()
    replicas = validation.integer("replicas", replicas, ConfigurationError, 1)
    cpus = validation.integer("threads", 1 if threads is None else threads, ConfigurationError, 1)
    check_options(max_batch_size, max_queue, log_level, **limits)
    if limits.pop("max_connections", None) is not None:
        raise ConfigurationError("max_connections bounds ortspec's own HTTP server, and with --replicas Ray Serve's "
                                 "proxy holds the connections; leave --max-connections out (bound Serve's proxy "
                                 "instead, or put a proxy in front).")
    validation.model_dir(model_dir)
    import ray
    from ray import serve

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=address, include_dashboard=False, log_to_driver=log_level in ("info", "debug"))
    _check_resources(ray.cluster_resources(), replicas, provider, cpus)
    session_options = dict(provider=provider, threads=cpus if provider == "cpu" else threads,
                           num_speculative_tokens=num_speculative_tokens,
                           commit=commit, exact=exact, exact_batch_size=exact_batch_size, prefill_thread=prefill_thread)
    service_options = dict(max_batch_size=max_batch_size, max_queue=max_queue, model_name=model_name,
                           log_level=log_level, **limits)
    deployment = serve.deployment(serve.ingress()(Replica), name=APP_NAME, num_replicas=replicas,
                                  ray_actor_options={"num_gpus": 1} if provider == "cuda" else {"num_cpus": cpus},
                                  max_ongoing_requests=max_batch_size + max_queue)
    serve.start(http_options={"host": host, "port": port})
    serve.run(deployment.bind(str(model_dir), session_options, service_options), name=APP_NAME, route_prefix="/")
    shown = f"[{host}]" if ":" in host else host
    return Deployed(f"http://{shown}:{port}", replicas, started_ray)


def _check_resources(resources: dict, replicas: int, provider: str, cpus: int) -> None:
    """Refuses a deployment the cluster cannot place (Serve would wait for it forever)."""
    kind, each = ("GPU", 1) if provider == "cuda" else ("CPU", cpus)
    have = resources.get(kind, 0)
    if replicas * each > have:
        raise ConfigurationError(f"{replicas} replicas of {each} {kind}{'s' if each > 1 else ''} each need "
                                 f"{replicas * each}, and the Ray cluster has {have:g}; lower --replicas"
                                 f"{' or --threads' if kind == 'CPU' else ''}, or add nodes.")
