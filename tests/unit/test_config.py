"""Config loading: overrides, and bad input failing early with the field and the reason."""

import re
import subprocess
import sys

import pytest

from rlsys.config import ConfigError, load_config
from tests.helpers import REPO, refused_by_cli, write_config


def test_dotted_overrides_replace_values(tmp_path, tiny_model_dir):
    path = write_config(tmp_path / "c.yaml", tiny_model_dir)
    config = load_config(path, ["trainer.lr=1e-5", "rollout.stop=[a, b]", "eval.interval=3"])
    assert config.trainer.lr == 1e-5
    assert config.rollout.stop == ["a", "b"]
    assert config.eval.interval == 3


def test_group_size_below_two_names_the_field(tmp_path, tiny_model_dir):
    path = write_config(tmp_path / "c.yaml", tiny_model_dir)
    with pytest.raises(ConfigError) as error:
        load_config(path, ["rollout.n_samples_per_prompt=1"])
    assert "rollout" in str(error.value) and "n_samples_per_prompt must be >= 2" in str(error.value)


def test_unknown_and_mistyped_fields_are_named(tmp_path, tiny_model_dir):
    path = write_config(tmp_path / "c.yaml", tiny_model_dir)
    with pytest.raises(ConfigError) as error:
        load_config(path, ["trainer.learning_rate=1e-5", "trainer.lr=fast"])
    message = str(error.value)
    assert "trainer.learning_rate: unknown field" in message
    assert "trainer.lr:" in message and "number" in message


def test_colocated_engines_cannot_outnumber_trainer_ranks(tmp_path, tiny_model_dir):
    path = write_config(tmp_path / "c.yaml", tiny_model_dir)
    with pytest.raises(ConfigError, match="num_engines"):
        load_config(path, ["rollout.num_engines=3", "trainer.num_ranks=2"])


def test_both_or_neither_data_source_is_an_error(tmp_path, tiny_model_dir):
    path = write_config(tmp_path / "c.yaml", tiny_model_dir)
    with pytest.raises(ConfigError, match="exactly one of data.train_path or data.synthetic"):
        load_config(path, ["data.train_path=x.jsonl"])


def test_malformed_override_is_explained(tmp_path, tiny_model_dir):
    path = write_config(tmp_path / "c.yaml", tiny_model_dir)
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(path, ["trainer.lr"])


