"""The status server: FastAPI in the coordinator process, reading a `RunStatus`.

GET  /api/v1/status   /api/v1/metrics?since=STEP   /api/v1/actors   /healthz   /metrics (Prometheus)
POST /api/v1/pause    /api/v1/resume   /api/v1/checkpoint   /api/v1/stop   (bearer token)
POST /api/v1/stacks   every process's Python stacks, now (bearer token; also written to RUN_DIR/hangs/)
GET  /api/v1/hangs/latest   the latest stack dump's summary (a hang's, or the last on request)
GET  /api/v1/samples   the latest answers shown: prompt, response, reward, finish reason (logging.samples_per_step)
GET  /                the live dashboard (JS served from this package: works offline)
"""


import asyncio
import ipaddress
import math
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Annotated

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Query
from fastapi.responses import HTMLResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel

from rlsys.observability.status.connections import (
    MAX_CONNECTIONS,
    MAX_PER_CLIENT,
    REQUEST_TIMEOUT_S,
    guarded_protocol,
)
from rlsys.observability.status.state import RunStatus

STATIC_DIR = Path(__file__).resolve().parent / "static"


class StatusResponse(BaseModel):
    run_id: str
    state: str
    step: int
    total_steps: int
    weight_version: int
    started_at: float
    finished_at: float | None
    earlier_s: float = 0.0  # a resumed run: what its earlier processes ran, before started_at
    first_started_at: float | None = None  # a resumed run: its first process's start
    eta_seconds: float | None
    last_metrics: dict | None
    error: str | None
    paused: bool
    run_dir: str
    dataset: dict[str, int] = {}
    latest_hang: str | None = None  # RUN_DIR/hangs/...: the latest stack dump (GET /api/v1/hangs/latest)
    status_url: str | None = None


class ProcessStacksResponse(BaseModel):
    role: str
    pid: int
    address: str
    name: str
    state: str
    collective: str | None
    where: str | None
    summary: str
    stacks: str | None = None  # the dump itself (POST /api/v1/stacks); files beside summary.json otherwise


class StacksResponse(BaseModel):
    directory: str
    processes: list[ProcessStacksResponse]


class MetricsResponse(BaseModel):
    since: int
    rows: list[dict]


class SampleResponse(BaseModel):
    step: int
    source: str  # "train", "eval", or "eval:NAME" (an eval set)
    prompt: str
    response: str
    reward: float | None
    finish_reason: str
    response_tokens: int
    images: list[str] = []  # a vision-language prompt's images: thumbnails as data: URIs (PNG)


class SamplesResponse(BaseModel):
    samples: list[SampleResponse]


class ActorResponse(BaseModel):
    name: str
    kind: str
    alive: bool
    last_heartbeat: float | None
    memory_bytes: int | None
    detail: str


class ActorsResponse(BaseModel):
    actors: list[ActorResponse]


class ControlResponse(BaseModel):
    accepted: bool
    request: str
    state: str


class HealthResponse(BaseModel):
    ok: bool
    state: str


