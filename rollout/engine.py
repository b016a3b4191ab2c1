"""`RolloutEngine`: a Ray actor that owns one SGLang server and drives it over HTTP."""

from __future__ import annotations

import base64
import json
import threading
import time
from pathlib import Path

import numpy as np

from rlsys.records import Generation, SamplingParams
from rlsys.rollout.sglang.client import EngineAddress, EngineDied, EngineError
from rlsys.rollout.sglang.server import ServerSpec, SGLangServer
from rlsys.system.backend import make_backend
from rlsys.system.node import node_address
from rlsys.system.reaper import start_actor_reaper, stop_reaper
from rlsys.system.shm_sweep import sweep_shared_memory

# Requests an engine actor serves at once (threads blocked on its SGLang server, which batches them).
ENGINE_ACTOR_CONCURRENCY = 256

# SGLang's answer to /end_weight_update when no session is open (scheduler weight_updater.py).
NO_OPEN_SESSION = "no weight-update session is open"
# The temperature of `score`'s log-probs: SGLang computes input-token log-probs as log_softmax of
# the raw logits whatever the request's temperature (sglang/srt/layers/logprob_processor.py,
# _forward_by_chunk; only sampled tokens' log-probs are divided by it, in layers/sampler.py).
SCORE_TEMPERATURE = 1.0


def releasable_bytes(server_info: dict) -> int | None:
    """Bytes of the weights and the KV cache that SGLang reports in /server_info (each data-parallel
    rank's `internal_states[i].memory_usage`, in GiB: `weight`, measured as the device memory its load
    took, and `kvcache`, the pool's K and V buffers): what releasing both must give back to the
    device. None when the server reports no such figures."""
    try:
        usages = [state["memory_usage"] for state in server_info["internal_states"]]
        return max(int((float(u["weight"]) + float(u["kvcache"])) * 2**30) for u in usages)
    except (KeyError, TypeError, ValueError):
        return None


