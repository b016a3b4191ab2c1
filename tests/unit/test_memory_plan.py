"""`rlsys plan`: per-GPU and host memory from config.json shapes and the run config, checked against
hand sums on the published Qwen2.5 configs (no Ray, no run: the plan against a measured train step
on this CPU, and against the session's Ray cluster, is tests/e2e/test_memory_plan.py)."""

import contextlib
import io
import json
import math
import subprocess
import sys

import pytest

from rlsys.cli import main
from rlsys.config import ConfigError, RunConfig, load_config
from rlsys.model.shape import GiB, ModelShape
from rlsys.plan.memory_plan import memory_plan, plan_for_devices, plan_memory
from tests.helpers import REPO

QWEN = {  # published config.json values (shapes)
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}
PARAMS = {"1.5b": 1_543_714_304, "7b": 7_615_616_512, "14b": 14_770_033_664, "32b": 32_763_876_352}


@pytest.fixture(params=["1.5b", "7b"])
def qwen(request, tmp_path):
    config = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", max_position_embeddings=32768,
                  rms_norm_eps=1e-6, rope_theta=1e6, torch_dtype="bfloat16", **QWEN[request.param])
    (tmp_path / "config.json").write_text(json.dumps(config))
    return request.param, tmp_path


def _config(model_dir, **sections) -> RunConfig:
    tree = {"model": {"path": str(model_dir), "dtype": "bfloat16"}, "data": {"synthetic": {"task": "max_digit"}},
            "trainer": {"num_ranks": 8, "max_tokens_per_microbatch": 16384, "gradient_checkpointing": True},
            "rollout": {"num_engines": 8, "engine": {"mem_fraction_static": 0.5, "max_total_tokens": 262144,
                                                   "context_length": 2048}}}
    for section, fields in sections.items():
        tree.setdefault(section, {}).update(fields)
    return RunConfig.model_validate(tree)


def _plan_for_devices(config: RunConfig, **devices):
    """`rlsys train`'s plan, with the shapes trainer rank 0 would report (read here)."""
    return plan_for_devices(config, ModelShape.from_model_dir(config.model.path, config.model.lora), **devices)


def test_shapes_come_from_config_json_alone(qwen):
    name, model_dir = qwen
    shape = ModelShape.from_model_dir(model_dir)
    assert shape.params == PARAMS[name]
    h, i, kv = shape.hidden, shape.intermediate, shape.kv_heads * shape.head_dim
    layer = h * h + 2 * h * kv + h * h + (h + 2 * kv) + 3 * h * i + 2 * h  # q,k,v,o (+qkv bias), MLP, norms
    assert shape.layer_params == layer
    assert shape.root_params == shape.params - 28 * layer


# Qwen3-30B-A3B's published config.json (shapes): 128 experts of width 768 per layer, 8 per token.
QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                 intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
                 mlp_only_layers=[], norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False,
                 max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6, torch_dtype="bfloat16")


def test_a_mixture_of_experts_counts_every_expert_and_routes_a_token_through_its_top_k(tmp_path):
    from rlsys.plan.gpu_terms import activation_bytes_per_token_layer

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_MOE))
    shape = ModelShape.from_model_dir(tmp_path)
    h, q, kv, e, w = 2048, 32 * 128, 4 * 128, 128, 768
    attention = h * q + 2 * h * kv + q * h + 2 * 128  # q, k, v, o (no biases), q/k norms per head
    experts = e * 3 * h * w + h * e  # gate, up, down per expert, and the router
    layer = attention + experts + 2 * h  # + the two layer norms
    assert shape.layer_params == layer
    assert shape.params == 48 * layer + 2 * 151936 * h + h  # untied embedding and output layer, final norm
    assert 30.4e9 < shape.params < 30.6e9  # "30.5B" as published
    assert shape.active_intermediate == 8 * w  # a token's MLP work: its 8 routed experts, not all 128
    assert activation_bytes_per_token_layer(shape, 2) == (8 * h + 2 * kv + 4 * 8 * w) * 2 + 2 * h * 4