def test_cli_reports_bad_config_without_traceback_or_actors(tmp_path, tiny_model_dir):
    path = write_config(tmp_path / "c.yaml", tiny_model_dir)
    result = subprocess.run(
        [sys.executable, "-m", "rlsys.cli", "train", str(path), "trainer.lr=-1"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "trainer.lr: Input should be greater than 0" in result.stderr
    assert "Traceback" not in result.stderr
    assert "run directory" not in result.stdout  # failed before anything started


def test_missing_model_directory_fails_before_actors(tmp_path):
    from rlsys.run.assets import load_assets

    config = load_config(write_config(tmp_path / "c.yaml", tmp_path / "no-model"))
    with pytest.raises(ConfigError, match="model.path .* is not a local Hugging Face checkpoint"):
        load_assets(config)


def test_model_directory_without_weight_files_fails_before_actors(tmp_path, tiny_model_dir):
    import shutil

    from rlsys.run.assets import load_assets

    no_weights = tmp_path / "model"
    shutil.copytree(tiny_model_dir, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    config = load_config(write_config(tmp_path / "c.yaml", no_weights))
    with pytest.raises(ConfigError, match=r"holds no weight files \(\*\.safetensors"):
        load_assets(config)


def test_weights_missing_a_parameter_are_refused_before_the_ranks_build_the_model_naming_it(tmp_path, tiny_model_dir):
    """What trainer rank 0 reports before the ranks build the model (`TrainerWorker.model_report`)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from rlsys.model.checks import model_report

    damaged = tmp_path / "model"
    shutil.copytree(tiny_model_dir, damaged)
    tensors = load_file(damaged / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, damaged / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"1 parameter\(s\) .* \(e.g. model.layers.1.mlp.up_proj.weight\): "
                                          "config.json and the weight files disagree"):
        model_report(damaged)


def test_a_mixture_of_experts_checkpoint_is_checked_per_expert_before_the_ranks_build_the_model(tmp_path):
    """A Qwen3-MoE checkpoint stores one tensor per expert, which the trainer stacks: a whole one
    passes, and one missing a single expert's tensor is named before the ranks build the model."""
    from safetensors.torch import load_file, save_file

    from rlsys.model.checks import model_report
    from rlsys.model.shape import ModelShape
    from rlsys.tools.tiny_model import TinyModelSpec, make_tiny_model

    model = make_tiny_model(tmp_path / "moe", TinyModelSpec(arch="qwen3_moe"))
    assert model_report(model) == ModelShape.from_model_dir(model)
    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"1 parameter\(s\) .*model.layers.1.mlp.experts.gate_up_proj"):
        model_report(model)


@pytest.mark.parametrize("betas", ["[2.0, 0.999]", "[0.9, 1.0]", "[-0.1, 0.9]"])
def test_adam_betas_outside_zero_one_are_rejected(tmp_path, tiny_model_dir, betas):
    with pytest.raises(ConfigError, match=r"trainer: betas must each be in \[0, 1\)"):
        load_config(write_config(tmp_path / "c.yaml", tiny_model_dir), [f"trainer.betas={betas}"])


def test_sampling_options_reach_the_engine_request_and_bad_ones_are_refused(tmp_path, tiny_model_dir):
    from rlsys.run.assets import load_assets
    from rlsys.run.generation import sampling_params

    path = write_config(tmp_path / "c.yaml", tiny_model_dir)
    config = load_config(path, ["rollout.max_new_tokens=16", "rollout.engine.skip_tokenizer_init=false",
                                "rollout.sampling.top_k=5", "rollout.sampling.min_p=0.1",
                                "rollout.sampling.repetition_penalty=1.2", "rollout.sampling.min_new_tokens=4",
                                "rollout.sampling.ignore_eos=true", "rollout.sampling.stop_token_ids=[7]"])
    request = sampling_params(config, load_assets(config), temperature=0.7, top_p=0.9).as_sglang()
    assert request == {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 16, "top_k": 5, "min_p": 0.1,
                       "repetition_penalty": 1.2, "min_new_tokens": 4, "ignore_eos": True,
                       "stop_token_ids": [request["stop_token_ids"][0], 7]}  # the tokenizer's EOS, then ours
    plain = sampling_params(load_config(path), load_assets(load_config(path)), 1.0, 1.0).as_sglang()
    assert not {"top_k", "min_p", "repetition_penalty", "min_new_tokens", "ignore_eos"} & plain.keys()
    for bad, reason in [("rollout.sampling.top_k=0", "top_k must be -1"),
                        ("rollout.sampling.min_new_tokens=64", "exceeds max_new_tokens"),
                        ("rollout.sampling.min_new_tokens=1", "needs the engine's tokenizer"),
                        ("rollout.sampling.stop_token_ids=[-1]", "token ids >= 0")]:
        with pytest.raises(ConfigError, match=reason):
            load_config(path, [bad])


def test_a_config_file_that_is_not_utf8_names_its_line(tmp_path, tiny_model_dir):
    path = write_config(tmp_path / "c.yaml", tiny_model_dir)
    path.write_bytes(path.read_bytes() + b"# caf\xe9\n")
    lines = path.read_bytes().count(b"\n")
    with pytest.raises(ConfigError, match=rf"c\.yaml is not UTF-8 text \(byte 0xe9 on line {lines}\)"):
        load_config(path)
    assert "is not UTF-8 text (byte 0xe9" in refused_by_cli("train", str(path))


def test_a_model_config_json_that_is_not_json_is_refused_by_train_and_plan(tmp_path, tiny_model_dir):
    import shutil

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    (model / "config.json").write_text('{"model_type": "qwen2",\n  "hidden_size": 64,,\n}')
    path = write_config(tmp_path / "c.yaml", model)
    for command in ("train", "plan"):
        stderr = refused_by_cli(command, str(path))
        assert f"{model / 'config.json'} is not valid JSON (Expecting property name enclosed in double quotes: " \
               "line 2 column 21" in stderr, (command, stderr)


def test_a_model_config_field_of_the_wrong_type_is_one_error_line_naming_the_file_and_field(tmp_path, tiny_model_dir):
    import json
    import shutil

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    fields = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**fields, "vocab_size": "eighty"}))
    path = write_config(tmp_path / "c.yaml", model)
    stderr = refused_by_cli("plan", str(path))
    assert f"{model / 'config.json'}: Validation error for field 'vocab_size'" in stderr, stderr
    assert "expected int, got str (value: 'eighty')" in stderr and "Traceback" not in stderr
    # `rlsys train`: trainer rank 0 refuses it before the ranks build the model, the same line (its
    # ConfigError ends the run as one `rlsys: error:` line: tests/e2e/test_lora.py); the driver reads
    # config.json alone (rlsys/run/assets.py `_check_the_model`).
    from rlsys.model.checks import model_report

    with pytest.raises(ConfigError) as refused:
        model_report(model)
    assert f"{model / 'config.json'}: Validation error for field 'vocab_size'" in str(refused.value)
    assert "expected int, got str (value: 'eighty')" in str(refused.value)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "tokenizer.json"])