def route_shape(model_path: str) -> tuple[int, int]:
    """(decoder layers, experts per token) of the model's config.json: the shape of each token's
    routes as SGLang's routed-experts capturer records them (state_capturer/routed_experts.py: one row
    of num_experts_per_tok expert ids per layer, num_hidden_layers rows)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    config = config.get("text_config", config)
    if not config.get("num_experts_per_tok"):
        raise ValueError(f"rollout.routing_replay: {model_path} is not a mixture-of-experts model "
                         "(its config.json has no num_experts_per_tok)")
    return int(config["num_hidden_layers"]), int(config["num_experts_per_tok"])


def decode_routes(meta: dict, shape: tuple[int, int], tokens: int) -> np.ndarray:
    """An answer's routed experts (base64 int32, `[tokens, layers, top_k]`, covering every token the
    engine forwarded: the prompt and the response but its last token) as uint8 where every expert id
    fits (models of up to 256 experts), else int16: a sample holds tokens x layers x top_k of them."""
    if not meta.get("routed_experts"):
        raise EngineError("(engine)", "/generate", "the answer carries no routed experts although they were asked for "
                          "(rollout.routing_replay): was the server started with --enable-return-routed-experts?")
    routes = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
    layers, top_k = shape
    if routes.size != tokens * layers * top_k:
        raise EngineError("(engine)", "/generate", f"the answer's routed experts hold {routes.size} ids, not "
                          f"{tokens} tokens x {layers} layers x {top_k} experts")
    routes = routes.reshape(tokens, layers, top_k)
    return routes.astype(np.uint8 if routes.size == 0 or routes.max() < 256 else np.int16)


class RolloutEngine:
    """Plain class, wrapped with `ray.remote` at the call site."""

    def __init__(self, spec: ServerSpec, name: str, log_path: str, hangs_dir: str | None = None):
        # Its node's address, not loopback: trainer ranks on other nodes post weights to it.
        self.server = SGLangServer(spec, make_backend(spec.has_gpu, spec.dtype), name, Path(log_path),
                                   host=node_address())
        self.client = self.server.client
        self._reaper = start_actor_reaper()  # if this actor is killed: its server tree and /dev/shm files, on its node
        self.health_timeout_s = spec.engine.health_timeout_s
        self._watching = threading.Event()
        self._released: list[str] = []  # memory regions given back to the device, in release order
        self._releasable: int | None = None  # weights + KV cache bytes, read once from a GPU server
        self.name = name
        self.hangs_dir = hangs_dir  # where the watchdog leaves a silent server's stacks (None: nowhere)
        self.silenced: str | None = None  # why the watchdog stopped the server, with where its stacks went
        # rollout.routing_replay: (layers, top_k) of the routes each answer carries; None: not asked for
        self.route_shape = route_shape(spec.model.path) if spec.return_routes else None

    def start(self, timeout_s: float | None = None) -> EngineAddress:
        """Launch the server; `timeout_s` None: rollout.engine.startup_timeout_s or its default for
        the hardware (EngineConfig.startup_timeout)."""
        sweep_shared_memory()  # what engines killed without warning left on this node
        self.server.start(timeout_s if timeout_s is not None else self.server.spec.startup_timeout_s)
        self._watching.set()
        threading.Thread(target=self._watch, name="engine-watchdog", daemon=True).start()
        return self.server.address

    def _watch(self) -> None:
        """Stop a server that stays alive but does not answer for `health_timeout_s` (stopped,
        deadlocked): its requests then fail at once as EngineDied instead of hanging the run."""
        silent_since = None
        while self._watching.is_set() and self.server.is_alive():
            try:
                self.client.model_info(timeout_s=min(5.0, self.health_timeout_s))
                silent_since = None
            except EngineError:
                silent_since = silent_since or time.monotonic()
                if time.monotonic() - silent_since >= self.health_timeout_s:
                    stacks = self._dump_stacks()
                    self.silenced = (f"no answer for {self.health_timeout_s:.0f}s (rollout.engine.health_timeout_s)"
                                     + (f"; its processes' stacks are in {stacks}" if stacks else ""))
                    self.server.kill(self.silenced)
                    return
            time.sleep(min(2.0, self.health_timeout_s / 4))

    def _dump_stacks(self) -> str | None:
        """The silent server's process tree's stacks (rlsys/system/stacks.py) into
        hangs_dir/<name>-<time>/, before it is stopped; the directory, or None."""
        if self.hangs_dir is None or self.server.pid is None:
            return None
        import ray

        from rlsys.system.stacks import ProcessRef, dump_on_this_node, write_stacks

        out = Path(self.hangs_dir) / f"{self.name}-{time.strftime('%Y%m%dT%H%M%S')}"
        try:
            write_stacks(dump_on_this_node([ProcessRef(self.name, self.server.pid, ray.get_runtime_context().get_node_id(),
                                                       node_address(), with_children=True)]), out)
        except Exception:  # noqa: BLE001 - the dump must never keep a silent server running
            return None
        return str(out)

    def _call(self, request, answered: str | None = None):
        """Run a client call; a server that has exited raises EngineDied. `answered`: a failure
        whose reason holds this text is the server's own answer (it is alive), raised at once."""
        if not self.server.is_alive():
            raise EngineDied(str(self.server.address), "(any)", "the server is not running", self.server.log_tail())
        try:
            return request()
        except EngineError as error:
            if answered is not None and answered in error.reason:
                raise
            # A killed server's sockets close just before its process can be reaped: give it a
            # moment to be seen as exited rather than report a live engine that failed.
            if not self.server.still_running_after(2.0):
                raise EngineDied(error.engine, error.endpoint, f"{error.reason} (the server has exited)",
                                 self.server.log_tail()) from error
            raise

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, n: int = 1,
                 images: list[tuple[bytes, ...]] | None = None,
                 seeds: list[int | None] | None = None) -> list[Generation]:
        """`n` samples for every prompt, grouped prompt by prompt (len = n * len(prompts)).
        `images`: a vision-language model's, per prompt (its token ids hold one placeholder per
        image); each Generation's prompt_ids are then the engine's, with the placeholders expanded.
        `seeds`: each sample's sampling seed, in the answers' order (rollout/seeds.py; None: drawn)."""
        if not prompts:
            return []
        batch = [list(p) for p in prompts for _ in range(n)]
        answers = self._call(lambda: self.client.generate({
            "input_ids": batch,
            "sampling_params": seeded(sampling.as_sglang(), seeds, len(batch)),
            "return_logprob": True,
            **self._routes_asked(),
            **_images_asked(images, n),
        }))
        return [self._to_generation(ids, answer) for ids, answer in zip(batch, answers, strict=False)]

    def _routes_asked(self) -> dict:
        return {"return_routed_experts": True} if self.route_shape is not None else {}

    def generate_each(self, inputs: list[list[int]], sampling: list[SamplingParams],
                      seeds: list[int | None] | None = None) -> list[Generation]:
        """One sample per input, each with its own sampling parameters (a partial rollout's
        continuations: each has its own tokens left) and seed, in one request."""
        if not inputs:
            return []
        seeds = seeds or [None] * len(inputs)
        answers = self._call(lambda: self.client.generate({
            "input_ids": [list(ids) for ids in inputs],
            "sampling_params": [with_seed(params.as_sglang(), seed) for params, seed in zip(sampling, seeds, strict=True)],
            "return_logprob": True,
            **self._routes_asked(),
        }))
        return [self._to_generation(list(ids), answer) for ids, answer in zip(inputs, answers, strict=True)]

    def abort_all(self) -> None:
        """End every request in flight on the server now; each answers with the tokens and
        log-probs it has so far and finish reason "abort" (SGLang's /abort_request, abort_all)."""
        self._call(self.client.abort_all)

    def _to_generation(self, prompt_ids: list[int], answer: dict) -> Generation:
        meta = answer["meta_info"]
        if "prompt_token_ids" in answer:  # asked with images: the ids the engine expanded them to
            prompt_ids = [int(token) for token in answer["prompt_token_ids"]]
        pairs = meta["output_token_logprobs"]
        response_ids = [int(token) for _, token, *_ in pairs]
        finish = meta.get("finish_reason") or {}
        reason = finish.get("type", "unknown") if isinstance(finish, dict) else str(finish)
        return Generation(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            logprobs=[float(logprob) for logprob, *_ in pairs],
            finish_reason=reason,
            weight_version=int(meta.get("weight_version", -1)),
            # an abort's message: "Aborted" for ours, the engine's reason when it aborted by itself
            stop_reason=finish.get("message") if reason == "abort" and isinstance(finish, dict) else None,
            routes=None if self.route_shape is None else decode_routes(meta, self.route_shape,
                                                                       len(prompt_ids) + len(response_ids) - 1),
        )

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Engine log-probs of tokens 1..L-1 of each fixed sequence (prefill, nothing sampled), at
        SCORE_TEMPERATURE."""
        answers = self._call(lambda: self.client.generate({
            "input_ids": [list(s) for s in sequences],
            "sampling_params": {"max_new_tokens": 1, "temperature": SCORE_TEMPERATURE},
            "return_logprob": True,
            "logprob_start_len": 0,
        }))
        return [[float(lp) for lp, *_ in a["meta_info"]["input_token_logprobs"][1:]] for a in answers]

    def score_with_images(self, sequence: list[int], images: tuple[bytes, ...]) -> tuple[list[int], list[float]]:
        """A vision-language sequence (one placeholder per image) scored as `score` does: its ids as
        the engine expanded them, and the log-probs of tokens 1..L-1 of those (the ones at image
        tokens mean nothing: the scheduler holds pad values there)."""
        answer, = self._call(lambda: self.client.generate({
            "input_ids": [list(sequence)],
            "sampling_params": {"max_new_tokens": 1, "temperature": SCORE_TEMPERATURE},
            "return_logprob": True,
            "logprob_start_len": 0,
            **_images_asked([images], 1),
        }))
        return ([int(token) for token in answer["prompt_token_ids"]],
                [float(lp) for lp, *_ in answer["meta_info"]["input_token_logprobs"][1:]])

    # ---- weights ---------------------------------------------------------------------------
    def end_abandoned_weight_update(self) -> bool:
        """Close a weight-update session a trainer died in the middle of (SGLang refuses the next
        `/begin_weight_update` while one is open). True if one was open."""
        try:
            # "No session open" is the usual answer (every attach and release asks): the server
            # answered, so no 2 s wait to see whether it is dying.
            self._call(self.client.end_weight_update, answered=NO_OPEN_SESSION)
        except EngineError as error:
            if NO_OPEN_SESSION in error.reason:
                return False
            raise
        return True

    # ---- device memory --------------------------------------------------------------------
    def release_memory(self, tags: list[str]) -> dict:
        """Give the tagged regions back to the device (colocated: before the trainer wakes)."""
        tags = [tag for tag in tags if tag not in self._released]
        if tags:
            self._call(lambda: self.client.release_memory_occupation(tags))
            self._released += tags
        return self.memory()

    def resume_memory(self, tags: list[str]) -> dict:
        """Take back those of `tags` that are released (resuming any other one is an error in SGLang)."""
        tags = [tag for tag in tags if tag in self._released]
        if tags:
            self._call(lambda: self.client.resume_memory_occupation(tags))
            self._released = [tag for tag in self._released if tag not in tags]
        return self.memory()

    def memory(self) -> dict:
        """What the engine holds: device bytes (GPU, NVML; None on CPU), host RSS of its process
        tree, which regions are released, and the bytes its weights and KV cache take on the device
        (`releasable_bytes`; None on CPU, where a release frees nothing)."""
        device_bytes = self.server.device_memory_bytes()
        if device_bytes is not None and self._releasable is None:
            # The scheduler's figures, fixed from start-up on: read at the first report on a GPU.
            self._releasable = releasable_bytes(self._call(lambda: self.client.server_info(timeout_s=30.0)))
        return {"device_bytes": device_bytes, "host_bytes": self.server.memory_bytes(),
                "released": list(self._released), "releasable_bytes": self._releasable}

    def weight_version(self) -> int:
        return int(self._call(self.client.model_info)["weight_version"])

    def load_weights_from_disk(self, model_path: str, weight_version: int = 0) -> int:
        """Serve the weights of a Hugging Face directory (`rlsys eval` on standing engines); the
        version it then reports."""
        self._call(lambda: self.client.update_weights_from_disk(model_path, str(weight_version)))
        return self.weight_version()

    def restart_random_stream(self, seed: int) -> None:
        """Restart the server's sampling random stream at `seed`, as a fresh server started with
        `--random-seed seed` holds it: an attached run then samples the same whatever earlier runs
        drew from this engine. Sent as a tensor update with its own load format, whose function runs
        in the server's sampling worker (weight_sync/engine_loader.py `restart_random_streams`)."""
        from rlsys.weight_sync.colocated import serialize_named_tensors
        from rlsys.weight_sync.engine_loader import SEED_LOAD_FORMAT, seed_entry

        payload = serialize_named_tensors([seed_entry(seed)])
        self._call(self.client.begin_weight_update)
        try:
            self._call(lambda: self.client.update_weights_from_tensor([payload] * self.server.spec.engine.tp_size,
                                                                      SEED_LOAD_FORMAT))
        finally:
            self._call(self.client.end_weight_update)

    def address(self) -> EngineAddress:
        """Where the (started) server listens: what an attaching run's trainers post weights to."""
        return self.server.address

    def make_ready(self) -> dict:
        """Leave the engine as a fresh one stands, for the next run of a standing set (rlsys engines):
        nothing in flight, no weight-update session open, every released region taken back. What it
        did, by name."""
        self._call(self.client.abort_all)
        closed = self.end_abandoned_weight_update()
        resumed = list(self._released)
        self.resume_memory(resumed)
        return {"closed_weight_update": closed, "resumed": resumed}

    def health(self) -> dict:
        """Whether the server answers, and the memory of its process tree.

        Asks /model_info (about 2 ms) rather than /health, which takes a full second on SGLang."""
        alive = self.server.is_alive()
        if alive:
            try:
                self.client.model_info(timeout_s=5.0)
            except Exception:  # noqa: BLE001 - any failure to answer means unhealthy
                alive = False
        return {"alive": alive, "memory_bytes": self.server.memory_bytes(), "url": self.server.url}

    def silence(self) -> str | None:
        """Why the watchdog stopped the server (it stopped answering), or None."""
        return self.silenced

    def process(self) -> tuple[int | None, str, str]:
        """(the SGLang server's pid, None when it is not running; Ray node id; node address): where
        its stacks (and its scheduler's and detokenizer's, its children) are read on a hang."""
        import ray

        return self.server.pid, ray.get_runtime_context().get_node_id(), node_address()

    def shutdown(self) -> None:
        self._watching.clear()
        self.server.stop()
        stop_reaper(self._reaper)


def seeded(params: dict, seeds: list[int | None] | None, count: int) -> dict | list[dict]:
    """SGLang's `sampling_params` for `count` samples: `params` as they are without seeds, else one
    copy per sample with its `sampling_seed` (SGLang would give every copy of one dict the same seed)."""
    if seeds is None or all(seed is None for seed in seeds):
        return params
    if len(seeds) != count:
        raise ValueError(f"{len(seeds)} sampling seeds for {count} samples")
    return [with_seed(params, seed) for seed in seeds]


def with_seed(params: dict, seed: int | None) -> dict:
    return params if seed is None else {**params, "sampling_seed": seed}


def _images_asked(images: list[tuple[bytes, ...]] | None, n: int) -> dict:
    """The request's images (base64, as SGLang's `image_data` takes them: a list per input, here
    each prompt's n times) and the expanded prompt ids back; nothing for prompts without images."""
    if not images or not any(images):
        return {}
    encoded = [[base64.b64encode(image).decode() for image in prompt_images] for prompt_images in images]
    return {"image_data": [each for each in encoded for _ in range(n)], "return_prompt_token_ids": True}
