"""`rlsys eval`: a config's eval sets against a saved checkpoint or a Hugging Face model directory,
on real engines and no trainer. A checkpoint is first exported (rlsys/tools/export.py) to a
temporary directory the engines load; the metrics are those a training run logs at an eval step."""

from __future__ import annotations

import logging
import tempfile
from contextlib import ExitStack
from pathlib import Path

from rlsys.actors.placement import create_placement
from rlsys.config import ConfigError, RunConfig
from rlsys.errors import UsageError
from rlsys.model.architecture import read_architecture
from rlsys.rewards.pool import make_run_scorer
from rlsys.rollout.manager import RolloutManager
from rlsys.rollout.sglang.server import ServerSpec
from rlsys.run.assets import load_assets
from rlsys.run.evaluation import Evaluator
from rlsys.run.generation import SampleMaker
from rlsys.run.placement_checks import run_uses_gpus
from rlsys.system.cluster import ray_cluster
from rlsys.system.topology import Topology

logger = logging.getLogger(__name__)


def checkpoint_run_and_step(checkpoint: Path) -> tuple[Path, int]:
    """RUN_DIR/checkpoints/step_N -> (RUN_DIR, N); a UsageError naming what is wrong otherwise."""
    if not checkpoint.is_dir():
        raise UsageError(f"--checkpoint {checkpoint}: no such directory (a checkpoint is RUN_DIR/checkpoints/step_N)")
    name = checkpoint.resolve().name
    run_dir = checkpoint.resolve().parent.parent
    if not (name.startswith("step_") and name.removeprefix("step_").isdigit()
            and checkpoint.resolve().parent.name == "checkpoints"):
        raise UsageError(f"--checkpoint {checkpoint} is not a checkpoint directory (RUN_DIR/checkpoints/step_N); "
                         "for a Hugging Face model directory use --model")
    if not (run_dir / "config.yaml").is_file():
        raise UsageError(f"--checkpoint {checkpoint}: its run directory {run_dir} has no config.yaml")
    return run_dir, int(name.removeprefix("step_"))


def _model_dir(checkpoint: Path | None, model: Path | None, scratch: Path) -> Path:
    if model is not None:
        if not (model / "config.json").is_file():
            raise UsageError(f"--model {model} is not a Hugging Face model directory (no config.json); for a "
                             "checkpoint of a run use --checkpoint RUN_DIR/checkpoints/step_N")
        return model
    from rlsys.config import load_config
    from rlsys.tools.export import export_hf

    run_dir, step = checkpoint_run_and_step(checkpoint)
    merged = load_config(run_dir / "config.yaml").model.lora is not None  # the engines serve a whole model
    logger.info("exporting %s to a temporary model directory", checkpoint)
    return export_hf(run_dir, step, scratch / "model", merged=merged)


