"""The commands that run something: train, plan, doctor, eval, engines, export, make-tiny-model;
each one's handler beside its parser."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from rlsys.cli.common import DEFAULT_ENGINES_NAME, add_verbosity, library_output_hidden, standing_name
from rlsys.errors import UsageError

logger = logging.getLogger("rlsys.cli")  # not __name__: one logger for every command's lines


def train_overrides(args: argparse.Namespace) -> list[str]:
    """The config overrides `rlsys train` applies: the command line's, then --resume's, then
    --quiet's (no progress bar: it is terminal output like the info lines it hides)."""
    return (list(args.overrides) + (["checkpoint.resume=auto"] if args.resume else [])
            + (["logging.progress_bar=false"] if args.log_level >= logging.WARNING else []))


def _train(args: argparse.Namespace) -> int:
    from rlsys.config import load_config
    from rlsys.errors import RunFailed
    from rlsys.run.lifecycle import StoppedAtOnce, run

    config = load_config(args.config, train_overrides(args))
    try:
        run(config)
    except RunFailed as error:
        logger.error("run failed: %s", error)
        return 1
    except StoppedAtOnce as stop:
        logger.error("%s", stop)
        return stop.code
    return 0


def add_train_command(commands) -> None:
    train = commands.add_parser("train", help="run a GRPO job from a YAML config")
    train.add_argument("config", help="YAML config, e.g. configs/quickstart.yaml")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-5")
    train.add_argument("--resume", action="store_true",
                       help="continue from the latest checkpoint in run_dir (same as checkpoint.resume=auto)")
    train.set_defaults(handler=_train)


def _plan(args: argparse.Namespace) -> int:
    from rlsys.config import load_config
    from rlsys.plan.memory_plan import memory_plan, print_plan

    if args.gpus_per_node < 1:
        raise UsageError(f"--gpus-per-node must be >= 1 (got {args.gpus_per_node})")
    config = load_config(args.config, list(args.overrides))
    images = None
    if config.data.has_images:  # the vision tower's terms follow the training prompts' images: read them
        from rlsys.run.assets import load_assets

        images = load_assets(config).image_load
    plan = memory_plan(config, args.gpus_per_node, images)
    print_plan(plan, args.json)
    return 0 if plan.fits else 1


def add_plan_command(commands) -> None:
    plan = commands.add_parser("plan", help="print the memory each GPU will hold, per phase, and whether it fits; "
                               "and the host memory per trainer rank and per node")
    plan.add_argument("config", help="YAML config, e.g. configs/gpu_colocated.yaml")
    plan.add_argument("overrides", nargs="*", help="dotted overrides, e.g. placement.gpu_memory_gb=80")
    plan.add_argument("--json", action="store_true", help="one JSON object (fits, per_gpu_bytes, terms, host_terms, "
                      "host_per_node_bytes, ...)")
    plan.add_argument("--gpus-per-node", type=int, default=8, metavar="N",
                      help="GPUs of a node, for the host memory per node (default 8)")
    plan.set_defaults(handler=_plan)


def _doctor(args: argparse.Namespace) -> int:
    """`rlsys doctor [CONFIG]` (rlsys/doctor/examine.py): 1 when a check found a blocker."""
    import json

    from rlsys.config import load_config
    from rlsys.doctor.examine import examine, print_report
    from rlsys.errors import RunFailed

    config = load_config(args.config, list(args.overrides)) if args.config else None
    if config is None and args.overrides:
        raise UsageError("overrides need a config: rlsys doctor CONFIG key=value ...")
    try:
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            report = examine(config, args.address)
    except RunFailed as error:
        logger.error("doctor failed: %s", error)
        return 1
    if args.json:
        print(json.dumps(report.as_json(), default=str))
    else:
        print_report(report)
    return 1 if report.blockers else 0


def add_doctor_command(commands) -> None:
    doctor = commands.add_parser("doctor", help="check the nodes a config's run would use before a job: resources, "
                                 "/dev/shm, GPUs, versions, run_dir and model, ports, clocks, a collective test")
    doctor.add_argument("config", nargs="?", help="YAML config (without one: every node of the cluster, without the "
                        "run's own checks)")
    doctor.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.num_ranks=4")
    doctor.add_argument("--address", metavar="RAY_ADDRESS", help="the Ray cluster to check (default: "
                        "placement.ray_address, RAY_ADDRESS, else a local cluster on this machine)")
    doctor.add_argument("--json", action="store_true", help="one JSON object (ok, nodes, collectives, problems, env)")
    doctor.set_defaults(handler=_doctor)


