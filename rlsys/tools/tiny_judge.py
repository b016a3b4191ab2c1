"""A tiny judge model for the quickstart task (`rlsys make-tiny-judge`): the tiny model, fine-tuned (about
20 s on the CPU) to answer `y` after "{response}={label}?" when the response is the label's digit and
`n` otherwise (any other character, or nothing). Served with reward.judge (parse: logprob_yes, yes: y,
no: n; configs/examples/judge_quickstart.yaml), it grades the quickstart's answers with a probability.
Nothing is downloaded; the fine-tuning is seeded, so the same judge comes out every time."""

from __future__ import annotations

from pathlib import Path

from rlsys.tools.tiny_parts import CHARACTERS

JUDGE_PROMPT = "{response}={label}?"
STEPS = 1500
OTHERS_PER_STEP = 32


def judge_examples() -> list[tuple[str, bool]]:
    """Every (judge input, right?) of the quickstart task: each label digit against each one-character
    answer the tiny model can write, and against an empty answer."""
    return [(JUDGE_PROMPT.format(response=response, label=label), response == label)
            for label in "0123456789" for response in ["", *CHARACTERS]]


def make_tiny_judge(out_dir: str | Path, seed: int = 0) -> dict:
    """Writes the judge to `out_dir`; returns its accuracy and its lowest p(y) on a right answer and
    highest on a wrong one (over every example it was tuned on: all there are)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlsys.data.tokenizer import load_tokenizer
    from rlsys.tools.tiny_model import TinyModelSpec, make_tiny_model

    out = make_tiny_model(out_dir, TinyModelSpec(seed=seed))
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    examples = judge_examples()
    encoded = [tokenizer(text, add_special_tokens=True)["input_ids"] for text, _ in examples]
    length = max(len(ids) for ids in encoded)
    pad = tokenizer.pad_token_id
    inputs = torch.tensor([[pad] * (length - len(ids)) + ids for ids in encoded])  # left-padded: the last position
    attention = torch.tensor([[0] * (length - len(ids)) + [1] * len(ids) for ids in encoded])
    yes, no = (tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in ("y", "n"))
    right = torch.tensor([r for _, r in examples])
    digit = torch.tensor([text[0].isdigit() for text, _ in examples])
    targets = torch.where(right, yes, no)
    # A third of the weight each on the 10 right answers, the 90 wrong digits (the hard ones: which digit),
    # and the 610 other wrong answers.
    kinds = (right, digit & ~right, ~digit)
    weights = sum(kind.float() / kind.sum() for kind in kinds)
    positions = torch.arange(length).expand(len(encoded), -1) - (length - attention.sum(1, keepdim=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # Each step: every answer that is a digit or nothing (the hard ones: which digit), and OTHERS_PER_STEP of
    # the other answers, drawn afresh (a fifth of the cost of all 710 each step).
    always = torch.nonzero(digit | torch.tensor([text[0] == "=" for text, _ in examples])).flatten()
    others = torch.nonzero(~(digit | torch.tensor([text[0] == "=" for text, _ in examples]))).flatten()
    draw = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        rows = torch.cat([always, others[torch.randperm(len(others), generator=draw)[:OTHERS_PER_STEP]]])
        logits = model(inputs[rows], attention_mask=attention[rows], position_ids=positions[rows].clamp(min=0)).logits[:, -1]
        loss = (torch.nn.functional.cross_entropy(logits, targets[rows], reduction="none") * weights[rows]).sum() \
            / weights[rows].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(out)
    with torch.no_grad():
        logprobs = model(inputs, attention_mask=attention, position_ids=positions.clamp(min=0)).logits[:, -1].log_softmax(-1)
    p_yes = logprobs[:, yes].exp() / (logprobs[:, yes].exp() + logprobs[:, no].exp())
    return {"accuracy": ((p_yes > 0.5) == right).float().mean().item(), "lowest_right": p_yes[right].min().item(),
            "highest_wrong": p_yes[~right].max().item()}
