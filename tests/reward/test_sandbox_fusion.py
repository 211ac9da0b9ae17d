"""The code scorer on a Sandbox Fusion service (``reward.sandbox_fusion.url``), end to end over
HTTP against ``_sandbox_fusion_server`` (a real server on 127.0.0.1 running the code with
megarl's local runner): the same scores as the local runs on test_code_scorer's cases, verl's
request, retries and failure reports, the concurrency bound, the config keys."""

from __future__ import annotations

import json
import logging
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config, validate
from megarl.reward.loader import ScorerSpec
from megarl.reward.pool import ScoringPool
from megarl.reward.scorers import default_compute_score, sandbox_fusion
from megarl.reward.scorers.code_runner import run_program
from tests.reward._sandbox_fusion_server import SandboxFusionServer
from tests.reward.test_code_scorer import ADD, CASES, LOOPS, ONE, T2, fence

GRPO = Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny_cpu.yaml"
LOGGER = "megarl.reward.scorers.sandbox_fusion"


@pytest.fixture
def server():
    with SandboxFusionServer() as running:
        yield running


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/run_code"


def score(url: str, response: str, tests, **kwargs) -> float:
    truth = tests if isinstance(tests, str) else json.dumps(tests)
    return default_compute_score("taco", response, truth, sandbox_fusion_url=url, **kwargs)


def test_scores_on_the_service_equal_the_local_runs_and_verl(server):
    """test_code_scorer's CASES (verl 0.9.1's scores, which the local runs give) on the service."""

    def one(case):
        name, response, tests, _ = case
        timeout = 1.0 if name in LOOPS else 60.0
        return score(
            server.url, response, tests, test_timeout_s=timeout, all_tests_timeout_s=timeout
        )

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(one, CASES))
    assert {c[0]: s for c, s in zip(CASES, got, strict=True)} == pytest.approx(
        {c[0]: c[3] for c in CASES}
    )
    assert len(server.requests) >= len(CASES) - 3  # three never run a program (no code, bad JSON)


@pytest.mark.parametrize(
    ("program", "test_input", "fn_name"),
    [
        ("a, b = map(int, input().split())\nprint(a + b)", "1 2\n", None),  # stdin, passes
        ("print(1 / 0)", "", None),  # runtime error
        ("print(1", "", None),  # compile error
        ("while True:\n    pass", "", None),  # time limit
        ("def add(a, b):\n    return a + b", ["1\n2", "3\n4"], "add"),  # call-based
        ("import sys\nprint('é')\nsys.exit(3)", "", None),  # exit 3 is the program's own
    ],
)
def test_a_run_on_the_service_equals_the_local_run(server, program, test_input, fn_name):
    client = sandbox_fusion.client_for(server.url, 4)
    timeout = 1.0 if "while True" in program else 30.0
    limits = {"fn_name": fn_name, "timeout_s": timeout, "memory_limit_mb": 512}
    remote = sandbox_fusion.run_program_remote(client, program, test_input, **limits)
    assert remote == run_program(program, test_input, **limits)


def test_the_request_is_verls(server):
    assert score(server.url, fence(ADD), ONE, test_timeout_s=7.0, memory_limit_mb=300) == 0.0
    [request] = server.requests
    assert set(request) == {"code", "language", "stdin", "compile_timeout", "run_timeout",
                            "memory_limit_MB", "files", "fetch_files"}  # fmt: skip
    assert (request["language"], request["stdin"], request["files"], request["fetch_files"]) == (
        "python", "\n", {}, [],
    )  # fmt: skip
    assert (request["compile_timeout"], request["run_timeout"], request["memory_limit_MB"]) == (
        7.0, 7.0, 300,
    )  # fmt: skip


