"""reward.url against a real HTTP reward service started here (the standard library's server)."""

import socket
import time

import pytest

from rlsys.config import RewardConfig
from rlsys.errors import RunFailed
from rlsys.records import RewardCall
from rlsys.rewards.pool import RewardPool, make_reward_scorer
from rlsys.rewards.remote import RemoteReward, RewardServiceError
from tests.helpers import RewardService


@pytest.fixture
def service():
    served = RewardService()
    yield served
    served.close()


def _calls(labels, responses):
    pairs = enumerate(zip(labels, responses, strict=True))
    return [RewardCall(f"p{i}", response, label, {"i": i}) for i, (label, response) in pairs]


def _remote(url, **overrides):
    options = dict(batch_size=3, timeout_s=5.0, max_retries=2, retry_backoff_s=0.01, max_concurrency=2) | overrides
    return RemoteReward(url, **options)


def test_scores_come_back_in_order_in_batches(service):
    calls = _calls(["1", "2", "3", "4", "5", "6", "7"], ["1", "0", "3", "0", "5", "0", "7"])
    outcomes = _remote(service.url).score(calls)
    assert [o.value for o in outcomes] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert sorted(len(batch) for batch in service.requests) == [1, 3, 3]
    sent = [item for batch in service.requests for item in batch]
    assert sorted(item["metadata"]["i"] for item in sent) == list(range(7))
    assert {"prompt", "response", "label", "metadata"} == set(sent[0])


def test_items_the_service_cannot_score_are_counted_errors(service):
    outcomes = _remote(service.url).score(_calls(["1", "?", "!"], ["1", "1", "1"]))
    assert outcomes[0].value == 1.0
    assert "no score" in outcomes[1].error and "cannot grade" in outcomes[2].error


def test_a_failing_service_is_retried_with_backoff(service):
    service.fail_next = 2
    outcomes = _remote(service.url, batch_size=10).score(_calls(["1"], ["1"]))
    assert [o.value for o in outcomes] == [1.0] and len(service.requests) == 3


def test_a_service_that_keeps_failing_gives_counted_errors(service):
    service.fail_next = 100
    outcomes = _remote(service.url, max_retries=1).score(_calls(["1", "2"], ["1", "2"]))
    assert all("HTTP 503" in o.error and "2 attempts" in o.error for o in outcomes)


def test_a_hanging_service_times_out_into_counted_errors(service):
    service.hang_s = 2.0
    start = time.monotonic()
    outcomes = _remote(service.url, timeout_s=0.3, max_retries=1).score(_calls(["1"], ["1"]))
    assert "no answer within 0.3s" in outcomes[0].error
    assert time.monotonic() - start < 10


def test_an_unreachable_service_stops_the_run_with_a_clear_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(RewardServiceError, match=rf"127.0.0.1:{port}/score cannot be reached .* 2 attempts"):
        _remote(f"http://127.0.0.1:{port}/score", max_retries=1).score(_calls(["1"], ["1"]))


@pytest.mark.parametrize("mode, message", [("short", "with 2 scores, one per item"),
                                           ("bad_request", "refused the request: HTTP 422")])
def test_protocol_errors_stop_the_run(service, mode, message):
    service.mode = mode
    with pytest.raises(RewardServiceError, match=message):
        _remote(service.url).score(_calls(["1", "2"], ["1", "2"]))


def test_config_chooses_the_service_or_the_function():
    assert isinstance(make_reward_scorer(RewardConfig(url="http://127.0.0.1:9/score")), RemoteReward)
    assert isinstance(make_reward_scorer(RewardConfig()), RewardPool)
    with pytest.raises(ValueError, match="http:// or https://"):
        RewardConfig(url="127.0.0.1:9/score")
    assert issubclass(RewardServiceError, RunFailed)  # the CLI prints it without a traceback
