"""`SGLangClient`: the one place that speaks HTTP to an SGLang server, a method per endpoint.

Every failure is an `EngineError` naming the engine, the endpoint and the tail of the server's log
(when this process can read it: colocated trainer ranks share the engine's node). Both the engine
actor and the trainer ranks that post IPC payloads straight to their engine use it.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from pathlib import Path

from rlsys.system.topology import EngineAddress


class EngineError(RuntimeError):
    """An SGLang endpoint answered with an error, reported failure, or could not be reached."""

    def __init__(self, engine: str, endpoint: str, reason: str, log_tail: str = ""):
        self.engine, self.endpoint, self.reason, self.log_tail = engine, endpoint, reason, log_tail
        message = f"{engine}: {endpoint} failed: {reason}"
        if log_tail:
            message += f"\nlast lines of its log:\n{log_tail}"
        super().__init__(message)

    def __reduce__(self):  # crosses Ray's process boundary intact (the default needs __init__(message))
        return type(self), (self.engine, self.endpoint, self.reason, self.log_tail)


class EngineUnreachable(EngineError):
    """A process of the run cannot reach an engine at the address it listens on."""


def check_reachable(client: SGLangClient, caller: str, timeout_s: float = 10.0) -> None:
    """EngineUnreachable naming both ends when `caller` (e.g. "trainer rank 0 on node 10.0.0.11")
    cannot reach the engine: at connect time, not as a timeout in the middle of the first sync."""
    try:
        client.model_info(timeout_s=timeout_s)
    except EngineUnreachable:
        raise
    except EngineError as error:
        raise EngineUnreachable(
            error.engine, "/model_info",
            f"{caller} cannot reach it at {client.url} (node {client.address.host}): {error.reason}. Engines listen "
            "on their node's address (the node IP Ray reports); nodes must reach each other's addresses on any port",
        ) from error


class EngineDied(EngineError):
    """The engine's SGLang server has exited (or was stopped for not answering)."""


