"""The command line as argparse reads it: dotted overrides after a command's flags."""

import pytest

from rlsys.cli import parse_command_line


def test_overrides_after_the_flags_are_overrides_too():
    """`rlsys train CONFIG --resume trainer.total_steps=100` (argparse alone: "unrecognized arguments")."""
    args = parse_command_line(["train", "c.yaml", "seed=1", "--resume", "trainer.total_steps=100", "eval.interval=5"])
    assert (args.config, args.resume) == ("c.yaml", True)
    assert args.overrides == ["seed=1", "trainer.total_steps=100", "eval.interval=5"]
    args = parse_command_line(["eval", "c.yaml", "--checkpoint", "runs/a/checkpoints/step_00000010",
                               "rollout.num_engines=2"])
    assert args.overrides == ["rollout.num_engines=2"] and args.checkpoint.endswith("step_00000010")


def test_an_unknown_flag_or_a_word_a_command_takes_no_overrides_for_is_still_refused(capsys):
    for argv in (["train", "c.yaml", "--resume", "--bogus"], ["runs", "runs", "extra"]):
        with pytest.raises(SystemExit) as exit_:
            parse_command_line(argv)
        assert exit_.value.code == 2
        assert f"unrecognized arguments: {argv[-1]}" in capsys.readouterr().err
