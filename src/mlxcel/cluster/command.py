"""`mlxcel cluster --replicas N [serve flags]`: one model, N replicas, one endpoint (spec X).

Startup: check the serve flags exactly as `serve` does, join the Ray cluster at --ray-address
or start a local one bound to 127.0.0.1 (usage stats off, dashboard off unless asked), deploy
the engine deployment (each replica `serve`'s startup path, see `replica`) with the
prefix-aware request router, wait until every replica is ready, then bind and serve the entry
point. SIGINT/SIGTERM stop the entry, delete the app and, for a local cluster, stop Ray.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxcel.command_line import ServeSettings
    from mlxcel.env import Environment

log = logging.getLogger("mlxcel.cluster")

APP_NAME = "mlxcel"
DEPLOYMENT_NAME = "MlxcelEngine"
ROUTER_CLASS = "mlxcel.cluster.router.PrefixAwareRouter"
OBJECT_STORE_BYTES = 128 << 20  # calls and chunks are small; the default (30% of RAM) is wasted here
HEALTH_CHECK_PERIOD_S = 5.0
DRAIN_S = 150.0  # the source's router pool drain: in-flight requests get this long to finish at shutdown


@dataclass(frozen=True, slots=True)
class ClusterOptions:
    replicas: int
    ray_address: str | None
    ray_dashboard: bool
    ray_temp_dir: Path | None
    replica_cpus: float
    replica_gpus: float
    request_router: str
    route_imbalance: int

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be at least 1, not {self.replicas}")
        if self.replica_cpus < 0 or self.replica_gpus < 0:
            raise ValueError("--replica-cpus and --replica-gpus must not be negative")


def add_cluster_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cluster (Ray Serve)")
    group.add_argument("--replicas", type=int, default=2, metavar="N", help="engine replicas (default: 2)")
    group.add_argument("--ray-address", metavar="ADDRESS", help="join this Ray cluster (e.g. 10.0.0.1:6379 or "
                       "ray://host:10001); default: start a local one on 127.0.0.1")
    group.add_argument("--ray-dashboard", action="store_true", help="start Ray's dashboard (local cluster, 127.0.0.1)")
    group.add_argument("--ray-temp-dir", type=Path, metavar="PATH", help="Ray's session folder (local cluster)")
    group.add_argument("--replica-cpus", type=float, default=1.0, metavar="N", help="CPUs Ray reserves per replica "
                       "(default: 1; match --threads)")
    group.add_argument("--replica-gpus", type=float, default=0.0, metavar="N", help="GPUs per replica (default: 0; "
                       "1 with --device cuda gives each replica its own GPU)")
    group.add_argument("--request-router", choices=("prefix", "pow2"), default="prefix",
                       help="prefix: prefix-cache affinity, sticky conversations, least-loaded past the imbalance; "
                       "pow2: Ray Serve's default power-of-two-choices (default: prefix)")
    group.add_argument("--route-imbalance", type=int, default=4, metavar="N", help="requests in flight between the "
                       "busiest and idlest replica before load wins over affinity (default: 4)")


def cluster_parser(prog: str) -> argparse.ArgumentParser:
    from mlxcel.command_line import OPTIONS, HelpFormatter, add_options

    parser = argparse.ArgumentParser(prog=prog, formatter_class=HelpFormatter, allow_abbrev=False,
                                     description="Serve one model from several replicas on Ray Serve behind one "
                                     "endpoint, routing each prompt to the replica whose prefix cache holds it.")
    add_cluster_options(parser)
    add_options(parser, OPTIONS, "serve")
    return parser


def cluster_options(namespace: argparse.Namespace) -> ClusterOptions:
    return ClusterOptions(namespace.replicas, namespace.ray_address, namespace.ray_dashboard, namespace.ray_temp_dir,
                          namespace.replica_cpus, namespace.replica_gpus, namespace.request_router,
                          namespace.route_imbalance)


def serve_args(argv: Sequence[str]) -> list[str]:
    """The serve flags of a cluster command line, handed to every replica unchanged."""
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_cluster_options(own)
    return own.parse_known_args(list(argv))[1]


def cluster_main(argv: Sequence[str], prog: str = "mlxcel cluster") -> int:
    from mlxcel.command_line import OPTIONS, configure_logging, resolve_values, serve_settings
    from mlxcel.env import Environment

    parser = cluster_parser(prog)
    namespace = parser.parse_args(list(argv))  # --help, unknown flags and bad values, as serve reports them
    try:
        options, serve_argv = cluster_options(namespace), serve_args(argv)
        environment = Environment.read()
        settings = serve_settings(resolve_values(namespace, OPTIONS, environment), environment)
        if settings.realtime_stt or settings.realtime_tts:
            raise ValueError("--realtime-stt/--realtime-tts: the cluster entry does not forward WebSocket sessions")
    except ValueError as exc:
        parser.error(str(exc))
    configure_logging(settings.verbose, settings.log_file)
    log.info("API key authentication: %s", f"on ({settings.api_key_source})" if settings.server.api_keys else "off")
    return run_cluster(options, serve_argv, settings, environment)


def run_cluster(options: ClusterOptions, serve_argv: list[str], settings: ServeSettings,
                environment: Environment) -> int:
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # before Ray is imported: no usage reports, ever
    # Ray folds lines that differ only in words with digits into "[repeated Nx]": "replica 5mivvkcf
    # ready" would hide the second replica's line. Every replica's line is an event; keep them all.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    is_local = options.ray_address is None
    if is_local:  # Ray's single-machine mode: every node address is loopback (inherited by Ray's processes)
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray import serve

    from mlxcel.server.lifecycle import bind_socket

    try:
        _start_ray(ray, options)
        handle = _deploy(serve, options, serve_argv, environment, is_local)
        _wait_for_router(handle, options)
        sock = bind_socket(settings.server)
    except Exception as exc:  # noqa: BLE001 - Ray's startup errors are many; each is fatal here
        log.error("cannot start the cluster: %s", exc, exc_info=settings.verbose)
        _stop_ray(ray, serve, is_local)
        return 1
    try:
        return _serve_entry(handle, settings, sock)
    finally:
        _stop_ray(ray, serve, is_local)


def _start_ray(ray: Any, options: ClusterOptions) -> None:
    if options.ray_address is not None:
        log.info("joining the Ray cluster at %s", options.ray_address)
        ray.init(address=options.ray_address, namespace=APP_NAME, logging_level=logging.WARNING)
        return
    num_cpus = max(os.cpu_count() or 1, int(options.replicas * options.replica_cpus + 0.999))
    log.info("starting a local Ray cluster on 127.0.0.1 (%d CPUs)", num_cpus)
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=options.ray_dashboard,
             dashboard_host="127.0.0.1", num_cpus=num_cpus, object_store_memory=OBJECT_STORE_BYTES,
             _temp_dir=str(options.ray_temp_dir) if options.ray_temp_dir else None, namespace=APP_NAME,
             logging_level=logging.WARNING)


def _deploy(serve: Any, options: ClusterOptions, serve_argv: list[str], environment: Environment,
            is_local: bool) -> Any:
    from ray.serve.config import RequestRouterConfig

    from mlxcel.cluster.replica import EngineReplica

    serve.start(proxy_location="Disabled")  # the entry point is ours: serve's exact routes and envelopes
    actor_options: dict[str, Any] = {"num_cpus": options.replica_cpus, "num_gpus": options.replica_gpus}
    if not is_local:  # remote workers do not share this shell: send them the MLXCEL_*/LLAMA_* mirrors
        actor_options["runtime_env"] = {"env_vars": _forwarded_env(environment.raw)}
    deployment: dict[str, Any] = {
        "name": DEPLOYMENT_NAME, "num_replicas": options.replicas, "ray_actor_options": actor_options,
        # Ray must never hold a request back: each replica's own queue answers 503 when full, as serve does.
        "max_ongoing_requests": 1 << 16, "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "health_check_timeout_s": 60.0, "graceful_shutdown_timeout_s": 15.0,
        "graceful_shutdown_wait_loop_s": 0.5}
    if options.request_router == "prefix":
        deployment["request_router_config"] = RequestRouterConfig(
            request_router_class=ROUTER_CLASS, request_router_kwargs={"imbalance_threshold": options.route_imbalance})
    log.info("deploying %d replica(s), router: %s", options.replicas, options.request_router)
    app = serve.deployment(EngineReplica, **deployment).bind(serve_argv, is_loopback=is_local)
    return serve.run(app, name=APP_NAME, route_prefix=None)


def _wait_for_router(handle: Any, options: ClusterOptions, timeout_s: float = 60.0) -> None:
    """One call builds the handle's router; listen only once it can route to every replica."""
    from mlxcel.cluster.directory import find
    from mlxcel.cluster.wire import HttpCall

    for _ in handle.options(stream=True).handle.remote(HttpCall("GET", "/health", b"", (), b"")):
        pass
    end = time.monotonic() + timeout_s
    while options.request_router == "prefix" and time.monotonic() < end:
        router = find(APP_NAME)
        if router is not None and len(router.replica_ids()) >= options.replicas:
            return
        time.sleep(0.1)