def read_log_tail(log_path: str | Path, lines: int = 30) -> str:
    if not log_path:
        return ""
    try:
        return "\n".join(Path(log_path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# How long a release waits for the engine's scheduler to be idle (`SGLangClient.wait_idle`).
IDLE_WAIT_S = 120.0


class SGLangClient:
    def __init__(self, address: EngineAddress, timeout_s: float = 600.0):
        self.address = address
        self.timeout_s = timeout_s

    @property
    def name(self) -> str:
        return self.address.name

    @property
    def url(self) -> str:
        return self.address.url

    @property
    def tp_size(self) -> int:
        return self.address.tp_size

    def _call(self, endpoint: str, payload: dict | None = None, timeout_s: float | None = None,
              json_answer: bool = True):
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"}
        if self.address.api_key:
            headers["Authorization"] = f"Bearer {self.address.api_key}"
        request = urllib.request.Request(
            f"{self.address.url}{endpoint}", data=data, method="GET" if payload is None else "POST", headers=headers,
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:2000]
            self._fail(endpoint, f"HTTP {error.code}: {detail}", error)
        except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
            self._fail(endpoint, f"could not be reached at {self.address.url}: {error}", error)
        except http.client.HTTPException as error:
            # An answer cut off mid-body (IncompleteRead): the server stopped or was killed while sending it.
            self._fail(endpoint, f"its answer was cut off ({type(error).__name__}: {error})", error)
        if not json_answer:
            return body.decode(errors="replace")
        answer = json.loads(body) if body else None
        if isinstance(answer, dict) and answer.get("success") is False:
            self._fail(endpoint, f"the engine reported failure: {answer.get('message')}")
        return answer

    def _fail(self, endpoint: str, reason: str, cause: BaseException | None = None):
        raise EngineError(str(self.address), endpoint, reason, read_log_tail(self.address.log_path)) from cause

    # ---- serving ------------------------------------------------------------------------
    def generate(self, payload: dict) -> list[dict]:
        """`/generate` with a batch of `input_ids`; one answer per sequence."""
        return self._call("/generate", payload)

    def abort_all(self) -> None:
        """Abort every request on the server: each in-flight /generate answers at once with what it
        has so far (finish_reason "abort"). Aborting by rid is not used: with one tokenizer worker
        SGLang drops an abort for a rid it has not registered yet (tokenizer_manager.abort_request)."""
        self._call("/abort_request", {"abort_all": True}, json_answer=False)

    def model_info(self, timeout_s: float | None = None) -> dict:
        """Cheap liveness and the engine's weight version (`/health` takes a full second)."""
        return self._call("/model_info", timeout_s=timeout_s)

    def server_info(self, timeout_s: float | None = None) -> dict:
        """`/server_info`: the server's arguments and its schedulers' internal states (memory_usage per
        scheduler: weight and kvcache GiB, sglang/srt/managers/scheduler_components/internal_state.py)."""
        return self._call("/server_info", timeout_s=timeout_s)

    def freeze_gc(self) -> None:
        """Move every object the server holds now (model, tokenizer, imports) out of Python's
        garbage collector in its processes (`gc.freeze`). Otherwise a full collection walks those
        ~800k objects every few seconds under load: 0.4-0.5 s pauses of the whole server, measured
        here. SGLang sends this itself after its warm-up, before its HTTP server listens when the
        warm-up is skipped (so it fails); the launcher sends it once the server answers."""
        self._call("/freeze_gc", {}, json_answer=False)

    # ---- device memory (colocated hand-off) ---------------------------------------------
    def release_memory_occupation(self, tags: list[str]) -> None:
        """Give the tagged memory ("weights", "kv_cache", "cuda_graph") back to the device; with
        --enable-memory-saver (GPU) it is really freed, elsewhere the call only pauses the region.
        Once the scheduler is idle (`wait_idle`): SGLang asserts that it is, and the assertion stops
        the server."""
        self.wait_idle()
        self._call("/release_memory_occupation", {"tags": list(tags)})

    def wait_idle(self, timeout_s: float = IDLE_WAIT_S) -> None:
        """Until the scheduler has nothing running, waiting or left to retire: SGLang's deferred
        `/flush_cache?timeout=` (managers/scheduler_components/flush_wrapper.py) answers once
        `is_fully_idle()` holds, dropping the prefix cache then. A /generate can answer before the
        scheduler has retired its batch (`last_batch` is cleared by its next loop); a release sent in
        that window killed a CPU server under load (`release_memory_occupation should be called only
        when server is idle`). An engine not idle within `timeout_s` is an EngineError naming it."""
        self._call(f"/flush_cache?timeout={timeout_s:g}", {}, timeout_s=timeout_s + 30.0, json_answer=False)

    def resume_memory_occupation(self, tags: list[str]) -> None:
        """Take released regions back (SGLang refuses a tag that was not released)."""
        self._call("/resume_memory_occupation", {"tags": list(tags)})

    # ---- weights ------------------------------------------------------------------------
    def begin_weight_update(self) -> None:
        self._call("/begin_weight_update", {})

    def end_weight_update(self) -> None:
        self._call("/end_weight_update", {})

    def update_weights_from_tensor(self, serialized_named_tensors: list[str], load_format: str,
                                   flush_cache: bool = False, weight_version: str | None = None) -> None:
        """Colocated: one serialized payload per TP rank; answers once the engine has loaded it."""
        self._call("/update_weights_from_tensor", {
            "serialized_named_tensors": serialized_named_tensors, "load_format": load_format,
            "flush_cache": flush_cache, "weight_version": weight_version,
        })

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str, timeout_s: float | None = None) -> None:
        """Disaggregated: blocks in the engine until the broadcast group has formed."""
        self._call("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend,
        }, timeout_s=timeout_s)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, flush_cache: bool, weight_version: str | None,
                                        timeout_s: float | None = None) -> None:
        """Disaggregated: the engine receives one flattened bucket by broadcast, then loads it."""
        self._call("/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "load_format": "flattened_bucket", "flush_cache": flush_cache, "weight_version": weight_version,
        }, timeout_s=timeout_s)

    def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        """Load every weight from a Hugging Face directory the server's node can read (SGLang's
        /update_weights_from_disk; the prefix cache is flushed)."""
        self._call("/update_weights_from_disk", {"model_path": model_path, "weight_version": weight_version,
                                                 "flush_cache": True})

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._call("/destroy_weights_update_group", {"group_name": group_name}, timeout_s=30)
