"""The CPU layer (rollout/sglang/cpu_compat) refuses an SGLang it was not written for, with one
message the launcher shows; it keeps the sitecustomize it shadows; its sgl_kernel stand-in has only
the names SGLang's CPU path imports; its speed-ups can be switched off. Checked in this process and
in short Python processes with the layer on their path; no server is launched (a server's start-up
refused, and a real engine without the speed-ups: tests/e2e/test_sglang_fence.py)."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from rlsys.config import ModelConfig
from rlsys.rollout.sglang.server import CPU_COMPAT_SITE, ServerSpec, build_env
from rlsys.system.backend import make_backend

sys.path.insert(0, str(CPU_COMPAT_SITE))
import rlsys_batched_decode  # noqa: E402 - lives in the server's compatibility layer
import rlsys_fence  # noqa: E402
import rlsys_prompt_shutdown  # noqa: E402
import rlsys_seeded_sampling  # noqa: E402

sys.path.remove(str(CPU_COMPAT_SITE))

REPO = Path(__file__).resolve().parents[2]


def _with_layer(code: str, extra_env: dict | None = None, path: list[str] | None = None):
    """Runs `code` in a Python whose path starts with the layer, as the SGLang server's does."""
    env = build_env(ServerSpec(ModelConfig(path="unused")), make_backend(False))
    env.update(extra_env or {})
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(path)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split("\n")


# --- the checks themselves ------------------------------------------------------------------------

def _decode_with_sinks(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                       encoder_lens=None, scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
                       sliding_window_size=None, sinks=None):
    """SGLang's decode attention as a release might change it: one more parameter."""


def test_a_method_whose_parameters_changed_is_refused_with_one_message_naming_both():
    replacement = rlsys_batched_decode.batched_decode(_decode_with_sinks)
    with pytest.raises(rlsys_fence.SGLangMismatch) as refused:
        rlsys_fence.check_signature("TorchNativeAttnBackend._run_sdpa_forward_decode", _decode_with_sinks,
                                    replacement)
    message = str(refused.value)
    assert "TorchNativeAttnBackend._run_sdpa_forward_decode" in message
    assert "sglang==0.5.23 where it is (self, query, output," in message
    assert "sliding_window_size=None, sinks=None)" in message  # what is installed
    assert "RLSYS_SGLANG_CPU_SPEEDUPS=0" in message
    # A sync method made async (or back) is a change too; the same parameters are accepted.
    async def watchdog(self):
        pass

    def sync_watchdog(self):
        pass

    rlsys_fence.check_signature("TokenizerManager.sigterm_watchdog", watchdog,
                                rlsys_prompt_shutdown.watch_sigterm_often(watchdog))
    with pytest.raises(rlsys_fence.SGLangMismatch, match=r"is async \(self\); the installed sglang .* has \(self\)"):
        rlsys_fence.check_signature("TokenizerManager.sigterm_watchdog", sync_watchdog,
                                    rlsys_prompt_shutdown.watch_sigterm_often(sync_watchdog))


def test_another_sglang_release_is_refused():
    rlsys_fence.check_version("0.5.23")
    with pytest.raises(rlsys_fence.SGLangMismatch, match=r"written for sglang==0\.5\.23, but sglang 0\.5\.24 is"):
        rlsys_fence.check_version("0.5.24")
    with pytest.raises(rlsys_fence.SGLangMismatch, match="sglang is not installed"):
        rlsys_fence.check_version(None)


def test_the_pin_is_the_release_the_install_paths_install():
    for path in ("Makefile", "deploy/Dockerfile"):
        assert set(re.findall(r"sglang==([\w.]+)", (REPO / path).read_text())) == {rlsys_fence.SGLANG_VERSION}, path


# --- what the layer installs ---------------------------------------------------------------------