def test_trainer_and_engine_terms_equal_hand_sums(qwen):
    name, model_dir = qwen
    shape = ModelShape.from_model_dir(model_dir)
    p = PARAMS[name]
    plan = plan_memory(_config(model_dir), shape, gpu_memory=80 * GiB, on_gpu=True, flash_attention=True)
    terms = plan.terms
    assert terms["trainer_params"] == terms["trainer_grads"] == 4 * p // 8  # fp32, sharded over 8 ranks
    assert terms["optimizer_states"] == 8 * p // 8  # AdamW: two fp32 moments
    assert terms["unsharded_layers"] == 2 * shape.layer_params * 2  # one gathered + one prefetched, bf16
    assert terms["unsharded_root"] == shape.root_params * 2
    assert terms["logits_chunk"] == 3 * 512 * shape.vocab * 4
    assert terms["attention_scores"] == 0  # flash-attn
    assert terms["reference_model"] == 0  # KL off
    # Each staging buffer is its largest bucket: one at least the [vocab, hidden] bf16 embedding (+16 B).
    assert terms["weight_sync_staging"] >= shape.vocab * shape.hidden * 2 + 16
    assert terms["engine_weights"] == 2 * p
    kv_per_token = 2 * 28 * shape.kv_heads * shape.head_dim * 2  # K and V, every layer, bf16
    expected_tokens = min(262144, (int(0.5 * 80 * GiB) - 2 * p) // kv_per_token)
    assert plan.kv_cache_tokens == expected_tokens
    assert terms["engine_kv_cache"] == expected_tokens * kv_per_token
    # What the engine keeps through a release: its 512 MiB attention workspace and the cached blocks of
    # an 8,192-token prefill chunk (SGLang's default on an 80 GB GPU) through the MLP, bf16.
    h, i = shape.hidden, shape.intermediate
    assert terms["engine_unreleased"] == 512 * 2**20 + 8192 * (2 * h + 3 * i) * 2
    assert terms["engine_receive_bucket"] == 0  # colocated: the engine reads the trainer's staging buffer
    # colocated, sleeping trainers: the peak is the largest phase, not the sum
    runtime = 2 * (512 * 2**20 + GiB)  # CUDA context and NCCL buffers of a trainer rank and an engine
    runtime += terms["engine_unreleased"]  # and the engine's leftovers, released or not
    assert plan.phases["generate"] == terms["engine_weights"] + terms["engine_kv_cache"] + runtime
    assert plan.per_gpu_bytes == max(plan.phases.values()) < sum(terms.values())


def test_one_fp32_rank_plans_no_gathered_copies_and_bf16_still_does(qwen):
    _, model_dir = qwen
    shape = ModelShape.from_model_dir(model_dir)
    one_gpu = {"trainer": {"num_ranks": 1}, "rollout": {"num_engines": 1}}
    fp32 = plan_memory(_config(model_dir, model={"dtype": "float32"}, **one_gpu), shape, 80 * GiB)
    assert fp32.terms["unsharded_layers"] == fp32.terms["unsharded_root"] == 0  # trained whole, no FSDP
    assert fp32.terms["engine_weights"] == 2 * shape.params  # a GPU engine serves bf16 (engine_dtype)
    assert plan_memory(_config(model_dir, model={"dtype": "float32"}, **one_gpu), shape, 80 * GiB,
                       on_gpu=False).terms["engine_weights"] == 4 * shape.params  # a CPU one the model's fp32
    bf16 = plan_memory(_config(model_dir, **one_gpu), shape, 80 * GiB)
    assert bf16.terms["unsharded_layers"] == 2 * shape.layer_params * 2  # FSDP's bf16 compute copies


def test_disaggregated_puts_trainers_and_engines_on_separate_gpus(qwen):
    _, model_dir = qwen
    config = _config(model_dir, placement={"mode": "disaggregated"}, rollout={"num_engines": 2})
    plan = plan_memory(config, ModelShape.from_model_dir(model_dir), 80 * GiB, on_gpu=True, flash_attention=True)
    terms = plan.terms
    assert set(plan.phases) == {"trainer_gpu", "engine_gpu"}
    runtime = terms["cuda_contexts"] + terms["nccl_buffers"]
    assert runtime == 512 * 2**20 + GiB  # one process per GPU
    # SGLang receives a broadcast bucket into a flat tensor of its own: one bucket, at least the embedding
    shape = ModelShape.from_model_dir(model_dir)
    assert terms["engine_receive_bucket"] >= shape.vocab * shape.hidden * 2
    assert terms["engine_receive_bucket"] == terms["weight_sync_staging"] // 2  # one of the trainer's two buffers
    assert plan.phases["engine_gpu"] == (terms["engine_weights"] + terms["engine_kv_cache"] + terms["engine_unreleased"]
                                         + terms["engine_receive_bucket"] + runtime)
    # backward's two transients never coexist: only the larger counts
    smaller = min(terms["logprob_head_backward"], terms["gradient_reduce"])
    assert plan.phases["trainer_gpu"] == sum(v for k, v in terms.items() if not k.startswith("engine")) - smaller


def test_a_plan_that_cannot_fit_names_the_term_to_change(tmp_path):
    model_dir = tmp_path
    (model_dir / "config.json").write_text(json.dumps(dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                                                           **QWEN["7b"])))
    shape = ModelShape.from_model_dir(model_dir)
    tight = _config(model_dir, trainer={"gradient_checkpointing": False, "num_ranks": 8})
    plan = plan_memory(tight, shape, 80 * GiB, on_gpu=True, flash_attention=True)
    assert not plan.fits
    assert "largest term activations" in plan.advice and "trainer.gradient_checkpointing=true" in plan.advice
    roomy = plan_memory(_config(model_dir), shape, 80 * GiB, on_gpu=True, flash_attention=True)
    assert roomy.fits
    small = plan_memory(_config(model_dir), shape, 24 * GiB, on_gpu=True, flash_attention=True)
    assert not small.fits and "engine_weights" in small.advice  # 15 GB of weights in half of 24 GB


def test_train_refuses_a_config_that_cannot_fit(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                                                          **QWEN["7b"])))
    with pytest.raises(ConfigError, match="memory plan: .*rlsys plan CONFIG"):
        _plan_for_devices(_config(tmp_path, placement={"gpu_memory_gb": 24}), on_gpu=True, device_memory=80 * GiB,
                         flash_attention=True)


def test_train_plans_for_the_placements_devices_not_the_drivers(tmp_path):
    """The driver (a GPU-less head) passes what the nodes reported: 80 GB GPUs fit a 7B colocated
    run that 24 GB GPUs do not, whatever this machine has."""
    (tmp_path / "config.json").write_text(json.dumps(dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                                                          **QWEN["7b"])))
    plan = _plan_for_devices(_config(tmp_path), on_gpu=True, device_memory=80 * GiB, flash_attention=True)
    assert plan.fits and plan.gpu_memory_bytes == 80 * GiB
    with pytest.raises(ConfigError, match="memory plan"):
        _plan_for_devices(_config(tmp_path), on_gpu=True, device_memory=24 * GiB, flash_attention=True)