def _forwarded_env(raw: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in raw.items() if k.startswith(("MLXCEL_", "LLAMA_")) and k != "LLAMA_API_KEY"}


def _stop_ray(ray: Any, serve: Any, is_local: bool) -> None:
    if not ray.is_initialized():
        return
    log.info("stopping the replicas")
    with contextlib.suppress(Exception):
        serve.delete(APP_NAME)  # each replica aborts its in-flight requests and joins its engine
    if is_local:
        with contextlib.suppress(Exception):
            serve.shutdown()
    ray.shutdown()
    log.info("shutdown complete")


def _serve_entry(handle: Any, settings: ServeSettings, sock: socket.socket) -> int:
    from mlxcel.cluster.entry import ClusterEntry, cluster_metrics
    from mlxcel.cluster.directory import find as live_router
    from mlxcel.server.asgi_server import AsgiServer
    from mlxcel.server.gate import Gate
    from mlxcel.server.routes import ROUTES, public_paths

    def replicas() -> list[str | None]:
        router = live_router(APP_NAME)
        return list(router.replica_ids()) if router is not None else [None]

    def metrics() -> str:
        router = live_router(APP_NAME)
        return cluster_metrics(router.replica_ids(), router.routed_counts()) if router is not None else ""

    config = settings.server
    app = Gate(ClusterEntry(handle, replicas, metrics), api_keys=config.api_keys, public_paths=public_paths(ROUTES),
               max_body_bytes=config.max_body_bytes, timeout_s=config.timeout_s)
    AsgiServer(app, sock, DRAIN_S).run_blocking()
    sock.close()
    return 0