def _eval(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from rlsys.config import load_config
    from rlsys.errors import RunFailed
    from rlsys.eval.evaluate import evaluate_model

    if not 0 <= args.show <= 64:
        raise UsageError(f"--show takes 0 to 64 answers per eval set, got {args.show}")
    config = load_config(args.config, [*args.overrides, f"logging.samples_per_step={args.show}"])
    shown: list[dict] = []
    try:
        # --json: stdout holds the one JSON object; the progress lines go to stderr meanwhile.
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext(), \
                library_output_hidden(args.log_level):
            metrics = evaluate_model(config, checkpoint=Path(args.checkpoint) if args.checkpoint else None,
                                     model=Path(args.model) if args.model else None, shown=shown)
    except RunFailed as error:
        logger.error("eval failed: %s", error)
        return 1
    source = {"checkpoint": args.checkpoint} if args.checkpoint else {"model": args.model}
    if args.json:
        print(json.dumps({**source, "metrics": metrics, **({"samples": shown} if args.show else {})}))
        return 0
    from rich.console import Console

    table = eval_table(metrics, [s.name for s in config.eval.datasets], f"rlsys eval of {args.checkpoint or args.model}")
    # As wide as the table needs, not the 80 columns of a pipe or a small terminal (rich cuts headers)
    console = Console(width=max(Console().width, 24 + 14 * len(table.columns)))
    console.print(table)
    for sample in shown:
        reward = "error" if sample["reward"] is None else f"{sample['reward']:.4g}"
        console.print(f"[{sample['source']}] {sample['prompt']!r} -> {sample['response']!r} (reward {reward}, "
                      f"{sample['finish_reason']}, {sample['response_tokens']} tokens)", highlight=False, markup=False)
    return 0


def eval_table(metrics: dict, set_names: list[str], title: str):
    """`rlsys eval`'s table: one row per eval set (the data section's eval prompts first), one
    column per metric; what "at max_new_tokens" counts said under it (not an error by itself)."""
    from rich.table import Table

    from rlsys.run.evaluation import metrics_by_set

    per_set = metrics_by_set(metrics, set_names)
    columns = list(dict.fromkeys(column for values in per_set.values() for column in values))
    # pass@k by k (the sets' metrics arrive in the order their sampling finished), where pass@ first stood
    by_k = iter(sorted((c for c in columns if c.startswith("pass_at_")), key=lambda c: int(c.rsplit("_", 1)[1])))
    columns = [next(by_k) if column.startswith("pass_at_") else column for column in columns]
    table = Table(title=title, caption="at max_new_tokens: the share of answers that reached the length limit "
                  "without EOS or a stop string (expected when answers are meant to be that long)")
    table.add_column("eval set")
    short = {"reward_mean": "reward", "reward_errors": "errors", "response_len_mean": "length",
             "truncated_fraction": "at max_new_tokens"}
    for column in columns:
        table.add_column(short.get(column, column.replace("pass_at_", "pass@")), justify="right")
    for name, values in per_set.items():
        if values:
            cells = (f"{values[c]:.4g}" if isinstance(values.get(c), float) else str(values.get(c, "-")) for c in columns)
            table.add_row(name or "(data)", *cells)
    return table


def add_eval_command(commands) -> None:
    evaluate = commands.add_parser("eval", help="run a config's eval sets against a checkpoint or a model, "
                                   "on real engines (no trainer)")
    evaluate.add_argument("config", help="YAML config whose eval sets (data's eval prompts, eval.datasets) to run")
    evaluate.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.num_engines=2")
    source = evaluate.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR", help="a run's checkpoint: RUN_DIR/checkpoints/step_N")
    source.add_argument("--model", metavar="HF_DIR", help="a Hugging Face model directory (e.g. from rlsys export)")
    evaluate.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    evaluate.add_argument("--show", type=int, default=0, metavar="N",
                          help="also print N answers of each eval set: prompt, response, reward, finish reason")
    evaluate.set_defaults(handler=_eval)


def _engines(args: argparse.Namespace) -> int:
    """`rlsys engines up|status|down` (rlsys/engines/standing_set.py)."""
    import json
    from pathlib import Path

    from rlsys.engines import standing_set
    from rlsys.rollout.standing import StandingEnginesError

    try:
        if args.action == "up":
            from rlsys.config import load_config

            config = load_config(args.config, list(args.overrides))
            log_dir = Path(args.log_dir) if args.log_dir else Path("runs") / "engines" / args.name
            record = standing_set.engines_up(config, args.name, log_dir, args.address,
                                                 warm_trainers=args.warm_trainers)
            logger.info("standing engines %r serve %s; attach a run with rollout.attach=%s (`rlsys engines down "
                        "--name %s` stops them)", record.name, record.model_path, record.name, record.name)
        elif args.action == "status":
            reports = standing_set.engines_status(args.address)
            if args.json:
                print(json.dumps(reports, indent=2, default=str))
            else:
                print(standing_set.status_table(reports))
        else:
            standing_set.engines_down(None if args.all else args.name, args.force, args.address)
    except StandingEnginesError as error:
        logger.error("error: %s", error)
        return 1
    return 0


def add_engines_command(commands) -> None:
    engines = commands.add_parser("engines", help="standing SGLang engines that outlive a run: up, status, down "
                                  "(a run uses them with rollout.attach=NAME)")
    actions = engines.add_subparsers(dest="action", required=True)
    up = actions.add_parser("up", help="start a config's engines (placed as its run would place them) and leave "
                            "them running")
    up.add_argument("config", help="the YAML config of the runs that will attach")
    up.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.num_engines=2")
    up.add_argument("--no-warm-trainers", dest="warm_trainers", action="store_false",
                    help="keep no trainer ranks between the runs that attach (by default the set keeps the last "
                    "run's, released, and the next run's model is built in them: no rank start-up)")
    down = actions.add_parser("down", help="stop standing engines (their servers, /dev/shm files, placement)")
    down.add_argument("--all", action="store_true", help="every standing set of the cluster")
    down.add_argument("--force", action="store_true", help="even while a run holds their lease")
    engines_status = actions.add_parser("status", help="the standing sets: engines, health, lease")
    engines_status.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    for action in (up, down, engines_status):
        action.add_argument("--address", default=None, help="Ray cluster (default: placement.ray_address, "
                            "RAY_ADDRESS, or the cluster `rlsys engines up` started on this machine)")
    for action in (up, down):
        action.add_argument("--name", default=DEFAULT_ENGINES_NAME, type=standing_name,
                            help="the set's name (default: %(default)s)")
    up.add_argument("--log-dir", default=None, help="the engines' logs (default: runs/engines/NAME; on a cluster, "
                    "storage every node sees)")
    engines.set_defaults(handler=_engines)
    for action in actions.choices.values():
        add_verbosity(action, argparse.SUPPRESS)


def _export(args: argparse.Namespace) -> int:
    from rlsys.tools.export import export_hf

    with library_output_hidden(args.log_level):
        out = export_hf(args.run_dir, args.step, args.out_dir, merged=args.merged, overwrite=args.overwrite)
    logger.info("Hugging Face checkpoint written to %s", out)
    return 0


def add_export_command(commands) -> None:
    export = commands.add_parser("export", help="write a run's checkpoint as a Hugging Face model")
    export.add_argument("run_dir")
    export.add_argument("out_dir")
    export.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    export.add_argument("--merged", action="store_true",
                        help="a LoRA run: the base model with the adapters merged in (default: the PEFT adapter)")
    export.add_argument("--overwrite", action="store_true",
                        help="replace what OUT_DIR holds (default: a directory with files in it is refused)")
    export.set_defaults(handler=_export)


def _make_tiny_model(args: argparse.Namespace) -> int:
    from rlsys.tools.tiny_model import TinyModelSpec, make_tiny_model

    spec = TinyModelSpec(hidden_size=args.hidden_size, num_layers=args.num_layers, seed=args.seed, arch=args.arch,
                         init_std=args.init_std)
    with library_output_hidden(args.log_level):  # transformers' "Writing model shards" bar
        out = make_tiny_model(args.out_dir, spec, chat=args.chat)
    logger.info("tiny model written to %s", out)
    return 0


def _make_tiny_judge(args: argparse.Namespace) -> int:
    from rlsys.tools.tiny_judge import make_tiny_judge

    with library_output_hidden(args.log_level):
        quality = make_tiny_judge(args.out_dir, args.seed)
    logger.info("tiny judge written to %s: right on %.0f%% of its examples; p(y) >= %.3f on a right answer, <= %.3f on "
                "a wrong one", args.out_dir, 100 * quality["accuracy"], quality["lowest_right"], quality["highest_wrong"])
    return 0


def add_make_tiny_model_command(commands) -> None:
    tiny = commands.add_parser(
        "make-tiny-model", help="build a local random-init model + tokenizer",
        description="Write a random-init causal LM (fp32, safetensors, config.json, generation_config.json) and "
                    "a character-level tokenizer (one token per character; tokenizer.json and tokenizer_config.json, "
                    "also alone in OUT_DIR/tokenizer/) to OUT_DIR, for runs without a model hub. Configs on it set "
                    "rollout.engine.skip_tokenizer_init: true, as configs/quickstart.yaml does (the engine takes and "
                    "returns token ids; rlsys tokenizes). Defaults: 133,696 parameters (qwen2, 2 layers, 64 wide).")
    tiny.add_argument("out_dir", help="the directory to write (created if missing; its files of these names are "
                                      "replaced)")
    tiny.add_argument("--hidden-size", type=int, default=64)
    tiny.add_argument("--num-layers", type=int, default=2)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--init-std", type=float, default=0.02,
                      help="std of the random weights (0.1: a base a LoRA run can learn on, docs/operations.md)")
    tiny.add_argument("--arch", default="qwen2", help="qwen2 (default), qwen3, llama, qwen3_moe, qwen2_5_vl or "
                      "qwen3_vl (a vision-language model: a 2-block vision tower, and the model's processor saved "
                      "beside it with the vision markers in the tokenizer and a chat template that renders images)")
    tiny.add_argument("--chat", action="store_true", help="a tokenizer with a Qwen-style chat template")
    tiny.set_defaults(handler=_make_tiny_model)
    judge = commands.add_parser(
        "make-tiny-judge", help="build a tiny judge model for the quickstart task (reward.judge)",
        description="The tiny model fine-tuned on the CPU (about 20 s) to answer y after '{response}={label}?' "
                    "when the response is the label's digit, n otherwise: the judge of "
                    "configs/examples/judge_quickstart.yaml.")
    judge.add_argument("out_dir", help="the directory to write")
    judge.add_argument("--seed", type=int, default=0)
    judge.set_defaults(handler=_make_tiny_judge)
