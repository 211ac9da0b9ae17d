"""``PythonTool`` (verl's ``SandboxFusionTool``) with ``sandbox_fusion_url``: the code goes to the
service (a real HTTP server on 127.0.0.1, tests/reward/_sandbox_fusion_server.py) and the
answer is verl's: stdout + stderr of a finished run, else ``no stdout here``."""

from __future__ import annotations

import logging
import socket

import pytest

from megarl.tools.python_tool import PythonTool
from megarl.tools.registry import load_tool_config
from tests.reward._sandbox_fusion_server import SandboxFusionServer
from tests.tools.test_builtin_tools import execute

VERL_CONFIG = """\
tools:
  - class_name: "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
    config:
      num_workers: 2
      rate_limit: 2
      default_timeout: 30
      default_language: "python"
      memory_limit_mb: 512
      sandbox_fusion_url: "{url}"
      type: native
"""


@pytest.fixture
def server():
    with SandboxFusionServer() as running:
        yield running


def test_verls_tool_config_sends_the_code_to_the_service(server, tmp_path):
    path = tmp_path / "sandbox.yaml"
    path.write_text(VERL_CONFIG.format(url=server.url))
    (tool,) = load_tool_config(path)
    assert isinstance(tool, PythonTool) and tool.service is not None
    code = "import sys\nprint(sum(range(10)))\nprint('err', file=sys.stderr)"
    response, reward, _ = execute(tool, {"code": code})
    assert (response.text, reward) == ("45\nerr\n", None)  # stdout + stderr, as verl
    [request] = server.requests
    assert (request["code"], request["stdin"], request["language"]) == (code, None, "python")
    assert (request["run_timeout"], request["memory_limit_MB"]) == (30.0, 512)
    # an uncaught exception: the traceback is stderr (exit code 1, still Finished)
    assert execute(tool, {"code": "1/0"})[0].text.endswith("ZeroDivisionError: division by zero\n")


def test_a_run_that_does_not_finish_or_a_failed_service_answers_no_stdout(server, caplog):
    tool = PythonTool({"sandbox_fusion_url": server.url, "default_timeout": 1})
    assert execute(tool, {"code": "while True: pass", "timeout": 99})[0].text == "no stdout here"
    assert server.requests[-1]["run_timeout"] == 1.0  # capped at default_timeout, as locally
    with caplog.at_level(logging.ERROR, "megarl.reward.scorers.sandbox_fusion"):
        # the stand-in runs python only: another language is its SandboxError
        assert execute(tool, {"code": "echo 1", "language": "bash"})[0].text == "no stdout here"
    [record] = caplog.records
    assert record.getMessage().startswith(f"Sandbox Fusion at {server.url}: SandboxError:")
    assert execute(tool, {"code": "1", "language": "klingon"})[0].text.startswith("Unsupported")


def test_an_unreachable_service_is_one_line_and_a_bad_url_is_refused_at_build(caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/run_code"
    tool = PythonTool({"sandbox_fusion_url": url})
    with caplog.at_level(logging.ERROR, "megarl.reward.scorers.sandbox_fusion"):
        assert execute(tool, {"code": "print(1)"})[0].text == "no stdout here"
    [record] = caplog.records
    assert record.getMessage().startswith(f"Sandbox Fusion at {url}: unreachable (")
    with pytest.raises(ValueError, match="sandbox_fusion_url: 'localhost:8080' is not an http"):
        PythonTool({"sandbox_fusion_url": "localhost:8080"})
