"""``PythonTool``: a code interpreter that runs the model's Python in the code scorer's isolated
child processes (:func:`megarl.reward.scorers.code_runner.run_program`: a fresh interpreter in
a temporary directory and its own process group, address-space and CPU rlimits, a minimal
environment, killed as a whole after the run), inside the OS sandbox of
:mod:`megarl.reward.scorers.sandbox` (bubblewrap: no network, the system read-only, only its
scratch directory writable, no view of the run directory or other processes). A machine that
cannot run the sandbox refuses the tool when it is built, unless ``reward.code_sandbox=false``.

It takes the place of verl's ``SandboxFusionTool`` (``verl.tools.sandbox_fusion_tools``, which
sends code to a Sandbox Fusion service; verl 0.9.1 no longer ships it) and reads the same config
keys: ``default_timeout`` (s, 30), ``memory_limit_mb`` (1024), ``num_workers`` (programs running
at once in this process, 10), ``default_language`` (locally only ``python``).

With ``sandbox_fusion_url`` the code goes to that Sandbox Fusion service instead, as verl sends it
(:mod:`megarl.reward.scorers.sandbox_fusion`: the model's code as it is, in ``language``, any of
verl's languages; no local sandbox needed) and the answer is verl's: stdout + stderr when the run
finished, else ``no stdout here`` (a failed call is also logged in one line). ``rate_limit`` (10)
bounds the calls at once on this machine when ``enable_global_rate_limit`` (true; verl: across
the Ray cluster), ``num_workers`` those of this process. A URL that is not an http(s) URL with a
host is refused when the tool is built.

Locally, ``execute({"code": ..., "timeout"?: s, "language"?: ...})`` answers with the program's stdout
followed by the traceback of an uncaught exception (Sandbox Fusion: stdout + stderr); a program
past its limit answers ``Execution timed out after <t> s`` (Sandbox Fusion: ``no stdout here``).
The step reward is None (no reward recorded, as verl) and ``calc_reward`` 0.0. Differences: the
model's ``timeout`` is capped at ``default_timeout`` (verl lets the model raise it); the code
runs in a fresh namespace under the code scorer's harness, which sets destructive ``os`` and
``shutil`` functions to None and blocks importing ``subprocess``, ``ctypes``, ``resource`` and
``psutil`` (verl's reliability guard); the OS sandbox is the security boundary.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import Any

from megarl.reward.scorers import sandbox, sandbox_fusion
from megarl.reward.scorers.code_runner import run_program
from megarl.tools.base_tool import BaseTool
from megarl.tools.event_loop import to_tool_thread
from megarl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["DEFAULT_SCHEMA", "PythonTool"]

DEFAULT_SCHEMA = OpenAIFunctionToolSchema.model_validate(
    {
        "type": "function",
        "function": {
            "name": "code_interpreter",
            "description": "A tool for executing code.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "The code to execute."}},
                "required": ["code"],
            },
        },
    }
)
"""verl's example schema (``sandbox_fusion_tool_config.yaml``), used when the config gives none."""

# Runs the model's code as __main__ and prints an uncaught exception's traceback (without this
# wrapper's frame) to stdout, where the code runner collects output; stderr is discarded there.
_WRAPPER = """\
import sys as _megarl_sys, traceback as _megarl_tb
try:
    exec(compile({source!r}, "<code>", "exec"), {{"__name__": "__main__", "__builtins__": __builtins__}})
except SystemExit:
    pass
except BaseException as _megarl_exc:
    _megarl_sys.stdout.flush()
    _megarl_tb.print_exception(type(_megarl_exc), _megarl_exc, _megarl_exc.__traceback__.tb_next,
                               file=_megarl_sys.stdout)
"""


class PythonTool(BaseTool):
    """Runs Python code in a time- and memory-limited child process."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config, tool_schema)
        self.default_timeout = float(config.get("default_timeout", 30))
        self.memory_limit_mb = int(config.get("memory_limit_mb", 1024))
        self.default_language = config.get("default_language", "python")
        self.service = self._service(config)
        languages = sandbox_fusion.SUPPORTED_LANGUAGES if self.service else ("python",)
        if self.default_language not in languages:
            why = "not a Sandbox Fusion language" if self.service else "only 'python' runs locally"
            raise ValueError(f"default_language={self.default_language!r}: {why}")
        if self.default_timeout <= 0 or self.memory_limit_mb <= 0:
            raise ValueError("default_timeout and memory_limit_mb must be positive")
        if self.service is None:
            sandbox.require_sandbox()  # one line, at start-up rather than at the first call
        # a threading semaphore: the runs happen in worker threads, and it is not tied to one
        # event loop
        self._slots = threading.BoundedSemaphore(int(config.get("num_workers", 10)))

    @staticmethod
    def _service(config: dict) -> sandbox_fusion.SandboxFusionClient | None:
        """The Sandbox Fusion client of ``sandbox_fusion_url`` (None: the code runs locally)."""
        url = config.get("sandbox_fusion_url") or None
        if url is None:
            return None
        if (problem := sandbox_fusion.url_problem(url)) is not None:
            raise ValueError(f"sandbox_fusion_url: {problem}")
        return sandbox_fusion.client_for(url, int(config.get("rate_limit", 10)), "tool")

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return getattr(self, "tool_schema", None) or DEFAULT_SCHEMA

    def run_remote(self, code: str, timeout_s: float, language: str) -> str:
        """Run ``code`` on the Sandbox Fusion service (blocking): verl's answer."""
        # enable_global_rate_limit=false: num_workers (self._slots) is the only bound
        bound = None if self.config.get("enable_global_rate_limit", True) else nullcontext()
        with self._slots:
            reply = self.service.run(
                code, None, timeout_s, self.memory_limit_mb, language, semaphore=bound
            )
        ran = (reply or {}).get("run_result") or {}
        if ran.get("status") != "Finished":
            return "no stdout here"
        return (ran.get("stdout") or "") + (ran.get("stderr") or "")

    def run_code(self, code: str, timeout_s: float) -> str:
        """Run ``code`` locally (blocking) and return what the model is shown."""
        with self._slots:
            run = run_program(
                _WRAPPER.format(source=code), "", fn_name=None, timeout_s=timeout_s,
                memory_limit_mb=self.memory_limit_mb,
            )  # fmt: skip
        if run.status == "timeout":
            return f"Execution timed out after {timeout_s:g} s"
        if run.status != "ok":  # the wrapper catches the program's errors: the child itself died
            return f"Execution failed ({run.status.replace('_', ' ')}): out of memory or killed"
        return run.output

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, None, dict]:
        code = parameters.get("code", "")
        if not isinstance(code, str):
            code = str(code)
        language = parameters.get("language", self.default_language)
        languages = sandbox_fusion.SUPPORTED_LANGUAGES if self.service else ("python",)
        if language not in languages:
            return (
                ToolResponse(text=f"Unsupported language {language!r}"),
                None,
                {},
            )
        try:
            timeout_s = min(
                float(parameters.get("timeout", self.default_timeout)), self.default_timeout
            )
        except (TypeError, ValueError):
            timeout_s = self.default_timeout
        timeout_s = max(timeout_s, 0.1)
        if self.service is not None:
            text = await to_tool_thread(self.run_remote, code, timeout_s, language)
        else:
            text = await to_tool_thread(self.run_code, code, timeout_s)
        return ToolResponse(text=text), None, {}
