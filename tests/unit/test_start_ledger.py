"""make test's sessions each append their starts; the suite's budget is checked on their sum."""

from __future__ import annotations

from tests.start_ledger import SHARED_START_BUDGET, main, record_starts, suite_totals


def test_the_sessions_starts_are_summed_and_the_budget_is_the_suites(tmp_path, capsys):
    ledger = tmp_path / "starts.jsonl"
    record_starts(ledger, {"sglang": 16, "ray": 3}, shared=SHARED_START_BUDGET - 4)
    record_starts(ledger, {"sglang": 0, "ray": 0}, shared=0)
    record_starts(ledger, {"sglang": 20, "ray": 9}, shared=4)
    assert suite_totals(ledger) == {"sessions": 3, "sglang": 36, "ray": 12, "shared_sglang": SHARED_START_BUDGET}
    assert main([str(ledger)]) == 0
    said = capsys.readouterr().out
    assert f"{SHARED_START_BUDGET} SGLang start(s) outside the own_engines tests" in said and "over the budget" not in said

    record_starts(ledger, {"sglang": 1, "ray": 0}, shared=1)  # each session within it, the suite one over
    main([str(ledger)])
    over = f"{SHARED_START_BUDGET + 1} shared SGLang starts, over the budget of {SHARED_START_BUDGET}"
    assert over in capsys.readouterr().out