def test_plan_for_cuda_on_a_machine_without_a_gpu_asks_for_the_gpu_memory(tmp_path, tiny_model_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU to read")
    with pytest.raises(ConfigError, match="set placement.gpu_memory_gb"):
        memory_plan(_config(tiny_model_dir, placement={"device": "cuda"}))


def test_plan_json_on_the_command_line(tiny_model_dir):
    result = subprocess.run(
        [sys.executable, "-m", "rlsys.cli", "plan", str(REPO / "configs/quickstart.yaml"),
         f"model.path={tiny_model_dir}", "placement.gpu_memory_gb=16", "--json"],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["fits"] is True and plan["gpu_memory_bytes"] == 16 * GiB
    assert plan["per_gpu_bytes"] == max(plan["phases"].values())
    assert {"trainer_params", "activations", "logits_chunk", "engine_kv_cache"} <= plan["terms"].keys()
    too_small = subprocess.run(
        [sys.executable, "-m", "rlsys.cli", "plan", str(REPO / "configs/quickstart.yaml"),
         f"model.path={tiny_model_dir}", "placement.gpu_memory_gb=0.001"],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert too_small.returncode == 1 and "does NOT fit" in too_small.stdout


def test_gpu_memory_must_be_positive():
    with pytest.raises(ValueError, match="gpu_memory_gb"):
        RunConfig.model_validate({"model": {"path": "m"}, "data": {"synthetic": {"task": "max_digit"}},
                                  "placement": {"gpu_memory_gb": 0}})


def test_a_processs_peak_memory_is_its_own_not_its_forking_parents():
    """Measured peaks (the test above, trainer load reports) come from the process's own address
    space: getrusage's ru_maxrss also counts the image before exec, so a child of a test runner
    holding gigabytes reported at least the runner's RSS as its own peak."""
    held = b"\x01" * (1 << 30)  # the parent (this test runner) holds 1 GiB more
    probe = "from rlsys.actors.trainer import peak_resident_bytes; print(peak_resident_bytes())"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.split()[-1]) < len(held)  # the child itself never held 1 GiB


def _qwen_dir(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps(dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                                                          max_position_embeddings=32768, **QWEN[name])))
    return tmp_path


def _recipe(name, model_dir, *overrides):
    return load_config(REPO / f"configs/{name}.yaml", [f"model.path={model_dir}", *overrides])


@pytest.mark.parametrize("name", ["7b", "14b"])
def test_gpu_colocated_recipe_plans_every_term_as_the_hand_sum(tmp_path, name):
    """configs/gpu_colocated.yaml (8 ranks, 16,384-token micro-batches, checkpointing, KL loss, 512 MB
    buckets, 0.5 of the GPU for SGLang) with Qwen2.5-7B / 14B on 80 GiB GPUs, term by term."""
    model_dir = _qwen_dir(tmp_path, name)
    q = QWEN[name]
    h, i, n_layers, v = q["hidden_size"], q["intermediate_size"], q["num_hidden_layers"], q["vocab_size"]
    kv = q["num_key_value_heads"] * h // q["num_attention_heads"]
    layer = 2 * h * h + 2 * h * kv + (h + 2 * kv) + 3 * h * i + 2 * h  # q,o; k,v; qkv bias; MLP; two norms
    root = 2 * v * h + h  # embeddings, untied output layer, final norm
    p = n_layers * layer + root
    assert p == PARAMS[name]
    tokens = 16384
    kv_per_token = 2 * n_layers * kv * 2  # K and V, every layer, bf16
    kv_tokens = min(262144, (int(0.5 * 80 * GiB) - 2 * p) // kv_per_token)
    expected = {
        "trainer_params": 4 * p // 8,  # fp32 master weights over 8 ranks
        "trainer_grads": 4 * p // 8,
        "optimizer_states": 8 * p // 8,  # AdamW's two fp32 moments
        "unsharded_layers": 2 * layer * 2,  # one gathered + one prefetched, bf16
        "unsharded_root": root * 2,
        # checkpointed: every layer's bf16 input, plus one layer recomputed (the per-token estimate:
        # 8 hidden + 2 kv + 4 intermediate bf16 values and two fp32 norm upcasts)
        "activations": n_layers * tokens * h * 2 + ((8 * h + 2 * kv + 4 * i) * 2 + 2 * h * 4) * tokens,
        "attention_scores": 0,  # flash-attn
        # no context parallelism: none of its attention's terms
        "attention_saved": 0, "attention_block": 0, "ring_buffers": 0, "ulysses_buffers": 0,
        "logits_chunk": 3 * 512 * v * 4,
        "reference_model": (2 * layer + root) * 2,  # KL loss: the reference's gathered layers and root
        "reference_on_device": 0,  # its fp32 shards on the host (trainer.reference_placement=host)
        # the output layer's weight gradient: fp32 accumulator + a chunk's bf16 [v, h] product + its fp32 copy
        "logprob_head_backward": (4 + 2 + 4) * v * h,
        # the root group's reduce: bf16 gradients + fp32 reduce-scatter input + fp32 output shard
        # (every dim 0 divides by 8: no padding)
        "gradient_reduce": root * 2 + root * 4 + root * 4 // 8,
        # two staging buffers (pipelined): 30 (7B) or 60 (14B) buckets of 512 MB take turns, so the
        # embedding (bucket 0) and the output layer (the last, odd) each fill one alone, bf16, aligned
        "weight_sync_staging": 2 * (v * h * 2 + 16),
        "engine_weights": 2 * p,
        "cuda_contexts": 2 * 512 * 2**20,  # a trainer rank and an engine per GPU
        "nccl_buffers": 2 * GiB,
        # kept through a release: the attention workspace, an 8,192-token prefill chunk's MLP blocks
        "engine_unreleased": 512 * 2**20 + 8192 * (2 * h + 3 * i) * 2,
        "engine_receive_bucket": 0,  # colocated: no broadcast
        "engine_kv_cache": kv_tokens * kv_per_token,
    }
    # the root's reduce is backward's larger transient: larger than a layer's (which waits with the
    # output layer's bf16 gradient) and than the output layer's own backward
    assert layer * 2 + layer * 4 + layer * 4 // 8 + v * h * 2 < expected["gradient_reduce"]
    assert expected["logprob_head_backward"] < expected["gradient_reduce"]
    # the reference on the host, as the hand sum counts it (auto would put its shards on the device: below)
    plan = plan_memory(_recipe("gpu_colocated", model_dir, "trainer.reference_placement=host"),
                       ModelShape.from_model_dir(model_dir), 80 * GiB, on_gpu=True, flash_attention=True)
    assert plan.terms == expected
    e, runtime = expected, expected["cuda_contexts"] + expected["nccl_buffers"] + expected["engine_unreleased"]
    train = (e["trainer_params"] + e["trainer_grads"] + e["optimizer_states"] + e["unsharded_layers"]
             + e["unsharded_root"] + e["activations"] + e["logits_chunk"] + e["reference_model"]
             + e["gradient_reduce"] + runtime)
    sync = e["trainer_params"] + e["optimizer_states"] + e["unsharded_layers"] + e["weight_sync_staging"] \
        + e["engine_weights"] + runtime
    assert plan.phases == {"generate": 2 * p + kv_tokens * kv_per_token + runtime, "train": train, "sync": sync}
    assert plan.per_gpu_bytes == train < 80 * GiB and plan.fits


def test_gpu_colocated_7b_plans_host_memory_per_rank_and_per_node_as_the_hand_sum(tmp_path, monkeypatch):
    """Issue 47: configs/gpu_colocated.yaml with Qwen2.5-7B on one node of 8 x 80 GB. Each trainer rank
    keeps one page-locked arena of exactly what it moves at sleep, and the reference's shards
    page-locked in place; before, torch's caching host allocator held each of those tensors in a
    power-of-two block (~1.9x: ~216 GiB a node), and the plan counted no host memory at all."""
    model_dir = _qwen_dir(tmp_path, "7b")
    p = PARAMS["7b"]
    # 12 tensors a layer (q, k, v weights and biases, o, gate, up, down, two norms), then the
    # embeddings, the final norm and the output layer: every dim 0 divides by 8 and every shard is a
    # multiple of 64 bytes, so no padding and no alignment but each 4-byte AdamW step's.
    tensors = 28 * 12 + 3
    arena = 4 * p // 8 + 2 * 4 * p // 8 + tensors * 64  # fp32 params, AdamW's two moments, its steps
    reference = 4 * p // 8  # KL loss (the recipe's): the reference's fp32 shards
    assert (arena, reference) == (11_423_446_464, 3_807_808_256)
    host = "trainer.reference_placement=host"  # (auto: on the device, where these GPUs have room for it)
    plan = plan_memory(_recipe("gpu_colocated", model_dir, host), ModelShape.from_model_dir(model_dir), 80 * GiB,
                       on_gpu=True, flash_attention=True)
    assert plan.host_terms == {"sleep_arena": arena, "reference_shards": reference}
    assert plan.host_per_rank_bytes == arena + reference == 15_231_254_720  # 14.19 GiB
    assert plan.ranks_per_node == 8 and plan.host_per_node_bytes == 8 * (arena + reference)  # 113.48 GiB

    # `rlsys plan` on this GPU-less machine plans the GPUs placement.gpu_memory_gb names, and prints both
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["plan", str(REPO / "configs/gpu_colocated.yaml"), f"model.path={model_dir}",
                     "placement.gpu_memory_gb=80", host])
    assert code == 0, out.getvalue()
    text = out.getvalue()
    assert "per GPU of 80.0 GiB (GPUs: placement.gpu_memory_gb" in text
    assert "sleep_arena                10.64 GiB" in text and "reference_shards            3.55 GiB" in text
    assert "per rank 14.19 GiB; per node 113.48 GiB (8 trainer ranks" in text
    with contextlib.redirect_stdout(io.StringIO()) as json_out:
        main(["plan", str(REPO / "configs/gpu_colocated.yaml"), f"model.path={model_dir}",
              "placement.gpu_memory_gb=80", host, "--gpus-per-node", "4", "--json"])
    as_json = json.loads(json_out.getvalue())
    assert as_json["host_per_rank_bytes"] == arena + reference
    assert as_json["ranks_per_node"] == 4 and as_json["host_per_node_bytes"] == 4 * (arena + reference)


def test_host_memory_is_only_the_reference_on_cpu_and_without_sleep_and_none_under_lora(tmp_path):
    """On a CPU host the sleep copies replace the state (no arena kept); a trainer that never sleeps
    (disaggregated) keeps none; LoRA's reference is the policy with its adapters off."""
    model_dir = _qwen_dir(tmp_path, "7b")
    shape = ModelShape.from_model_dir(model_dir)
    reference = 4 * PARAMS["7b"] // 8
    cpu = plan_memory(_recipe("gpu_colocated", model_dir, "trainer.offload_between_steps=true"), shape, 80 * GiB,
                      on_gpu=False)
    assert cpu.host_terms == {"sleep_arena": 0, "reference_shards": reference} and cpu.ranks_per_node == 8
    apart = plan_memory(_recipe("gpu_disaggregated", model_dir), shape, 80 * GiB, on_gpu=True, flash_attention=True)
    assert apart.host_terms["sleep_arena"] == 0
    lora = _recipe("gpu_colocated", model_dir, "model.lora={rank: 16, alpha: 32}")
    adapted = plan_memory(lora, ModelShape.from_model_dir(model_dir, lora.model.lora), 80 * GiB, on_gpu=True,
                          flash_attention=True)
    a = 40_370_176  # the adapters' parameters (the LoRA test below)
    assert adapted.host_terms == {"sleep_arena": 4 * PARAMS["7b"] // 8 + 3 * (4 * a // 8), "reference_shards": 0}


def test_host_memory_counts_fsdps_dim0_padding_and_the_64_byte_alignment(tmp_path):
    """Qwen2.5-1.5B over 3 ranks: 1,536 rows divide by 3, but the k/v projections' 256 do not
    (86 rows on rank 0), nor the 151,936-row embedding (50,646), nor 8,960 (2,987)."""
    model_dir = _qwen_dir(tmp_path, "1.5b")
    shape = ModelShape.from_model_dir(model_dir)
    config = _recipe("gpu_colocated", model_dir, "trainer.num_ranks=3", "rollout.num_engines=3",
                     "trainer.reference_placement=host")
    plan = plan_memory(config, shape, 80 * GiB, on_gpu=True, flash_attention=True)

    def rank0(shape_, element_bytes=4, alignment=1):
        nbytes = -(-shape_[0] // 3) * math.prod(shape_[1:]) * element_bytes
        return -(-nbytes // alignment) * alignment

    assert plan.host_terms["reference_shards"] == sum(rank0(s) for s in shape.param_shapes)
    assert plan.host_terms["sleep_arena"] == 3 * sum(rank0(s, alignment=64) for s in shape.param_shapes) \
        + 64 * len(shape.param_shapes)
    assert plan.host_terms["reference_shards"] > 4 * PARAMS["1.5b"] // 3  # the padding


@pytest.mark.parametrize("name, gpu_gb, overrides, label", [
    ("1.5b", 80, (), "Qwen2.5-1.5B, 8 x 80 GB"),
    ("7b", 80, (), "Qwen2.5-7B, 8 x 80 GB"),
    ("32b", 141, ("rollout.engine.mem_fraction_static=0.6",), "Qwen2.5-32B, 8 x 141 GB"),
    ("32b", 141, ("rollout.engine.mem_fraction_static=0.6", "trainer.num_ranks=16", "rollout.num_engines=16"),
     "Qwen2.5-32B, 16 x 141 GB over two nodes"),
])
def test_the_docs_host_memory_table_is_the_plans(tmp_path, name, gpu_gb, overrides, label):
    """Per rank and per node as the recipe plans them (trainer.reference_placement auto: the reference's
    shards on the device, where each of these fits), and the reference's host shards when placed there."""
    model_dir = _qwen_dir(tmp_path, name)
    shape = ModelShape.from_model_dir(model_dir)
    plan = plan_memory(_recipe("gpu_colocated", model_dir, *overrides), shape, gpu_gb * GiB, on_gpu=True,
                       flash_attention=True)
    on_host = plan_memory(_recipe("gpu_colocated", model_dir, *overrides, "trainer.reference_placement=host"), shape,
                          gpu_gb * GiB, on_gpu=True, flash_attention=True)
    assert plan.fits and plan.reference_on_device and plan.host_terms["reference_shards"] == 0, plan.table()
    row = next(line for line in (REPO / "docs/gpus-and-clusters.md").read_text().splitlines()
               if line.startswith(f"| {label}"))
    figures = [f"{plan.host_terms['sleep_arena'] / GiB:.2f} GiB", f"{plan.host_per_rank_bytes / GiB:.2f} GiB",
               f"{plan.host_per_node_bytes / GiB:.1f} GiB",
               f"{on_host.host_terms['reference_shards'] / GiB:.2f} GiB"]
    assert row.split(" | ")[1:] == [*figures[:3], figures[3] + " |"], row


def _fake_cluster(gpus, memory):
    return lambda: (gpus, memory)


@pytest.mark.parametrize("device, local, cluster, gpu_memory_gb, expected", [
    # a GPU-less head asking the Ray cluster: its GPUs and their memory, not the head's RAM
    ("auto", None, _fake_cluster(16.0, 80 * GiB), None, (True, 80 * GiB, "the smallest GPU of the Ray cluster (NVML)")),
    ("cuda", None, _fake_cluster(16.0, 80 * GiB), None, (True, 80 * GiB, "the smallest GPU of the Ray cluster (NVML)")),
    ("auto", None, _fake_cluster(16.0, None), 141, (True, 141 * GiB, "placement.gpu_memory_gb")),
    ("auto", None, _fake_cluster(0.0, None), None, (False, 7 * GiB, "the Ray cluster has no GPUs: a CPU run, this "
                                                                     "machine's RAM")),
    # no cluster named: a GPU's memory given means GPUs
    ("auto", None, None, 80, (True, 80 * GiB, "placement.gpu_memory_gb (no GPU on this machine)")),
    ("cuda", None, None, 80, (True, 80 * GiB, "placement.gpu_memory_gb (no GPU on this machine)")),
    ("auto", None, None, None, (False, 7 * GiB, None)),
    # a GPU here, or the CPU asked for
    ("auto", 94 * GiB, None, None, (True, 94 * GiB, "this machine's GPU")),
    ("cpu", 94 * GiB, _fake_cluster(16.0, 80 * GiB), None, (False, 7 * GiB, "this machine's RAM")),
])
def test_plan_plans_the_clusters_gpus_from_a_gpu_less_head(tmp_path, device, local, cluster, gpu_memory_gb, expected):
    from rlsys.plan.plan_device import plan_device

    config = _config(tmp_path, placement={"device": device, "gpu_memory_gb": gpu_memory_gb})
    on_gpu, memory, source = plan_device(config, local, 7 * GiB, cluster)
    assert (on_gpu, memory) == expected[:2]
    assert expected[2] is None and "no GPU here and no Ray cluster named" in source or source == expected[2]


@pytest.mark.parametrize("device, cluster, message", [
    ("cuda", None, "set placement.gpu_memory_gb"),
    ("cuda", _fake_cluster(0.0, None), "the Ray cluster has no GPUs"),
    ("auto", _fake_cluster(8.0, None), "their memory could not be read .*set placement.gpu_memory_gb"),
])
def test_plan_asks_for_the_gpu_memory_it_cannot_read(tmp_path, device, cluster, message):
    from rlsys.plan.plan_device import plan_device

    with pytest.raises(ConfigError, match=message):
        plan_device(_config(tmp_path, placement={"device": device}), None, 7 * GiB, cluster)


def test_32b_does_not_fit_8x80_colocated_with_the_recipes_settings(tmp_path):
    """Qwen2.5-32B, colocated (one engine per GPU, tp 1): its bf16 weights (65.5 GB) exceed half a
    GPU, and even with the whole static pool the sync phase (trainer shards and moments beside the
    engine's weights) needs more than 80 GiB."""
    model_dir = _qwen_dir(tmp_path, "32b")
    shape = ModelShape.from_model_dir(model_dir)
    p = PARAMS["32b"]
    plan = plan_memory(_recipe("gpu_colocated", model_dir), shape, 80 * GiB, on_gpu=True, flash_attention=True)
    assert 2 * p > 0.5 * 80 * GiB and not plan.fits and "engine_weights" in plan.advice
    roomy_pool = plan_memory(_recipe("gpu_colocated", model_dir, "rollout.engine.mem_fraction_static=0.9"), shape,
                             80 * GiB, on_gpu=True, flash_attention=True)
    sync = 4 * p // 8 + 8 * p // 8 + 2 * p  # params + AdamW moments + engine weights, before anything else
    assert sync > 80 * GiB and not roomy_pool.fits and "sync needs" in roomy_pool.advice


def test_gpu_recipes_fit_their_models_on_80gb(tmp_path):
    """The recipes' own model (1.5B) and the 7B and 14B the README plans with them."""
    for name in ("1.5b", "7b", "14b"):
        (tmp_path / name).mkdir()
        model_dir = _qwen_dir(tmp_path / name, name)
        for recipe in ("gpu_colocated", "gpu_disaggregated"):
            plan = _plan_for_devices(_recipe(recipe, model_dir), on_gpu=True, device_memory=80 * GiB,
                                    flash_attention=True)
            assert plan.fits, (name, recipe, plan.table())


def test_train_refuses_what_the_output_layer_and_reduce_scatter_push_past_the_gpu(tmp_path):
    """Qwen2.5-14B disaggregated over 4 trainer ranks on 80 GiB GPUs: without the output layer's
    gradient, FSDP's fp32 reduce-scatter input, the real staging buffers (two, pipelined) and the CUDA
    context and NCCL buffers, the trainer GPU's sum is 75.4 GiB and the run was let start; it needs
    89.4 GiB (88.0 with weight_sync.pipelined off)."""
    model_dir = _qwen_dir(tmp_path, "14b")
    config = _recipe("gpu_disaggregated", model_dir, "trainer.num_ranks=4")
    plan = plan_memory(config, ModelShape.from_model_dir(model_dir), 80 * GiB, on_gpu=True, flash_attention=True)
    t = plan.terms
    v, h, root, p = 152064, 5120, 2 * 152064 * 5120 + 5120, PARAMS["14b"]
    assert t["gradient_reduce"] == root * 2 + root * 4 + root * 4 // 4  # root's bf16 grads, fp32 input and shard
    assert t["weight_sync_staging"] == 2 * (v * h * 2 + 16) > 2 * 512 * 2**20  # two buffers, each an [v, h]
    assert t["cuda_contexts"] + t["nccl_buffers"] == 512 * 2**20 + GiB
    left_out = t["gradient_reduce"] + t["weight_sync_staging"] - 512 * 2**20 + t["cuda_contexts"] + t["nccl_buffers"]
    assert plan.phases["trainer_gpu"] - left_out < 80 * GiB < plan.phases["trainer_gpu"]
    assert 16 * p // 4 < plan.phases["trainer_gpu"]  # the sharded state alone is 16 bytes a parameter / 4
    with pytest.raises(ConfigError, match="memory plan: trainer_gpu needs 89.4 GiB of 80.0 GiB"):
        _plan_for_devices(config, on_gpu=True, device_memory=80 * GiB, flash_attention=True)
    serial = load_config(REPO / "configs/gpu_disaggregated.yaml", [f"model.path={model_dir}", "trainer.num_ranks=4",
                                                                     "weight_sync.pipelined=false"])
    with pytest.raises(ConfigError, match="memory plan: trainer_gpu needs 88.0 GiB of 80.0 GiB"):
        _plan_for_devices(serial, on_gpu=True, device_memory=80 * GiB, flash_attention=True)


def test_lora_plans_gradients_and_moments_for_the_adapters_only_and_no_reference_model(tmp_path):
    """configs/gpu_colocated.yaml with Qwen2.5-7B and model.lora (rank 16, all-linear) on 80 GiB
    GPUs: the terms that change, as hand sums (docs/operations.md quotes the saving)."""
    model_dir = _qwen_dir(tmp_path, "7b")
    q = QWEN["7b"]
    h, i, n_layers = q["hidden_size"], q["intermediate_size"], q["num_hidden_layers"]
    kv = q["num_key_value_heads"] * h // q["num_attention_heads"]
    layer = 2 * h * h + 2 * h * kv + (h + 2 * kv) + 3 * h * i + 2 * h
    r = 16
    layer_adapters = r * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h))  # q, k and v, o, gate and up, down
    a = n_layers * layer_adapters
    p = PARAMS["7b"]
    config = _recipe("gpu_colocated", model_dir)
    lora = _recipe("gpu_colocated", model_dir, f"model.lora={{rank: {r}, alpha: 32}}")
    full = plan_memory(config, ModelShape.from_model_dir(model_dir), 80 * GiB, on_gpu=True, flash_attention=True)
    plan = plan_memory(lora, ModelShape.from_model_dir(model_dir, lora.model.lora), 80 * GiB, on_gpu=True,
                       flash_attention=True)
    assert a == 40_370_176  # 0.53% of the 7.6B
    changed = {
        "trainer_params": 4 * (p + a) // 8,  # the fp32 base stays sharded beside the adapters
        "trainer_grads": 4 * a // 8,
        "optimizer_states": 8 * a // 8,
        "unsharded_layers": 2 * (layer + layer_adapters) * 2,
        "reference_model": 0,  # the base with the adapters off
        "reference_on_device": 0,
        "logprob_head_backward": 0,  # the output layer is frozen
        "gradient_reduce": layer_adapters * 2 + layer_adapters * 4 + layer_adapters * 4 // 8,
    }
    assert {name: plan.terms[name] for name in changed} == changed
    assert {name: value for name, value in plan.terms.items() if name not in changed} == \
        {name: value for name, value in full.terms.items() if name not in changed}
    saved = full.phases["train"] - plan.phases["train"]
    print(f"LoRA r16 on Qwen2.5-7B: train phase {full.phases['train'] / GiB:.1f} -> {plan.phases['train'] / GiB:.1f} "
          f"GiB per GPU (saves {saved / GiB:.1f}); sync phase {full.phases['sync'] / GiB:.1f} -> "
          f"{plan.phases['sync'] / GiB:.1f}")
    assert saved > 10 * GiB


# ---- context parallelism (issue 48): a rank's share of each sequence, and the CP attention's terms ----
HQ, HKV, D, BF16, LAYERS = 28, 4, 128, 2, 28  # Qwen2.5-7B's attention


def _long(model_dir, *overrides):
    """configs/gpu_colocated.yaml with 32k-token sequences and no checkpointing (docs/long-sequences.md)."""
    return _recipe("gpu_colocated", model_dir, "rollout.engine.context_length=32768", "rollout.max_new_tokens=30720",
                   "trainer.max_tokens_per_microbatch=4096", "trainer.gradient_checkpointing=false", *overrides)


def _train_phase(plan) -> int:
    t = plan.terms
    layer_backward = t["gradient_reduce"] + t["attention_block"] + t["ring_buffers"] + t["ulysses_buffers"]
    return (t["trainer_params"] + t["trainer_grads"] + t["optimizer_states"] + t["unsharded_layers"]
            + t["unsharded_root"] + t["activations"] + t["attention_scores"] + t["attention_saved"]
            + t["logits_chunk"] + t["reference_model"] + max(t["logprob_head_backward"], layer_backward)
            + t["cuda_contexts"] + t["nccl_buffers"] + t["engine_unreleased"])


def test_a_ranks_largest_micro_batch_is_the_budget_or_its_share_of_the_longest_sequence():
    """The trainer's own micro-batching (`TrainerWorker._micro_batches`, then each rank's zigzag
    chunks): a rank's tokens per micro-batch stay within the budget, except one sequence whose share
    is more, which goes alone: padded to a multiple of 2 x CP, over CP (32,769 tokens at CP 4:
    32,776 / 4 = 8,194). The plan's `rank_tokens` is that largest micro-batch."""
    from types import SimpleNamespace

    import torch

    from actors.cp_layout import ContextParallelGroup
    from actors.trainer import TrainerWorker
    from rlsys.plan.context_parallel_plan import rank_tokens
    from rlsys.records import TrainSequence

    lengths = [8192] * 8 + [32769, 700, 3000]  # the 8,192s' shares fill each budget below exactly
    sequences = [TrainSequence(token_ids=[1] * n, prompt_len=n - 1) for n in lengths]
    for cp, budget, expected in [(1, 4096, 32769), (4, 4096, 8194), (4, 16384, 16384), (8, 8192, 8192),
                                 (2, 32768, 32768)]:
        config = RunConfig.model_validate({
            "model": {"path": "m"}, "data": {"synthetic": {"task": "max_digit"}},
            "rollout": {"engine": {"context_length": 32769}},
            "trainer": {"num_ranks": 8, "context_parallel_size": cp, "max_tokens_per_microbatch": budget}})
        worker = SimpleNamespace(spec=SimpleNamespace(trainer=config.trainer), _global_max=lambda n: n, _pad_id=0,
                                 device=torch.device("cpu"), models=SimpleNamespace(vision=None),
                                 context_parallel=ContextParallelGroup(None, 0, cp) if cp > 1 else None)
        batches = TrainerWorker._micro_batches(worker, sequences, list(range(len(sequences))))
        largest = max(batch.input_ids.shape[1] for batch in batches)
        assert rank_tokens(config, 32769) == expected
        assert largest == expected, (cp, budget, largest)


def test_context_parallel_divides_a_ranks_activations_and_adds_the_rings_terms(tmp_path):
    """Qwen2.5-7B, one 32k-token sequence, ring CP 4 against one rank: a rank holds 8,192 tokens,
    its activations a quarter; the ring's terms as hand sums."""
    model_dir = _qwen_dir(tmp_path, "7b")
    shape = ModelShape.from_model_dir(model_dir)
    one = plan_memory(_long(model_dir), shape, 80 * GiB, on_gpu=True, flash_attention=True)
    four = plan_memory(_long(model_dir, "trainer.context_parallel_size=4"), shape, 80 * GiB, on_gpu=True,
                       flash_attention=True)
    assert (one.rank_tokens, four.rank_tokens) == (32768, 8192)
    assert four.terms["activations"] * 4 == one.terms["activations"]
    assert four.terms["logits_chunk"] == one.terms["logits_chunk"]  # 512-token chunks either way
    t = 8192
    out_and_lse = HQ * t * (D + 1) * 4  # fp32 [Hq, T, D] and [Hq, T]
    expected = {
        "attention_scores": 0,  # neither flash-attn nor SDPA: the CP attention
        "attention_saved": LAYERS * out_and_lse,  # every layer's, without checkpointing
        # the largest block, step 0: both local chunks (8,192 tokens) against themselves. A row of fp32
        # scores is 32 KiB; one group of 7 query heads' rows: 7 x 32 KiB, so 256 MiB holds 1,170 rows
        "attention_block": (out_and_lse + 2 * HKV * t * D * 4  # the block's fp32 dq and delta; dk, dv
                            + HQ * t * (2 * D * BF16 + 4 * D + 4) + 2 * HKV * t * D * BF16  # its selected inputs
                            + 2 * 7 * 1170 * D * 4 + 2 * 7 * t * D * 4  # the piece's fp32 q, dO rows; k, v
                            + 4 * 4 * 7 * 1170 * t),  # scores, p, dO v^T - delta, ds of 1,170 rows
        # own and received key/values (bf16), their travelling fp32 gradients and the received ones, fp32 dq
        "ring_buffers": 2 * (2 * HKV * t * D * BF16) + 2 * (2 * HKV * t * D * 4) + HQ * t * D * 4,
        "ulysses_buffers": 0,
    }
    assert {name: four.terms[name] for name in expected} == expected
    assert not any(one.terms[name] for name in ("attention_saved", "attention_block", "ring_buffers"))
    # a layer's backward (its attention, FSDP reducing the layer before) is backward's larger transient
    assert four.phases["train"] == _train_phase(four)
    assert four.terms["gradient_reduce"] + four.terms["attention_block"] > four.terms["logprob_head_backward"]


def test_ulysses_plans_head_split_buffers_and_whole_sequence_blocks(tmp_path):
    """Ulysses at CP 4: 7 of the 28 query heads and 1 of the 4 key/value heads over the whole padded
    sequence; with checkpointing one layer's saved tensors."""
    model_dir = _qwen_dir(tmp_path, "7b")
    plan = plan_memory(_long(model_dir, "trainer.context_parallel_size=4", "trainer.context_parallel_style=ulysses",
                             "trainer.gradient_checkpointing=true"), ModelShape.from_model_dir(model_dir), 80 * GiB,
                       on_gpu=True, flash_attention=True)
    t, whole = 8192, 32768
    qkv = (HQ + 2 * HKV) * t * D * BF16
    out_and_lse = HQ * t * (D + 1) * 4
    assert plan.terms["attention_saved"] == out_and_lse + qkv  # one layer: fp32 out, lse, head-split q, k, v
    assert plan.terms["ulysses_buffers"] == 3 * qkv  # send, receive, head-major copy
    assert plan.terms["ring_buffers"] == 0
    # 7 heads (one key/value group) over the whole sequence: a row of fp32 scores is 128 KiB, 7 heads'
    # 896 KiB, so 256 MiB holds 292 rows
    assert plan.terms["attention_block"] == (out_and_lse + 2 * HKV * t * D * 4 + 2 * 7 * 292 * D * 4
                                             + 2 * 7 * whole * D * 4 + 4 * 4 * 7 * 292 * whole)
    with pytest.raises(ConfigError, match="must both divide by context_parallel_size=8"):
        plan_memory(_long(model_dir, "trainer.context_parallel_size=8", "trainer.context_parallel_style=ulysses"),
                    ModelShape.from_model_dir(model_dir), 80 * GiB)


def test_plan_names_the_smallest_context_parallel_size_that_fits_the_longest_sequence(tmp_path, monkeypatch):
    """32k-token sequences without checkpointing: one rank needs 237 GiB, CP 2 and 4 too much still,
    CP 8 fits. `rlsys plan` prints it, and `rlsys train` refuses the config with the same words."""
    model_dir = _qwen_dir(tmp_path, "7b")
    shape = ModelShape.from_model_dir(model_dir)
    fits = {cp: plan_memory(_long(model_dir, f"trainer.context_parallel_size={cp}"), shape, 80 * GiB, on_gpu=True,
                            flash_attention=True).fits for cp in (1, 2, 4, 8)}
    assert fits == {1: False, 2: False, 4: False, 8: True}
    plan = plan_memory(_long(model_dir), shape, 80 * GiB, on_gpu=True, flash_attention=True)
    assert plan.smallest_context_parallel == 8
    assert plan.advice.startswith("the longest sequence (32,768 tokens: rollout.engine.context_length")
    assert "does not fit a rank even alone" in plan.advice
    assert plan.advice.endswith("set trainer.context_parallel_size=8, the smallest that fits")
    with pytest.raises(ConfigError, match=r"does not fit a rank even alone.*context_parallel_size=8, the smallest"):
        _plan_for_devices(_long(model_dir), on_gpu=True, device_memory=80 * GiB, flash_attention=True)

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["plan", str(REPO / "configs/gpu_colocated.yaml"), f"model.path={model_dir}",
                     "placement.gpu_memory_gb=80", "rollout.engine.context_length=32768",
                     "rollout.max_new_tokens=30720", "trainer.max_tokens_per_microbatch=4096",
                     "trainer.gradient_checkpointing=false"])
    assert code == 1
    assert "  smallest trainer.context_parallel_size that fits: 8\n" in out.getvalue()
    assert "micro-batch of 32,768 tokens a rank; longest sequence 32,768 tokens" in out.getvalue()

    # with a budget above the share, CP 8 fits only with the budget lowered to it
    budget = plan_memory(_long(model_dir, "trainer.max_tokens_per_microbatch=16384"), shape, 80 * GiB, on_gpu=True,
                         flash_attention=True)
    assert budget.advice.endswith("set trainer.context_parallel_size=8 with trainer.max_tokens_per_microbatch<=4,096 "
                                  "(its share of the longest sequence), the smallest that fits")


def test_plan_refuses_a_longest_sequence_no_context_parallel_size_fits(tmp_path):
    """128k tokens without checkpointing fit no CP dividing 8 ranks; a sequence-level loss cannot use CP;
    and a budget too large for the device is the budget's fault, not the sequence's (the old advice)."""
    model_dir = _qwen_dir(tmp_path, "7b")
    with pytest.raises(ConfigError, match=r"does not fit a rank even alone: 131,072 tokens a rank .* no "
                                          r"trainer.context_parallel_size dividing trainer.num_ranks=8 fits it"):
        _plan_for_devices(_long(model_dir, "rollout.engine.context_length=131072"), on_gpu=True,
                         device_memory=80 * GiB, flash_attention=True)
    with pytest.raises(ConfigError, match=r"even alone.*context parallelism cannot split it: algorithm.policy_loss=gspo"):
        _plan_for_devices(_long(model_dir, "algorithm.policy_loss=gspo"), on_gpu=True, device_memory=80 * GiB,
                         flash_attention=True)
    budget = plan_memory(_long(model_dir, "trainer.context_parallel_size=8", "trainer.max_tokens_per_microbatch=16384"),
                         ModelShape.from_model_dir(model_dir), 80 * GiB, on_gpu=True, flash_attention=True)
    assert not budget.fits and budget.smallest_context_parallel is None
    assert "largest term activations" in budget.advice and "max_tokens_per_microbatch" in budget.advice


def test_the_long_sequences_page_figures_are_the_plans(tmp_path):
    """docs/long-sequences.md: its memory table is the plan's, its `rlsys plan` verdict the plan's
    words, and its communication table the ring's and Ulysses' arithmetic."""
    page = (REPO / "docs/long-sequences.md").read_text()
    model_dir = _qwen_dir(tmp_path, "7b")
    shape = ModelShape.from_model_dir(model_dir)
    for cp in (1, 2, 4, 8):
        plan = plan_memory(_long(model_dir, f"trainer.context_parallel_size={cp}"), shape, 80 * GiB, on_gpu=True,
                           flash_attention=True)
        checkpointed = plan_memory(_long(model_dir, f"trainer.context_parallel_size={cp}",
                                         "trainer.gradient_checkpointing=true"), shape, 80 * GiB, on_gpu=True,
                                   flash_attention=True)
        t = plan.terms
        row = (f"| {cp} | {plan.rank_tokens:,} | " + " | ".join(
            f"{t[name] / GiB:.2f}" for name in ("activations", "attention_saved", "attention_block", "ring_buffers"))
            + f" | {plan.phases['train'] / GiB:.1f} | {checkpointed.phases['train'] / GiB:.1f} |")
        assert row in page.splitlines(), row
        if cp == 1:
            assert f"does NOT fit: {plan.advice}" in page
    # one 32,768-token sequence at CP 4: T = 8,192 tokens a rank; what a rank sends per layer
    cp, t, mib = 4, 8192, 2**20
    hop = 2 * t * HKV * D * BF16  # its key/value chunk
    ring_forward, ring_backward = (cp - 1) * hop, (cp - 1) * hop + cp * 2 * t * HKV * D * 4
    qkv, out = (HQ + 2 * HKV) * t * D * BF16, HQ * t * D * BF16
    ulysses = (qkv + out) * (cp - 1) // cp  # forward; backward the same, of the gradients
    assert (hop, ring_forward, ring_backward, ulysses) == (16 * mib, 48 * mib, 176 * mib, 96 * mib)
    assert (qkv * (cp - 1) // cp, out * (cp - 1) // cp) == (54 * mib, 42 * mib)
    sequence = {"forward": (LAYERS * ring_forward, LAYERS * ulysses),
                "train": (LAYERS * (ring_forward + ring_backward), LAYERS * 2 * ulysses),
                "checkpointed": (LAYERS * (2 * ring_forward + ring_backward), LAYERS * 3 * ulysses)}
    rows = {"forward": "| per sequence, forward (a log-prob pass, 28 layers) |",
            "train": "| per sequence, forward and backward (a train micro-batch) |",
            "checkpointed": "| the same with gradient checkpointing |"}
    for name, (ring, heads) in sequence.items():
        assert f"{rows[name]} {ring / GiB:.2f} GiB | {heads / GiB:.2f} GiB |" in page, name
    step = 256 * (sequence["checkpointed"][0] + 2 * sequence["forward"][0])
    assert f"= {step / 2**40:.1f} TiB over ring" in page


def test_a_vision_language_run_plans_its_vision_tower_on_the_training_images_as_the_hand_sum(tmp_path):
    """The vision tower runs on every patch of a micro-batch's images: at most the training prompts'
    largest image-token share of its tokens, times the patches merged into each; its blocks keep
    what a decoder layer of its widths keeps (all of them, or their inputs and one under gradient
    checkpointing), and on CPU its attention's fp32 scores, at most the patches times the largest
    image's. A text model, or data without images, plans none of it."""
    from rlsys.multimodal.image_load import image_load
    from rlsys.multimodal.vision_inputs import VisionInputs
    from rlsys.plan.gpu_terms import activation_bytes_per_token_layer
    from rlsys.run.assets import load_assets
    from rlsys.tools.tiny_model import TinyModelSpec, make_tiny_model

    vlm = make_tiny_model(tmp_path / "vlm", TinyModelSpec(arch="qwen2_5_vl"))
    config = load_config(REPO / "configs" / "quickstart_vlm.yaml", [f"model.path={vlm}", "data.synthetic.num_train=40"])
    assets = load_assets(config)
    vision = VisionInputs.for_model(vlm)
    load = assets.image_load
    grid = vision.grid(assets.train[0].record.images[0])
    image_tokens = vision.tokens_of(grid)
    shortest = min(len(p.token_ids) for p in assets.train)  # every prompt holds one image of this grid
    assert load == image_load(assets.train, vision)
    assert load.images == 40 and load.max_patches == math.prod(grid) == 4 * image_tokens
    # its placeholder becomes the image's tokens; one response token at least
    assert load.token_share == image_tokens / (shortest - 1 + image_tokens + 1)
    shape = ModelShape.from_model_dir(vlm)
    v = shape.vision
    assert (v.hidden, v.intermediate, v.blocks, v.heads, v.patches_per_token) == (32, 64, 2, 2, 4)

    plan = plan_memory(config, shape, gpu_memory=8 * GiB, on_gpu=False, images=load)
    patches = math.ceil(plan.rank_tokens * load.token_share) * 4
    per_patch_block = (8 * 32 + 2 * 32 + 4 * 64) * 4 + 2 * 32 * 4  # fp32; a block's q, k, v are all 32 wide
    assert activation_bytes_per_token_layer(
        type(shape)(**{**shape.__dict__, "hidden": 32, "kv_heads": 2, "head_dim": 16, "intermediate": 64,
                       "active_intermediate": 64}), 4) == per_patch_block
    assert plan.terms["vision_activations"] == 2 * per_patch_block * patches
    assert plan.terms["vision_attention_scores"] == patches * load.max_patches * 2 * 4 * 2  # heads, fp32, blocks
    assert any(note.startswith("images: up to ") for note in plan.notes)
    train = plan.phases["all_at_once"]
    assert train >= plan.terms["vision_activations"] + plan.terms["vision_attention_scores"]

    checkpointed = plan_memory(config.model_copy(update={"trainer": config.trainer.model_copy(
        update={"gradient_checkpointing": True})}), shape, gpu_memory=8 * GiB, on_gpu=False, images=load)
    assert checkpointed.terms["vision_activations"] == 2 * patches * 32 * 4 + per_patch_block * patches
    assert checkpointed.terms["vision_attention_scores"] == patches * load.max_patches * 2 * 4  # one block's
    on_gpu = plan_memory(config, shape, gpu_memory=80 * GiB, on_gpu=True, images=load)
    assert on_gpu.terms["vision_attention_scores"] == 0  # fused kernels keep nothing quadratic
    assert plan_memory(config, shape, gpu_memory=8 * GiB, on_gpu=False).terms["vision_activations"] == 0
