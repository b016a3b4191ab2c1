"""How a CPU engine's SGLang server is launched: the flags a CPU run gets (and a GPU run does
not), and the CPU compatibility layer's fork start method. Fast: no server is started."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlsys.config import EngineConfig, ModelConfig, RolloutConfig
from rlsys.rollout.sglang.server import (
    CPU_COMPAT_SITE,
    SERVED_MODEL_CLASS_ENV,
    SERVED_MODEL_PACKAGE,
    ServerSpec,
    build_command,
    build_env,
    nvml_device_keys,
    served_model_class,
)
from rlsys.system.backend import Backend, make_backend


def _command(has_gpu: bool, radix_cache: bool = True) -> list[str]:
    spec = ServerSpec(ModelConfig(path="unused"), radix_cache=radix_cache)
    # The backend as a GPU host would decide it (make_backend checks for a device, absent here).
    backend = make_backend(False) if not has_gpu else Backend(has_gpu=True, device_type="cuda", dist_backend="nccl",
                                                               attn_implementation="flash_attention_2")
    return build_command(spec, backend, "127.0.0.1", 30000)


def test_the_prefix_cache_is_kept_where_requests_share_prefixes():
    single_turn = RolloutConfig()
    assert single_turn.uses_radix_cache(has_gpu=True)
    assert not single_turn.uses_radix_cache(has_gpu=False)  # n samples of a prompt arrive together
    multi_turn = RolloutConfig(generate_function="tools.py:rollout")
    assert multi_turn.uses_radix_cache(has_gpu=False)  # each turn extends the trajectory so far
    assert RolloutConfig(engine=EngineConfig(radix_cache=True)).uses_radix_cache(has_gpu=False)
    assert not RolloutConfig(engine=EngineConfig(radix_cache=False)).uses_radix_cache(has_gpu=True)


def test_the_server_command_carries_the_cache_and_scheduler_choices():
    assert "--disable-radix-cache" in _command(has_gpu=False, radix_cache=False)
    assert "--disable-radix-cache" not in _command(has_gpu=False, radix_cache=True)
    cpu, gpu = _command(has_gpu=False), _command(has_gpu=True)
    assert "--disable-overlap-schedule" in cpu  # one set of cores: overlap only adds switching
    assert "--disable-overlap-schedule" not in gpu and "--device" not in gpu


def _attention_flag(dtype: str, capability: tuple[int, int]) -> list[str]:
    spec = ServerSpec(ModelConfig(path="unused", dtype=dtype))
    backend = Backend(has_gpu=True, device_type="cuda", dist_backend="nccl", attn_implementation="flash_attention_2",
                      gpu_capability=capability)
    command = build_command(spec, backend, "127.0.0.1", 30000)
    return [arg for i, arg in enumerate(command) if "--attention-backend" in command[i - 1:i + 1]]


def test_an_fp32_gpu_engine_is_launched_with_an_attention_backend_that_takes_fp32():
    # Left to SGLang, an H100 gets fa3 (fp16/bf16/fp8 only) for an fp32 model.
    assert _attention_flag("float32", (9, 0)) == ["--attention-backend", "torch_native"]
    assert _attention_flag("bfloat16", (9, 0)) == []  # the GPU recipes keep SGLang's fastest default
    assert _attention_flag("bfloat16", (7, 5)) == ["--attention-backend", "torch_native"]
    cpu = _command(has_gpu=False)
    assert cpu[cpu.index("--attention-backend") + 1] == "torch_native"


@pytest.mark.parametrize("requested", ["spawn", "forkserver"])
def test_the_cpu_compat_layer_forks_what_sglang_would_spawn(requested):
    env = build_env(ServerSpec(ModelConfig(path="unused")), make_backend(False))
    assert env["PYTHONPATH"].split(":")[0] == str(CPU_COMPAT_SITE)
    probe = ("import multiprocessing as mp; "
             f"mp.set_start_method({requested!r}, force=True); print(mp.get_start_method())")
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # SGLang asks for "spawn" (a CUDA context cannot cross a fork); without a GPU it gets "fork".
    assert result.stdout.strip() == ("fork" if requested == "spawn" else requested)


LAZY_COMPILE_PROBE = """
import sys, torch
def double(x):
    return 2 * x
compiled = torch.compile(double, backend="eager")
decorated = torch.compile(backend="eager")(double)
print("torch._dynamo" in sys.modules)
print(compiled(torch.ones(2)).tolist(), decorated(torch.ones(2)).tolist(), compiled.__wrapped__ is double)
print("torch._dynamo" in sys.modules)
print(type(torch.compile(torch.nn.Linear(2, 2), backend="eager")).__name__)
class Holder:
    @torch.compile(backend="eager")
    @staticmethod
    def triple(x):
        return 3 * x