def evaluate_model(config: RunConfig, checkpoint: Path | None = None, model: Path | None = None,
                   shown: list[dict] | None = None) -> dict[str, float]:
    """Every eval set of `config` (the data section's eval prompts and eval.datasets) once, with
    rollout.num_engines engines serving the checkpoint or the model; the metrics by name. `shown`:
    a list that receives logging.samples_per_step answers of each set (`rlsys eval --show N`)."""
    if (checkpoint is None) == (model is None):
        raise UsageError("give exactly one of --checkpoint DIR or --model HF_DIR")
    # Standing engines load the exported weights from disk: next to the checkpoint (storage their nodes
    # see, as they see the run's), not in this machine's temporary directory.
    near = checkpoint_run_and_step(checkpoint)[0] if checkpoint is not None and config.rollout.attach else None
    with tempfile.TemporaryDirectory(prefix="rlsys-eval-", dir=near) as scratch:
        model_dir = _model_dir(checkpoint, model, Path(scratch))
        config = config.model_copy(update={"model": config.model.model_copy(
            update={"path": str(model_dir.resolve()), "lora": None, "hub_id": None, "revision": None})})
        assets = load_assets(config)  # the eval sets' files and reward functions, checked before any engine
        # What only transformers can tell of the model (load_assets reads config.json alone; a run's trainer
        # rank 0 checks the rest, and eval starts no trainer rank): before any engine too.
        read_architecture(model_dir)
        if not assets.eval and not assets.eval_sets:
            raise ConfigError("invalid config: nothing to evaluate: the config has no eval prompts (data.eval_path, "
                              "data.eval_fraction or a synthetic task's num_eval) and no eval.datasets")
        maker = SampleMaker(config, assets.tokenizer, assets.environment)
        if config.rollout.attach:
            return _evaluate_on_standing_engines(config, assets, maker, model_dir, checkpoint or model, shown)
        engines = Topology("disaggregated", 0, config.rollout.num_engines, config.rollout.engine.tp_size,
                           has_gpu=False, trainers_sleep=False,
                           engine_resources=dict(config.placement.engine_node_resources))
        with ExitStack() as stack:
            stack.enter_context(ray_cluster(config.placement.ray_address,
                                            config.placement.num_cpus or engines.local_cpus(),
                                            engines.custom_resources()))
            has_gpu = run_uses_gpus(config, engines)
            engines = Topology("disaggregated", 0, engines.num_engines, engines.engine_tp_size, has_gpu=has_gpu,
                               trainers_sleep=False, engine_resources=engines.engine_resources)
            placement = create_placement(engines)
            stack.callback(placement.remove)
            server = ServerSpec(config.model, config.rollout.engine, config.seed, has_gpu=has_gpu,
                                radix_cache=config.rollout.uses_radix_cache(has_gpu), env=dict(config.placement.env))
            rollout = RolloutManager.start(server, engines.num_engines, scratch, placement.engine_options())
            stack.callback(rollout.shutdown)
            rewards = make_run_scorer(config, assets.environment)
            stack.callback(rewards.close)
            rewards.start()
            rollout.fleet.wait_ready()
            logger.info("%d SGLang engine(s) serving %s", engines.num_engines, checkpoint or model)
            evaluator = Evaluator(config, assets, rollout, rewards.score, maker)
            stack.callback(evaluator.close)
            return _evaluated(evaluator, shown)


def _evaluated(evaluator: Evaluator, shown: list[dict] | None) -> dict[str, float]:
    metrics = evaluator.evaluate()
    if shown is not None:
        shown += evaluator.samples
    return metrics


def _evaluate_on_standing_engines(config: RunConfig, assets, maker: SampleMaker, model_dir: Path,
                                  source: Path, shown: list[dict] | None = None) -> dict[str, float]:
    """`evaluate_model` on standing engines (rollout.attach): leased for the eval, given the model's
    weights from disk (version 0), left ready for the next run."""
    import ray

    from rlsys.run.attach import attach
    from rlsys.system.cluster import cluster_address

    with ExitStack() as stack:
        stack.enter_context(ray_cluster(cluster_address(config), 1))
        probe = Topology("disaggregated", 0, config.rollout.num_engines, config.rollout.engine.tp_size,
                         has_gpu=False, trainers_sleep=False)
        engines = Topology("disaggregated", 0, probe.num_engines, probe.engine_tp_size,
                           has_gpu=run_uses_gpus(config, probe), trainers_sleep=False)
        attached = attach(config, engines, model_dir, "eval")
        stack.callback(attached.lease.release)
        record = attached.record
        rollout = RolloutManager.start(record.spec, record.topology.num_engines, record.log_dir, [], standing=record)
        stack.callback(rollout.shutdown)
        rollout.fleet.wait_ready()
        ray.get([engine.load_weights_from_disk.remote(str(model_dir.resolve()), 0) for engine in rollout.fleet.engines])
        rollout.fleet.restart_random_streams(config.seed)  # pass@k samples follow from the seed, not from earlier runs
        rewards = make_run_scorer(config, assets.environment)
        stack.callback(rewards.close)
        rewards.start()
        logger.info("%d standing engine(s) %r serving %s", len(rollout.fleet.engines), record.name, source)
        evaluator = Evaluator(config, assets, rollout, rewards.score, maker)
        stack.callback(evaluator.close)
        return _evaluated(evaluator, shown)