def test_a_tokenizer_file_that_is_not_json_is_refused_by_train_naming_it(tmp_path, tiny_model_dir, name):
    """A copy cut short: `rlsys train` names the file and model.path (or model.tokenizer_path) with
    exit 2, before anything starts (`rlsys plan` does not read the tokenizer)."""
    import json
    import shutil

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    text = (model / name).read_text()
    (model / name).write_text(text[: len(text) // 2])
    try:
        json.loads(text[: len(text) // 2])
    except json.JSONDecodeError as error:
        reason = str(error)
    path = write_config(tmp_path / "c.yaml", model)
    stderr = refused_by_cli("train", str(path))
    assert f"invalid config: model.path {model}: {model / name} is not valid JSON ({reason}); " \
           "point model.path at a complete tokenizer" in stderr, stderr
    separate = write_config(tmp_path / "separate.yaml", tiny_model_dir, model={
        "path": str(tiny_model_dir), "tokenizer_path": str(model)})
    assert f"model.tokenizer_path {model}: {model / name} is not valid JSON" in refused_by_cli("train", str(separate))


def test_a_run_dir_that_is_a_file_or_under_one_is_refused_before_anything_starts(tmp_path, tiny_model_dir):
    from rlsys.system.run_lock import RunDirLock

    path = write_config(tmp_path / "c.yaml", tiny_model_dir)
    a_file = tmp_path / "taken"
    a_file.write_text("not a directory")
    stderr = refused_by_cli("train", str(path), f"run_dir={a_file}")
    assert f"run_dir {a_file} cannot be used: {a_file} is a file, not a directory; choose another run_dir" in stderr
    with pytest.raises(ConfigError, match=f"run_dir {a_file / 'run'} cannot be used: {a_file} is a file, not a dir"):
        RunDirLock(a_file / "run").acquire()
    assert a_file.read_text() == "not a directory"


@pytest.mark.parametrize("override, shown", [
    ("trainer.total_steps=true", "trainer.total_steps: expects a number, not true/false (got true)"),
    ("trainer.lr=false", "trainer.lr: expects a number, not true/false (got false)"),
    ("eval.max_prompts=true", "eval.max_prompts: expects a number, not true/false (got true)"),
    ("rollout.mode={type: async, max_staleness: true}", "rollout.mode.max_staleness: expects a number, not true/"),
    ("trainer.betas=[true, 0.9]", "trainer.betas: expects a number, not true/false (got [true, 0.9])"),
    ("rollout.sampling.stop_token_ids=[2, true]", "rollout.sampling.stop_token_ids: expects a number"),
    ("placement.engine_node_resources={gpu_node: true}", "placement.engine_node_resources: expects a number"),
])
def test_a_boolean_where_a_number_is_expected_is_refused(tmp_path, tiny_model_dir, override, shown):
    """Read as 1 or 0 it would run silently wrong (total_steps=true: one step)."""
    path = write_config(tmp_path / "c.yaml", tiny_model_dir)
    with pytest.raises(ConfigError) as error:
        load_config(path, [override])
    assert shown in str(error.value)


def test_numbers_and_booleans_still_load_where_they_belong(tmp_path, tiny_model_dir):
    path = write_config(tmp_path / "c.yaml", tiny_model_dir)
    config = load_config(path, ["trainer.lr=1e-5", "trainer.total_steps=3", "trainer.betas=[0, 0.5]",
                                "trainer.offload_between_steps=true", "rollout.engine.radix_cache=false",
                                "placement.engine_node_resources={gpu_node: 1}", "eval.max_prompts=null"])
    assert (config.trainer.lr, config.trainer.total_steps, config.trainer.betas) == (1e-5, 3, (0.0, 0.5))
    assert config.trainer.offload_between_steps is True and config.rollout.engine.radix_cache is False
    assert config.placement.engine_node_resources == {"gpu_node": 1.0} and config.eval.max_prompts is None


def test_a_directory_given_as_the_config_is_called_a_directory(tmp_path):
    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a directory; name a YAML file"):
        load_config(tmp_path)


def test_derived_settings_are_resolved_once_after_loading_and_dumped_with_the_config(tmp_path, tiny_model_dir):
    """Validators never rewrite other sections; one resolution step after loading fills the defaults
    that depend on the rollout (loss_norm_tokens: rollout.max_new_tokens; TIS exactly when one step
    off-policy; the loss's own aggregation) unless the config sets them; RUN_DIR/config.yaml shows
    them; the trainer reads them as resolved and carries no rollout field."""
    import dataclasses

    import yaml

    from rlsys.actors.trainer import TrainerSpec
    from rlsys.config import RunConfig, dump_config, resolve_derived_settings

    path = write_config(tmp_path / "c.yaml", tiny_model_dir)
    off_policy = ["placement.mode=disaggregated", "rollout.mode=async", "rollout.max_new_tokens=12"]
    tree = yaml.safe_load(path.read_text())
    unresolved = RunConfig.model_validate({**tree, "rollout": {**tree.get("rollout", {}), "max_new_tokens": 12}})
    assert unresolved.algorithm.loss_norm_tokens is None and unresolved.algorithm.corrections is None
    config = load_config(path, off_policy)
    tis = {"name": "importance_sampling", "level": "token", "mode": "truncate", "min": None, "max": 2.0}
    assert config.algorithm.loss_norm_tokens == 12 and [c.model_dump() for c in config.algorithm.corrections] == [tis]
    assert config.algorithm.loss_agg_mode == "token-mean"  # grpo's own
    assert resolve_derived_settings(config) == config  # once resolved, it stays
    dump_config(config, tmp_path / "dumped.yaml")
    dumped = yaml.safe_load((tmp_path / "dumped.yaml").read_text())["algorithm"]
    assert (dumped["loss_norm_tokens"], dumped["corrections"], dumped["loss_agg_mode"]) == (12, [tis], "token-mean")
    assert load_config(tmp_path / "dumped.yaml") == config  # RUN_DIR/config.yaml reads back as what ran
    spec = TrainerSpec.from_config(config, has_gpu=False)
    assert spec.loss_norm_tokens == 12 and spec.corrects
    assert not {"max_new_tokens", "max_staleness", "partial_rollouts"} & {f.name for f in dataclasses.fields(spec)}
    spec = TrainerSpec.from_config(load_config(path, [*off_policy, "algorithm.loss_norm_tokens=5",
                                                      "algorithm.corrections=[]"]), has_gpu=False)
    assert spec.loss_norm_tokens == 5 and not spec.corrects
    assert not TrainerSpec.from_config(load_config(path), has_gpu=False).corrects
    assert TrainerSpec.from_config(load_config(path, ["algorithm.corrections=[icepop]"]), has_gpu=False).corrects
    assert load_config(path, ["rollout.mode=partial", "placement.mode=disaggregated"]).algorithm.corrections
    assert load_config(path, ["algorithm.policy_loss=gspo"]).algorithm.loss_agg_mode == "seq-mean-token-mean"


@pytest.mark.parametrize("policy_loss", ["grpo", "gspo", "luspo", "cispo", "sapo", "vespo"])
def test_every_policy_loss_is_accepted_with_its_own_aggregation(tmp_path, tiny_model_dir, policy_loss):
    config = load_config(write_config(tmp_path / "c.yaml", tiny_model_dir), [f"algorithm.policy_loss={policy_loss}"])
    # unset, resolved to the loss's own
    algorithm = config.algorithm
    assert algorithm.policy_loss.name == policy_loss and algorithm.loss_agg_mode == algorithm.aggregation


@pytest.mark.parametrize(("policy_loss", "mode", "own"), [
    ("gspo", "token-mean", "seq-mean-token-mean"),
    ("gspo", "seq-mean-token-sum-norm", "seq-mean-token-mean"),
    ("gspo", "seq-mean-token-sum", "seq-mean-token-mean"),
    ("luspo", "seq-mean-token-mean", "seq-mean-token-sum"),
])
def test_a_sequence_level_ratio_with_a_token_weighted_aggregation_is_refused(tmp_path, tiny_model_dir,
                                                                            policy_loss, mode, own):
    path = write_config(tmp_path / "c.yaml", tiny_model_dir)
    with pytest.raises(ConfigError) as error:
        load_config(path, [f"algorithm.policy_loss={policy_loss}", f"algorithm.loss_agg_mode={mode}"])
    message = str(error.value)
    assert f"policy_loss {policy_loss} has one ratio per sequence and takes loss_agg_mode {own}" in message
    assert f"(got {mode}: it would weigh each sequence by its length" in message


def test_vespo_with_sequence_level_importance_weights_is_refused(tmp_path, tiny_model_dir):
    path = write_config(tmp_path / "c.yaml", tiny_model_dir)
    with pytest.raises(ConfigError, match="policy_loss vespo folds the importance weights .* importance_sampling "
                                          "weigh whole sequences: use level: token"):
        load_config(path, ["algorithm.policy_loss=vespo",
                           "algorithm.corrections=[{name: importance_sampling, level: sequence}]"])
    # a sequence mask multiplies after the loss: allowed
    load_config(path, ["algorithm.policy_loss=vespo", "algorithm.corrections=[{name: geometric_mask, high: 1.01}]"])


def test_lora_targets_that_match_nothing_or_reach_past_linear_layers_are_refused_naming_the_linear_ones(
        tmp_path, tiny_model_dir):
    """target_modules matching no module, and (PEFT's all-linear on a mixture-of-experts model) ones
    that put adapters on the stacked experts and the router, are refused by trainer rank 0 before the
    ranks build the model; the message lists the layers that can carry adapters. Attention-only LoRA
    on the MoE passes."""
    from rlsys.model.checks import model_report
    from rlsys.tools.tiny_model import TinyModelSpec, make_tiny_model

    config = load_config(write_config(tmp_path / "c.yaml", tiny_model_dir), ["model.lora.target_modules=[qkv]"])
    with pytest.raises(ConfigError, match=r"target_modules \['qkv'\] match no module of .*its linear layers are "
                                          "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"):
        model_report(config.model.path, config.model.lora)
    moe = make_tiny_model(tmp_path / "moe", TinyModelSpec(arch="qwen3_moe"))
    config = load_config(write_config(tmp_path / "c.yaml", moe), ["model.lora.rank=4"])
    with pytest.raises(ConfigError, match=r"target_modules all-linear put adapters on modules .* that are not linear "
                                          r"layers \(model.layers.1.mlp.experts, model.layers.1.mlp.gate: .* "
                                          "k_proj, o_proj, q_proj, v_proj"):
        model_report(config.model.path, config.model.lora)
    config = load_config(write_config(tmp_path / "c.yaml", moe),
                         ["model.lora.rank=4", "model.lora.target_modules=[q_proj,v_proj]"])
    assert model_report(config.model.path, config.model.lora).adapter_params > 0


def test_a_lora_rank_above_the_smallest_adapted_dimension_is_refused_and_the_plan_counts_the_adapters(
        tmp_path, tiny_model_dir):
    """The tiny model's k_proj maps 64 -> 32 features: B A there has rank <= 32 whatever model.lora.rank
    says (4096 used to run, 100000 to plan as fitting). Below it, the plan's trainer terms grow with the
    adapters: gradients 4 and AdamW moments 8 bytes per adapter parameter."""
    from rlsys.model.checks import model_report
    from rlsys.model.shape import ModelShape
    from rlsys.plan.memory_plan import plan_memory

    path = write_config(tmp_path / "c.yaml", tiny_model_dir)
    why = "model.lora.rank 4096 is above the smallest dimension of the layers it adapts (32: " \
          "model.layers.0.self_attn.k_proj)"
    assert why in refused_by_cli("plan", str(path), "model.lora.rank=4096")
    # `rlsys train`: trainer rank 0 refuses it before the ranks build the model (tests/e2e/test_lora.py)
    with pytest.raises(ConfigError, match=re.escape(why)):
        model_report(tiny_model_dir, load_config(path, ["model.lora.rank=4096"]).model.lora)
    terms = {}
    for rank in (8, 32):
        config = load_config(path, [f"model.lora.rank={rank}", "trainer.num_ranks=1"])
        shape = ModelShape.from_model_dir(config.model.path, config.model.lora)
        terms[rank] = (shape.adapter_params, plan_memory(config, shape, 2**40, on_gpu=False).terms)
    (small, small_terms), (large, large_terms) = terms[8], terms[32]
    assert large == 4 * small > 0  # every adapter is r x (in + out)
    assert large_terms["optimizer_states"] - small_terms["optimizer_states"] == 8 * (large - small)
    assert large_terms["trainer_grads"] - small_terms["trainer_grads"] == 4 * (large - small)


@pytest.mark.parametrize(("model_type", "why"), [("foonet", "transformers cannot read its config.json"),
                                                 ("t5", "is not a causal language model")])
def test_an_architecture_transformers_cannot_build_as_a_causal_lm_is_refused_by_train_and_plan(
        tmp_path, tiny_model_dir, model_type, why):
    import json
    import shutil

    from rlsys.model.checks import model_report
    from rlsys.run.assets import load_assets

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    settings = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**settings, "model_type": model_type,
                                                   "architectures": ["FooNetForCausalLM"]}))
    config = load_config(write_config(tmp_path / "c.yaml", model))
    load_assets(config)  # the driver reads config.json alone: it cannot tell (rlsys/run/assets.py)
    # `rlsys train`: trainer rank 0 refuses it before the ranks build the model (tests/e2e/test_lora.py:
    # its ConfigError ends the run as one `rlsys: error:` line, exit 2)
    with pytest.raises(ConfigError, match=f"model type '{model_type}'.*{why}|{why}.*model type '{model_type}'"):
        model_report(model)
    assert f"model type '{model_type}'" in refused_by_cli("plan", str(tmp_path / "c.yaml"))


def test_stop_at_reward_needs_eval_prompts_to_reach_it(tmp_path, tiny_model_dir):
    """eval.stop_at_reward with no eval prompt could never end the run early: refused before actors."""
    from rlsys.run.assets import load_assets

    train = tmp_path / "train.jsonl"
    train.write_text("".join(f'{{"prompt": "{d} {d}>", "label": "{d}"}}\n' for d in range(10)))
    eval_ = {"interval": 10, "stop_at_reward": 0.9}
    with pytest.raises(ConfigError, match="eval.stop_at_reward is set but the data has no eval prompt"):
        load_assets(load_config(write_config(tmp_path / "c.yaml", tiny_model_dir, data={"train_path": str(train)},
                                             eval=eval_)))
    held_out = {"train_path": str(train), "eval_fraction": 0.2}
    assert load_assets(load_config(write_config(tmp_path / "c.yaml", tiny_model_dir, data=held_out, eval=eval_))).eval


def test_stop_at_reward_must_be_a_finite_number(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match="eval.stop_at_reward"):
        load_config(write_config(tmp_path / "c.yaml", tiny_model_dir, eval={"stop_at_reward": float("nan")}))


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.num_ranks=3", "trainer.context_parallel_size=2"], "context_parallel_size (2) must divide num_ranks (3)"),
    (["trainer.context_parallel_size=2", "algorithm.policy_loss=gspo"],
     "policy_loss=gspo takes a sum over each whole sequence"),
    (["trainer.context_parallel_size=2", "algorithm.corrections=[{name: importance_sampling, level: sequence}]"],
     "algorithm.corrections importance_sampling take a sum over each whole sequence"),
    (["trainer.context_parallel_size=2", "algorithm.corrections=[icepop, {name: off_policy_mask, threshold: 0.1}]"],
     "algorithm.corrections off_policy_mask take a sum over each whole sequence"),
    (["trainer.context_parallel_size=2", "trainer.packing=false"], "needs trainer.packing=true"),
    (["trainer.num_ranks=4", "trainer.context_parallel_size=4", "trainer.context_parallel_style=ulysses"],
     "the model's 4 attention heads and 2 key/value heads must both divide by context_parallel_size=4"),
])
def test_context_parallel_settings_it_cannot_run_are_refused_before_anything_starts(tiny_model_dir, overrides,
                                                                                    message):
    stderr = refused_by_cli("train", str(REPO / "configs/quickstart.yaml"), f"model.path={tiny_model_dir}", *overrides)
    assert message in stderr


