"""What rlsys's CPU layer for the SGLang server was written against, and the checks that refuse
anything else at start-up.

The layer replaces private SGLang methods and stands in for names of SGLang's kernel package, all
read from one SGLang release. A different release may rename a parameter or add one, and a
replacement with the old parameters would then fail at the first decode, mid-run; so the server
refuses to start instead, with one message that says what differs.
"""

from __future__ import annotations

import inspect
import os
import sys

# The SGLang release the layer was written against (the Makefile and deploy/Dockerfile install it).
SGLANG_VERSION = "0.5.23"

# Every name SGLang 0.5.23 imports from `sgl_kernel` on its CPU path: the `from sgl_kernel import`
# statements under its `if _is_cpu:` branches (allocation, KV-cache move and speculative-decoding
# modules). A CPU server of a tiny Qwen2 asked the stand-in for the first eight and never called
# one; rotate_input_ids_cpu is imported by multi-layer EAGLE only.
SGL_KERNEL_CPU_NAMES = frozenset({
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
})

# The ops of SGLang's kernel library that a module on the CPU path reads from `torch.ops.sgl_kernel`
# when it is imported, on a CPU without AMX: models/qwen3_5.py binds these four at import, and the
# Qwen-VL image processor (multimodal/processors/qwen_vl.py) imports it, so without them a
# vision-language model's server starts with no image processor (SGLang logs the import error and
# goes on). Qwen2.5-VL never calls them.
SGL_KERNEL_OPS_READ_AT_IMPORT = frozenset({
    "fused_sigmoid_mul_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
})

# "0" turns the speed-ups off (rollout/sglang/cpu_compat/site/sitecustomize.py); the patches the
# server needs to run at all stay.
SPEEDUPS_ENV = "RLSYS_SGLANG_CPU_SPEEDUPS"
# Starts the line a refusal is written on; the launcher (rollout/sglang/server.py) looks for it in
# the server's log when the server dies at start-up.
REFUSAL_MARK = "rlsys: SGLang refused: "


class SGLangMismatch(RuntimeError):
    """The installed SGLang is not the one the layer was written for."""


def check_version(found: str | None) -> None:
    if found != SGLANG_VERSION:
        raise SGLangMismatch(
            f"rlsys's CPU layer for SGLang is written for sglang=={SGLANG_VERSION}, but "
            f"{'sglang is not installed' if found is None else f'sglang {found} is installed'}. "
            f"Install sglang=={SGLANG_VERSION} (`make install` does), or run with a GPU."
        )


def installed_sglang_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def parameters(function) -> str:
    """`function`'s parameters (names, kinds, defaults; `async` if it is a coroutine function),
    without annotations: what a replacement depends on."""
    signature = inspect.signature(function)
    bare = signature.replace(parameters=[p.replace(annotation=inspect.Parameter.empty)
                                         for p in signature.parameters.values()],
                             return_annotation=inspect.Signature.empty)
    return ("async " if inspect.iscoroutinefunction(function) else "") + str(bare)


def check_signature(name: str, original, replacement, speedup: bool = True) -> None:
    """The SGLang method `name` has the parameters its replacement was written with (each
    replacement keeps the exact parameters of the method it replaces). `speedup`: the replacement
    is one of the speed-ups, which SPEEDUPS_ENV=0 leaves out (the message then says so)."""
    expected, found = parameters(replacement), parameters(original)
    if expected != found:
        raise SGLangMismatch(
            f"rlsys's CPU layer replaces SGLang's {name}, written for sglang=={SGLANG_VERSION} where it is "
            f"{expected}; the installed sglang {installed_sglang_version()} has {found}. "
            f"Install sglang=={SGLANG_VERSION}"
            + (f", or set {SPEEDUPS_ENV}=0 to run without the CPU speed-ups." if speedup else ".")
        )


def refuse(error: SGLangMismatch) -> None:
    """End this process with the one message (no traceback: it says all there is to say)."""
    sys.stderr.write(f"{REFUSAL_MARK}{error}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)