def test_a_gateway_timeout_is_retried_as_verl(server, monkeypatch, caplog):
    monkeypatch.setattr(sandbox_fusion, "INITIAL_RETRY_DELAY_S", 0.01)
    server.answers = [504, 504]  # the third attempt runs
    assert score(server.url, fence(ADD), T2) == 1.0
    assert len(server.requests) == 2 + 2
    server.answers = [504, 504, 504]
    with caplog.at_level(logging.ERROR, LOGGER):
        assert score(server.url, fence(ADD), ONE) == 0.0
    assert [r.getMessage() for r in caplog.records] == [
        (
            f"Sandbox Fusion at {server.url}: Gateway Timeout (504) on attempt 3/3; the run "
            "counts as failed (1 failed call(s) here)"
        )
    ]


def test_a_sandbox_error_fails_the_test_in_one_line(server, caplog):
    server.answers = [{"status": "SandboxError", "message": "runner\nunavailable"}]
    with caplog.at_level(logging.ERROR, LOGGER):
        assert score(server.url, fence(ADD), T2) == 0.5  # the first test fails, the second runs
    [record] = caplog.records
    assert record.getMessage().startswith(
        f"Sandbox Fusion at {server.url}: SandboxError: runner unavailable;"
    )
    assert record.exc_info is None


def test_an_unreachable_service_fails_the_sample_with_one_line_not_a_traceback(capfd):
    url = closed_port_url()
    spec = ScorerSpec(reward_kwargs={"sandbox_fusion_url": url})
    with ScoringPool(spec, num_workers=1, timeout_s=30.0) as pool:
        [outcome] = pool.score([(0, "codeforces", fence(ADD), json.dumps(T2), None)])
    assert (outcome.status, outcome.score) == ("ok", 0.0)  # as verl: the tests fail
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if url in line]
    assert len(lines) == 1 and "unreachable" in lines[0] and "Connection refused" in lines[0]
    assert "Traceback" not in err


def test_concurrency_is_bounded_by_max_concurrent_across_processes():
    with SandboxFusionServer(delay_s=0.3) as server:
        kwargs = {"sandbox_fusion_url": server.url, "sandbox_fusion_max_concurrent": 1}
        samples = [(i, "apps", fence(ADD), json.dumps(T2), None) for i in range(3)]
        with ScoringPool(ScorerSpec(reward_kwargs=kwargs), 3, timeout_s=60.0) as pool:
            assert [o.score for o in pool.score(samples)] == [1.0, 1.0, 1.0]
        assert (len(server.requests), server.most_in_flight) == (6, 1)
        # positive control: three at once when the bound allows it (threads of one process)
        with ThreadPoolExecutor(3) as threads:
            done = threads.map(lambda _: score(server.url, fence(ADD), ONE,
                                               sandbox_fusion_max_concurrent=3), range(3))  # fmt: skip
            assert list(done) == [0.0, 0.0, 0.0]
        assert server.most_in_flight == 3


def test_config_keys_reach_the_scorer_and_a_bad_url_is_refused_at_validation():
    url = "http://sandbox:8080/run_code"
    cfg = load_config([str(GRPO)], [f"reward.sandbox_fusion.url={url}",
                                    "reward.sandbox_fusion.max_concurrent=8"])  # fmt: skip
    validate(cfg, 2)
    spec = ScorerSpec.from_config(cfg.custom_reward_function, cfg)
    assert dict(spec.reward_kwargs) == {"sandbox_fusion_url": url, "memory_limit_mb": 1024,
                                        "sandbox_fusion_max_concurrent": 8}  # fmt: skip
    older = load_config([str(GRPO)], [f"sandbox_fusion.url={url}"])  # verl's older spelling
    assert older.reward.sandbox_fusion.url == url
    assert (
        ScorerSpec.from_config(load_config([str(GRPO)]).custom_reward_function).reward_kwargs == {}
    )
    with pytest.raises(ConfigError, match="one setting"):
        load_config(
            [], [f"sandbox_fusion.url={url}", "reward.sandbox_fusion.url=http://b/run_code"]
        )
    with pytest.raises(ConfigError) as err:
        validate(load_config([str(GRPO)], ["reward.sandbox_fusion.url=sandbox:8080/run_code"]), 2)
    assert "reward.sandbox_fusion.url: 'sandbox:8080/run_code' is not an http(s) URL" in str(
        err.value
    )