@pytest.mark.parametrize("field", ["rollout.temperature", "trainer.lr", "trainer.weight_decay", "algorithm.entropy_coef",
                                   "algorithm.kl_coef", "algorithm.overlong_penalty.factor", "trainer.grad_clip",
                                   "eval.temperature", "weight_sync.timeout_s"])
@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_a_float_setting_at_infinity_or_nan_is_refused_naming_the_field(tmp_path, tiny_model_dir, field, value):
    with pytest.raises(ConfigError) as refused:
        load_config(write_config(tmp_path / "c.yaml", tiny_model_dir), [f"{field}={value}"])
    assert field in str(refused.value) and "finite number" in str(refused.value)


def test_the_run_config_names_data_and_user_function_files_by_absolute_paths(tmp_path, tiny_model_dir, monkeypatch):
    """RUN_DIR/config.yaml runs again from any directory: relative data, eval-set and function files
    are made absolute against the directory the run started in; module-style functions stay."""
    from rlsys.run.absolute_paths import with_absolute_paths

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text('{"prompt": "1 2>", "label": "2"}\n')
    path = write_config(tmp_path / "c.yaml", tiny_model_dir, data={"train_path": "train.jsonl", "eval_path": "e.jsonl"},
                        reward={"function": "rewards.py:score"},
                        eval={"datasets": [{"name": "a", "path": "a.jsonl", "reward_function": "sub/r.py:fn"},
                                           {"name": "b", "path": "/abs/b.jsonl", "reward_function": "pkg.mod:fn"}]})
    config = with_absolute_paths(load_config(path, ["rollout.generate_function=gen.py:generate"]), "run")
    assert (config.data.train_path, config.data.eval_path) == (str(tmp_path / "train.jsonl"), str(tmp_path / "e.jsonl"))
    assert config.reward.function == f"{tmp_path / 'rewards.py'}:score"
    assert config.rollout.generate_function == f"{tmp_path / 'gen.py'}:generate"
    assert [(s.path, s.reward_function) for s in config.eval.datasets] == [
        (str(tmp_path / "a.jsonl"), f"{tmp_path / 'sub/r.py'}:fn"), ("/abs/b.jsonl", "pkg.mod:fn")]
    assert config.run_dir == str(tmp_path / "run")