def _finite(row: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def prometheus_text(status: RunStatus) -> str:
    summary = status.summary()
    lines = [
        "# HELP rlsys_step Steps finished.", "# TYPE rlsys_step gauge", f"rlsys_step {summary['step']}",
        "# HELP rlsys_total_steps Steps planned.", "# TYPE rlsys_total_steps gauge",
        f"rlsys_total_steps {summary['total_steps']}",
        "# HELP rlsys_weight_version Weight version on the engines.", "# TYPE rlsys_weight_version gauge",
        f"rlsys_weight_version {summary['weight_version']}",
        "# HELP rlsys_up 1 while the run is not finished, stopped or failed.", "# TYPE rlsys_up gauge",
        f"rlsys_up {0 if summary['state'] in ('finished', 'stopped', 'failed') else 1}",
    ]
    for key, value in sorted((summary["last_metrics"] or {}).items()):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and key != "step":
            lines += [f"# TYPE rlsys_{key} gauge", f"rlsys_{key} {value}"]
    for actor in status.actor_list():
        lines.append(f'rlsys_actor_alive{{name="{actor.name}",kind="{actor.kind}"}} {int(actor.alive)}')
    return "\n".join(lines) + "\n"


class _PerVersion:
    """Response bodies built once per change of the status (polling costs a lookup, not a build)."""

    def __init__(self, status: RunStatus):
        self.status = status
        self._bodies: dict[str, tuple[int, bytes]] = {}

    def get(self, key: str, build) -> bytes:
        version = self.status.version
        cached = self._bodies.get(key)
        if cached is None or cached[0] != version:
            cached = (version, build())
            self._bodies[key] = cached
        return cached[1]


def build_app(status: RunStatus, token: str | None, read_token: str | None = None) -> FastAPI:
    """`token` guards the control calls; `read_token`, when set, the reads too (not /healthz)."""
    app = FastAPI(title="rlsys status", version="1", description="Live state and control of one rlsys run.")
    bearer = HTTPBearer(auto_error=False)
    cache = _PerVersion(status)

    def _check(credentials: HTTPAuthorizationCredentials | None, expected: str | None, what: str) -> None:
        if expected is None or credentials is None or not secrets.compare_digest(credentials.credentials, expected):
            raise HTTPException(status_code=401, detail=f"{what} need 'Authorization: Bearer <status.token>'",
                                headers={"WWW-Authenticate": "Bearer"})

    def require_token(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
        _check(credentials, token, "control calls")

    async def require_read(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
        if read_token is not None:
            _check(credentials, read_token, "reads of a status server bound beyond loopback")
        await asyncio.sleep(READ_PACING_S)

    reads = [Depends(require_read)]

    _add_reads(app, status, cache, reads)
    _add_controls(app, status, [Depends(require_token)], reads)

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def dashboard() -> str:
        return (STATIC_DIR / "dashboard.html").read_text()

    return app


def _add_reads(app: FastAPI, status: RunStatus, cache: _PerVersion, reads: list) -> None:
    """The run's state, metrics, samples, actors, health and Prometheus text, each read cached per
    status version."""
    def _status_body() -> bytes:
        summary = status.summary()
        if summary["last_metrics"]:
            summary["last_metrics"] = _finite(summary["last_metrics"])
        return StatusResponse(**summary).model_dump_json().encode()

    @app.get("/api/v1/status", response_model=StatusResponse, dependencies=reads)
    async def get_status() -> Response:
        return Response(cache.get("status", _status_body), media_type="application/json")

    @app.get("/api/v1/metrics", response_model=MetricsResponse, dependencies=reads)
    async def get_metrics(since: int = Query(0, ge=0, description="First step to return.")) -> Response:
        body = cache.get(f"metrics?since={since}", lambda: MetricsResponse(
            since=since, rows=[_finite(r) for r in status.metrics_since(since)]).model_dump_json().encode())
        return Response(body, media_type="application/json")

    @app.get("/api/v1/samples", response_model=SamplesResponse, dependencies=reads)
    async def get_samples() -> Response:
        body = cache.get("samples", lambda: SamplesResponse(
            samples=[SampleResponse(**_finite(row)) for row in status.latest_samples()]).model_dump_json().encode())
        return Response(body, media_type="application/json")

    @app.get("/api/v1/actors", response_model=ActorsResponse, dependencies=reads)
    async def get_actors() -> Response:
        body = cache.get("actors", lambda: ActorsResponse(
            actors=[ActorResponse(**a.__dict__) for a in status.actor_list()]).model_dump_json().encode())
        return Response(body, media_type="application/json")

    @app.get("/healthz", response_model=HealthResponse)
    async def healthz() -> HealthResponse:
        return HealthResponse(ok=status.state != "failed", state=status.state)

    @app.get("/metrics", response_class=PlainTextResponse, dependencies=reads)
    async def prometheus() -> Response:
        return PlainTextResponse(cache.get("prometheus", lambda: prometheus_text(status).encode()))


def _add_controls(app: FastAPI, status: RunStatus, controls: list, reads: list) -> None:
    """pause, resume, checkpoint and stop (requests the loop acts on), and the processes' stacks:
    taken now (a control call) or the latest dump (a read)."""
    def control(what: str):
        def handler() -> ControlResponse:
            if status.state in ("finished", "stopped", "failed"):
                raise HTTPException(status_code=409, detail=f"the run is {status.state}")
            status.request(what)
            return ControlResponse(accepted=True, request=what, state=status.state)

        handler.__name__ = f"post_{what}"
        return handler

    for what in ("pause", "resume", "checkpoint", "stop"):
        app.post(f"/api/v1/{what}", response_model=ControlResponse, dependencies=controls)(control(what))

    @app.post("/api/v1/stacks", response_model=StacksResponse, dependencies=controls)
    def post_stacks() -> StacksResponse:
        """Every process's stacks, read now (seconds: py-spy on each node); a plain def runs in a worker thread."""
        provider = status.stacks_provider
        running = status.state not in ("finished", "stopped", "failed")
        dump = provider() if provider is not None and running else None
        if dump is None:
            raise HTTPException(status_code=409, detail=f"the run's processes are not up (the run is {status.state})")
        return StacksResponse(**dump)

    @app.get("/api/v1/hangs/latest", response_model=StacksResponse, dependencies=reads)
    def latest_hang() -> StacksResponse:
        import json

        directory = status.latest_hang
        if directory is None:
            raise HTTPException(status_code=404, detail="no stack dump in this run yet")
        try:
            processes = json.loads((Path(directory) / "summary.json").read_text())
        except (OSError, ValueError) as error:
            raise HTTPException(status_code=404, detail=f"{directory}: {error}") from None
        return StacksResponse(directory=directory, processes=processes)


# Every read waits this long before it is answered, without using CPU: a client polling in a tight
# loop then gets at most 1 / READ_PACING_S answers per connection per second and cannot take the
# trainers' cores (the dashboard polls every 2 s).
READ_PACING_S = 0.1


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve beyond this machine


def read_token_for(host: str, token: str | None, allow_unauthenticated_read: bool) -> str | None:
    """The token reads need: none on loopback; beyond it the control token, unless the user
    explicitly allows open reads. Without either, binding beyond loopback is refused."""
    from rlsys.config import ConfigError

    if is_loopback(host) or allow_unauthenticated_read:
        return None
    if token is None:
        raise ConfigError(
            f"status.host {host} would expose the run's status (paths, config, errors) beyond this machine "
            "without a token; set status.token (or $RLSYS_STATUS_TOKEN), or status.allow_unauthenticated_read: "
            "true to publish it on purpose"
        )
    return token


def listening_socket(host: str, port: int, option_prefix: str = "status.") -> socket.socket:
    """A socket listening on host:port for uvicorn to serve on. Bound here, in the caller's thread,
    because uvicorn's own bind fails inside its thread with only a log line, and a free-port check
    before it races with other processes. `option_prefix` names the user's settings in messages:
    "status." (the run's config) or "--" (`rlsys serve`'s flags)."""
    import errno
    import os

    from rlsys.config import ConfigError

    host_option, port_option = f"{option_prefix}host", f"{option_prefix}port"
    zero = f"{port_option}=0" if option_prefix == "status." else f"{port_option} 0"
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as error:
        raise ConfigError(f"{host_option} {host} is not an address of this machine: {error.strerror}") from None
    try:
        return socket.create_server(address[:2], family=family)  # SO_REUSEADDR, as uvicorn: TIME_WAIT is fine
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise ConfigError(f"{port_option} {port} on {host} is in use; pick another {port_option}, "
                              f"or {zero} for a free one") from None
        if error.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"{host_option} {host} is not an address of this machine "
                              f"({os.strerror(error.errno)})") from None
        raise ConfigError(f"cannot serve on {host} port {port} ({host_option}, {port_option}): "
                          f"{os.strerror(error.errno) if error.errno else error}") from None


class StatusServer:
    """uvicorn serving `build_app` on a background thread."""

    def __init__(self, status: RunStatus, host: str, port: int, token: str | None,
                 allow_unauthenticated_read: bool = False, option_prefix: str = "status.",
                 max_connections: int = MAX_CONNECTIONS, request_timeout_s: float = REQUEST_TIMEOUT_S,
                 max_per_client: int = MAX_PER_CLIENT):
        read_token = read_token_for(host, token, allow_unauthenticated_read)
        self._socket = listening_socket(host, port, option_prefix)
        # Not uvicorn's limit_concurrency: it counts idle connections too (connections.py says why).
        config = uvicorn.Config(build_app(status, token, read_token), host=host, port=port, log_level="warning",
                                access_log=False, lifespan="off",
                                http=guarded_protocol(max_connections, request_timeout_s, max_per_client))
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="rlsys-status", daemon=True)
        self.host = host

    def start(self, timeout_s: float = 15.0) -> str:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the status server did not start")
            time.sleep(0.05)
        port = self._socket.getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        return self.url

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