def test_the_sitecustomize_the_layer_shadows_still_runs(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(
        "import os\nos.environ['SHADOWED_RUNS'] = os.environ.get('SHADOWED_RUNS', '') + 'x'\n")
    (tmp_path / "later").mkdir()
    (tmp_path / "later" / "sitecustomize.py").write_text("raise SystemExit('only the first one on the path runs')\n")
    code = "import os, sgl_kernel; print(os.environ.get('SHADOWED_RUNS'))"
    # The layer twice on the path (a PYTHONPATH that already had it) still runs the user's once.
    path = [str(CPU_COMPAT_SITE), str(CPU_COMPAT_SITE), str(tmp_path), str(tmp_path / "later")]
    assert _with_layer(code, path=path)[0] == "x"


def test_an_error_in_the_shadowed_sitecustomize_is_reported_as_python_reports_one(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("raise ValueError('broken customisation')\n")
    env = {**build_env(ServerSpec(ModelConfig(path="unused")), make_backend(False)),
           "PYTHONPATH": f"{CPU_COMPAT_SITE}{os.pathsep}{tmp_path}"}
    result = subprocess.run([sys.executable, "-c", "import sgl_kernel; print('started')"], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout == "started\n", result.stderr
    assert f"Error in sitecustomize ({tmp_path / 'sitecustomize.py'})" in result.stderr
    assert "ValueError: broken customisation" in result.stderr


STAND_IN_PROBE = """
import sgl_kernel
names = {names!r}
print(all(hasattr(sgl_kernel, name) for name in names))
print(hasattr(sgl_kernel, "silu_and_mul"), hasattr(sgl_kernel, "fused_add_rmsnorm"), hasattr(sgl_kernel, "__path__"))
try:
    from sgl_kernel import silu_and_mul
except ImportError:
    print("ImportError")
try:
    sgl_kernel.assign_req_to_token_pool_cpu()
except RuntimeError as error:
    print(error)
"""


def test_the_sgl_kernel_stand_in_has_only_the_names_sglangs_cpu_path_imports():
    lines = _with_layer(STAND_IN_PROBE.format(names=sorted(rlsys_fence.SGL_KERNEL_CPU_NAMES)))
    assert lines[0] == "True"
    assert lines[1] == "False False False"  # hasattr tells the truth about a kernel it does not have
    assert lines[2] == "ImportError"  # SGLang's `try: from sgl_kernel import X except ImportError` fallbacks apply
    assert lines[3].startswith("sgl_kernel.assign_req_to_token_pool_cpu is a CUDA kernel from sgl_kernel")


def _cpu_path_imports(source: str) -> set[str]:
    """Names a module imports from sgl_kernel inside `if` branches taken on a CPU (a test naming cpu)."""
    names = set()

    def visit(node, on_cpu: bool):
        if isinstance(node, ast.If):
            test = ast.unparse(node.test).lower()
            for child in node.body:
                visit(child, on_cpu or ("cpu" in test and "not" not in test))
            for child in node.orelse:
                visit(child, on_cpu)
            return
        if isinstance(node, ast.ImportFrom) and node.module == "sgl_kernel" and on_cpu:
            names.update(alias.name for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, on_cpu)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SGLang sources with invalid escape sequences in strings
        tree = ast.parse(source)
    visit(tree, False)
    return names


def test_the_stand_ins_names_are_those_the_pinned_sglangs_cpu_path_imports():
    root = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    imported = set()
    for source in root.rglob("*.py"):
        if not {"multimodal_gen", "test"} & set(source.relative_to(root).parts):  # not the LLM server
            text = source.read_text(errors="replace")
            if "sgl_kernel" in text:  # only a module that names it can import from it (parsing all 4,700 took ~1 min)
                imported |= _cpu_path_imports(text)
    assert imported == rlsys_fence.SGL_KERNEL_CPU_NAMES


OPS_PROBE = """
import torch
from sglang.srt.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from sglang.srt.multimodal.processors.qwen_vl import QwenVLImageProcessor
from sglang.srt.utils.common import cpu_has_amx_support
print(Qwen2_5_VLForConditionalGeneration in QwenVLImageProcessor.models)
print(cpu_has_amx_support(), hasattr(torch.ops.sgl_kernel, "convert_weight_packed"))
try:
    torch.ops.sgl_kernel.fused_sigmoid_mul_cpu(None, None)
except RuntimeError as error:
    print(error)
from sglang.srt.layers.attention import vision
eager = vision.apply_rotary_pos_emb is vision.apply_rotary_pos_emb_native_eager
print(eager, vision.ROTARY_EMBED_CLASSES["normal"] is vision.apply_rotary_pos_emb)
"""


@pytest.mark.parametrize("speedups", ["1", "0"])
def test_the_qwen_vl_image_processor_imports_on_the_cpu_path_with_the_ops_its_modules_read(speedups):
    """Without `rlsys_fence.SGL_KERNEL_OPS_READ_AT_IMPORT`, models/qwen3_5.py (imported by the Qwen-VL
    processor module) fails at import and a vision-language server starts with no image processor.
    Speed-up (7): the vision tower's rotary embedding is its eager twin (no Inductor compile on the
    first image), everywhere the module refers to it; without the speed-ups, SGLang's own."""
    lines = _with_layer(OPS_PROBE, {rlsys_fence.SPEEDUPS_ENV: speedups})
    assert lines[0] == "True"
    assert lines[1] == "False False"  # SGLang's AMX check still reads no op
    assert lines[2].startswith("torch.ops.sgl_kernel.fused_sigmoid_mul_cpu is a CUDA kernel from sgl_kernel")
    assert lines[3] == f"{speedups == '1'} True"
    root = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    source = (root / "srt" / "models" / "qwen3_5.py").read_text()
    assert all(f"torch.ops.sgl_kernel.{name}" in source for name in rlsys_fence.SGL_KERNEL_OPS_READ_AT_IMPORT)


SPEEDUPS_PROBE = """
import multiprocessing as mp, sys, torch, sgl_kernel
mp.set_start_method("spawn", force=True)
print(mp.get_start_method())
print(torch.compile.__module__)
print(any(type(finder).__name__ == "_PatchAfterImport" for finder in sys.meta_path))
torch.cuda.synchronize()  # raises on a CUDA build without a driver unless the layer's patch is in
print("synchronized")
"""


@pytest.mark.parametrize("speedups", ["1", "0"])
def test_the_speedups_can_be_switched_off_and_the_required_patches_stay(speedups):
    lines = _with_layer(SPEEDUPS_PROBE, {rlsys_fence.SPEEDUPS_ENV: speedups})
    on = speedups == "1"
    assert lines[0] == ("fork" if on else "spawn")
    assert lines[1] == ("rlsys_lazy_compile" if on else "torch")
    assert lines[2] == str(on)
    assert lines[3] == "synchronized"


SEEDED_PROBE = """
from sglang.srt.layers import sampler
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
print(sampler.multinomial_with_seed.__module__, sampler.top_k_top_p_min_p_sampling_from_probs_torch.__module__)
print(SamplingBatchInfo.from_schedule_batch.__func__.__module__)
"""


@pytest.mark.parametrize("speedups", ["1", "0"])
def test_per_request_seeds_are_in_with_or_without_the_speedups(speedups):
    """(2c): the pinned SGLang's sampler and batch info take rlsys's seeded draw, whose parameters
    match them (a mismatch would refuse the server's start); required, so the speed-ups' switch
    leaves it in."""
    lines = _with_layer(SEEDED_PROBE, {rlsys_fence.SPEEDUPS_ENV: speedups})
    assert lines[0] == "rlsys_seeded_sampling rlsys_seeded_sampling"
    assert lines[1] == "rlsys_seeded_sampling"


def test_a_required_patch_refused_does_not_suggest_switching_the_speedups_off():
    def changed(logprobs, seed, positions, generator=None):
        """SGLang's seeded draw as a release might change it."""

    with pytest.raises(rlsys_fence.SGLangMismatch) as refused:
        rlsys_fence.check_signature("multinomial_with_seed", changed, rlsys_seeded_sampling.multinomial_with_seed,
                                    speedup=False)
    assert "has (logprobs, seed, positions, generator=None)" in str(refused.value)
    assert rlsys_fence.SPEEDUPS_ENV not in str(refused.value)