def test_placement_env_reaches_the_trainer_ranks_and_the_engine_servers_and_bad_names_are_refused(
        tmp_path, tiny_model_dir, monkeypatch):
    """placement.env (NCCL and gloo settings) in one place: the trainer ranks' runtime env and every
    engine's SGLang server env get it, a GLOO_SOCKET_IFNAME there replaces the one rlsys picks, YAML
    numbers and booleans pass as YAML spells them, and what rlsys sets per process is refused."""
    from rlsys.rollout.sglang.server import build_env
    from rlsys.run.components import trainer_env
    from rlsys.run.engine_spec import server_spec
    from rlsys.system.backend import make_backend
    from rlsys.system.topology import Topology

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    path = write_config(tmp_path / "c.yaml", tiny_model_dir)
    config = load_config(path, ["placement.env={NCCL_DEBUG: INFO, NCCL_IB_DISABLE: 1, TORCH_NCCL_BLOCKING_WAIT: true, "
                                "GLOO_SOCKET_IFNAME: lo}"])
    wanted = {"NCCL_DEBUG": "INFO", "NCCL_IB_DISABLE": "1", "TORCH_NCCL_BLOCKING_WAIT": "true",
              "GLOO_SOCKET_IFNAME": "lo"}
    assert config.placement.env == wanted
    ranks = trainer_env(config)
    assert ranks["OMP_NUM_THREADS"] == "1" and all(ranks[k] == v for k, v in wanted.items())
    topology = Topology.from_config(config, has_gpu=False)
    server = build_env(server_spec(config, topology, 1), make_backend(False), host="127.0.0.1")
    assert all(server[k] == v for k, v in wanted.items())  # lo, not the interface of 127.0.0.1 rlsys would pick
    assert "NCCL_DEBUG" not in build_env(server_spec(load_config(path), topology, 1), make_backend(False))

    for override, message in (("placement.env={CUDA_VISIBLE_DEVICES: '0'}", "CUDA_VISIBLE_DEVICES is set by Ray"),
                              ("placement.env={OMP_NUM_THREADS: 4}", "OMP_NUM_THREADS is set by rlsys"),
                              ("placement.env={'NCCL-DEBUG': INFO}", "'NCCL-DEBUG' is not an environment variable")):
        with pytest.raises(ConfigError, match=message):
            load_config(path, [override])