print(Holder().triple(torch.ones(1)).tolist())
"""


def test_the_cpu_compat_layer_sets_up_dynamo_at_a_compiled_functions_first_call():
    env = build_env(ServerSpec(ModelConfig(path="unused")), make_backend(False))
    result = subprocess.run([sys.executable, "-c", LAZY_COMPILE_PROBE], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    before_call, outputs, after_call, module, static = result.stdout.split("\n")[:5]
    assert before_call == "False"  # torch.compile(function) no longer imports TorchDynamo
    assert outputs == "[2.0, 2.0] [2.0, 2.0] True"  # both call forms compile and run the function
    assert after_call == "True"  # ... through the real torch.compile, on the first call
    assert module == "OptimizedModule"  # a module goes to the real torch.compile as given
    assert static == "[3.0]"  # a static method stays one (called through an instance, no self)


STAND_IN_SERVER = '''
import http.server, sys
port, record = int(sys.argv[1]), sys.argv[2]
class Handler(http.server.BaseHTTPRequestHandler):
    def _answer(self, body: bytes, kind: str):
        with open(record, "a") as out:
            out.write(f"{self.command} {self.path}\\n")
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self._answer(b'{"weight_version": "0"}', "application/json")
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if len(sys.argv) > 3:  # a server that refuses the freeze (e.g. an admin key)
            self.send_error(401, "Unauthorized")
            return
        self._answer(b"Garbage collection frozen.\\n", "text/plain")  # what SGLang answers /freeze_gc with
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def _stand_in_server(tmp_path, monkeypatch, *extra: str):
    from rlsys.rollout.sglang import server as server_module

    script, record = tmp_path / "stand_in.py", tmp_path / "requests.log"
    script.write_text(STAND_IN_SERVER)
    monkeypatch.setattr(server_module, "build_command",
                        lambda spec, backend, host, port, api_key=None: [sys.executable, str(script), str(port),
                                                                         str(record), *extra])
    server = server_module.SGLangServer(ServerSpec(ModelConfig(path="unused")), make_backend(False), "e0",
                                        tmp_path / "engine.log")
    return server, record


def test_the_launcher_freezes_the_servers_gc_once_it_answers(tmp_path, monkeypatch):
    """SGLang's own post-warm-up /freeze_gc fails when the warm-up is skipped (its HTTP server is
    not listening yet); without it, full collections over the start-up objects pause the server
    for ~0.5 s every few seconds. The launcher sends it once the server answers, and only then."""
    server, record = _stand_in_server(tmp_path, monkeypatch)
    try:
        server.start(timeout_s=30)
        assert record.read_text().splitlines() == ["GET /model_info", "POST /freeze_gc"]
    finally:
        server.stop()


def test_a_server_that_refuses_the_gc_freeze_still_starts_and_says_so_in_its_log(tmp_path, monkeypatch):
    server, record = _stand_in_server(tmp_path, monkeypatch, "refuse")
    try:
        server.start(timeout_s=30)
        assert server.client.model_info()["weight_version"] == "0"  # it serves
        assert "/freeze_gc was refused (HTTP 401" in (tmp_path / "engine.log").read_text()
    finally:
        server.stop()


# An HTTP server on uvicorn, as SGLang's is: its error when the port is taken is uvicorn's (asyncio's
# "error while attempting to bind on address ...: address already in use"), then it exits.
UVICORN_STAND_IN = '''
import json, sys, uvicorn
async def app(scope, receive, send):
    body = json.dumps({"weight_version": "0"}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})
uvicorn.run(app, host=sys.argv[1], port=int(sys.argv[2]), lifespan="off")
'''


def test_a_server_whose_port_was_taken_while_it_started_is_launched_again_on_another(tmp_path, monkeypatch):
    """The port is chosen free, but the server binds it only after its imports; whatever took it
    meanwhile (an outgoing connection's local port, here a listening socket) would otherwise fail the
    run at start-up (seen in a CI rehearsal: "[Errno 98] error while attempting to bind on address")."""
    import socket

    from rlsys.rollout.sglang import server as server_module

    script = tmp_path / "uvicorn_stand_in.py"
    script.write_text(UVICORN_STAND_IN)
    monkeypatch.setattr(server_module, "build_command",
                        lambda spec, backend, host, port, api_key=None: [sys.executable, str(script), host, str(port)])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1], server_module.find_free_port()])
        monkeypatch.setattr(server_module, "find_free_port", lambda host="127.0.0.1": next(ports))
        server = server_module.SGLangServer(ServerSpec(ModelConfig(path="unused")), make_backend(False), "e0",
                                            tmp_path / "engine.log")
        first = server.port
        try:
            server.start(timeout_s=60)
            assert server.port != first and server.url.endswith(f":{server.port}")
            assert server.client.model_info()["weight_version"] == "0"  # the client follows the new port
            log = (tmp_path / "engine.log").read_text()
            assert f"error while attempting to bind on address ('127.0.0.1', {first}): address already in use" in log
        finally:
            server.stop()


def test_a_server_that_fails_to_start_for_another_reason_is_not_launched_again(tmp_path, monkeypatch):
    from rlsys.rollout.sglang import server as server_module

    launches = tmp_path / "launches"
    monkeypatch.setattr(server_module, "build_command", lambda spec, backend, host, port, api_key=None: [
        sys.executable, "-c", f"open({str(launches)!r}, 'a').write('x'); raise SystemExit('no model here')"])
    server = server_module.SGLangServer(ServerSpec(ModelConfig(path="unused")), make_backend(False), "e0",
                                        tmp_path / "engine.log")
    with pytest.raises(RuntimeError, match="exited with code 1 during start-up(.|\\n)*no model here"):
        server.start(timeout_s=60)
    assert launches.read_text() == "x"


def test_the_files_a_process_maps_are_read_from_proc_and_an_exited_one_maps_none(tmp_path):
    # The launcher records the server's /dev/shm segments this way, to remove them after a crash.
    import mmap

    from rlsys.rollout.sglang.server import _mapped_files

    path = tmp_path / "segment with spaces"
    path.write_bytes(b"\0" * mmap.PAGESIZE)
    with open(path, "r+b") as handle, mmap.mmap(handle.fileno(), 0):
        assert str(path) in _mapped_files(os.getpid())
    assert str(path) not in _mapped_files(os.getpid())
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert _mapped_files(int(exited.stdout)) == set()


def _model_dir(tmp_path, architecture: str):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    return str(tmp_path)


def test_the_server_imports_only_the_served_models_module(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_EXTERNAL_MODEL_PACKAGE", raising=False)
    env = build_env(ServerSpec(ModelConfig(path=_model_dir(tmp_path, "Qwen2ForCausalLM"))), make_backend(False))
    assert env["SGLANG_EXTERNAL_MODEL_PACKAGE"] == SERVED_MODEL_PACKAGE
    assert env[SERVED_MODEL_CLASS_ENV] == "sglang.srt.models.qwen2:Qwen2ForCausalLM"
    # What SGLang's registry does with the package: it registers only the package's EntryClass at
    # import, and still finds any other architecture (a draft model's, say) among all its own.
    probe = ("import sys; from sglang.srt.models.registry import ModelRegistry as registry; "
             "print(sorted(registry.models), 'sglang.srt.models.llama' in sys.modules); "
             "print(registry.resolve_model_cls(['LlamaForCausalLM'])[1])")
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-2:] == ["['Qwen2ForCausalLM'] False", "LlamaForCausalLM"]


def test_an_architecture_sglang_does_not_define_is_left_to_sglang(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_EXTERNAL_MODEL_PACKAGE", raising=False)
    assert served_model_class(_model_dir(tmp_path, "Qwen2Model")) is None  # a class, but no EntryClass
    assert served_model_class(_model_dir(tmp_path, "NoSuchForCausalLM")) is None
    assert served_model_class(str(tmp_path / "absent")) is None
    env = build_env(ServerSpec(ModelConfig(path=_model_dir(tmp_path, "NoSuchForCausalLM"))), make_backend(False))
    assert "SGLANG_EXTERNAL_MODEL_PACKAGE" not in env  # SGLang imports all its models, as it would
    monkeypatch.setenv("SGLANG_EXTERNAL_MODEL_PACKAGE", "users_models")  # a user's own package wins
    env = build_env(ServerSpec(ModelConfig(path=_model_dir(tmp_path, "Qwen2ForCausalLM"))), make_backend(False))
    assert env["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "users_models"


@pytest.mark.parametrize(("visible", "count", "expected"), [
    (None, 3, [0, 1, 2]),  # unset: every device
    ("2", 4, [2]),  # Ray's per-actor list: NVML indexes
    ("1,3", 4, [1, 3]),
    ("GPU-8f3c,GPU-11aa", 8, ["GPU-8f3c", "GPU-11aa"]),  # UUIDs, as some schedulers set them
    ("0,7,1", 4, [0]),  # CUDA stops at the first device it cannot use
])
def test_the_engines_gpus_are_looked_up_by_what_cuda_visible_devices_names(visible, count, expected):
    """The engine's memory is read device-wide from NVML for the GPUs the engine sees (a
    per-process lookup never matches inside containers, where NVML reports the host's PIDs)."""
    assert nvml_device_keys(visible, count) == expected


@pytest.mark.parametrize("visible", ["", "-1", "9"])
def test_cuda_visible_devices_naming_no_gpu_gives_no_device_reading(visible):
    with pytest.raises(ValueError, match="names no usable GPU"):
        nvml_device_keys(visible, 2)
