"""The built-in tools: GSM8K answer check, Python interpreter, BM25 search, calculator."""

from __future__ import annotations

import json
import math

import pytest

from megarl.tools.bm25 import BM25Index, tokenize
from megarl.tools.calculator_tool import CalculatorTool, evaluate
from megarl.tools.gsm8k_tool import Gsm8kTool
from megarl.tools.python_tool import PythonTool
from megarl.tools.search_tool import LocalSearchTool
from tests.tools.conftest import run


def execute(tool, parameters, **create_kwargs):
    async def scenario():
        instance_id, _ = await tool.create(create_kwargs=create_kwargs)
        try:
            return await tool.execute(instance_id, parameters)
        finally:
            await tool.release(instance_id)

    return run(scenario())


# -- GSM8K: verl's Gsm8kTool semantics ------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "text", "step_reward"),
    [
        ("72", "Current parsed answer='72' reward=1.0", 0.0),
        ("#### 72", "Current parsed answer='#### 72' reward=1.0", 0.0),
        (72, "Current parsed answer='72' reward=1.0", 0.0),
        ("it is 70", "Current parsed answer='it is 70' reward=0.0", -0.05),
        ("no idea", "Current parsed answer='no idea' reward=0.0", -0.05),
    ],
)
def test_gsm8k_tool_scores_the_submitted_answer(answer, text, step_reward):
    response, reward, metrics = execute(Gsm8kTool({}), {"answer": answer}, ground_truth="72")
    assert (response.text, reward, metrics) == (text, step_reward, {})


def test_gsm8k_tool_takes_ground_truth_as_a_keyword_too():
    tool = Gsm8kTool({})

    async def scenario():
        instance_id, _ = await tool.create(ground_truth="5")
        await tool.execute(instance_id, {"answer": "5"})
        return await tool.calc_reward(instance_id)

    assert run(scenario()) == 1.0


# -- Python interpreter: the code scorer's isolated children --------------------------------------


def test_python_tool_returns_stdout_and_tracebacks():
    tool = PythonTool({"default_timeout": 5, "memory_limit_mb": 512})
    response, reward, _ = execute(tool, {"code": "print(sum(range(10)))\nprint('é')"})
    assert (response.text, reward) == ("45\né\n", None)
    text = execute(tool, {"code": "print('before')\n1/0"})[0].text
    assert text.startswith("before\nTraceback (most recent call last):\n")
    assert 'File "<code>", line 2' in text and text.endswith(
        "ZeroDivisionError: division by zero\n"
    )
    assert "<solution>" not in text  # the wrapper's own frame is not shown
    assert "SyntaxError" in execute(tool, {"code": "def f(:"})[0].text
    assert execute(tool, {"code": "print(1)", "language": "bash"})[0].text.startswith("Unsupported")


def test_python_tool_enforces_its_limits():
    tool = PythonTool({"default_timeout": 0.5, "memory_limit_mb": 256})
    # the model may lower the time limit, never raise it
    assert execute(tool, {"code": "while True: pass", "timeout": 99})[0].text == (
        "Execution timed out after 0.5 s"
    )
    # interpreter and sandbox start-up count towards the limit: 0.5 s may not see the allocation
    tool = PythonTool({"default_timeout": 30, "memory_limit_mb": 256})
    text = execute(tool, {"code": "x = bytearray(1024 ** 3)\nprint('allocated')"})[0].text
    assert "MemoryError" in text and "allocated" not in text


def test_python_tool_refuses_other_languages_in_config():
    with pytest.raises(ValueError, match="only 'python'"):
        PythonTool({"default_language": "cpp"})


# -- BM25 and the local search tool ---------------------------------------------------------------


def test_bm25_scores_by_hand():
    index = BM25Index(["The cat sat", "the dog", "cat cat dog"])  # k1 0.9, b 0.4
    avgdl = 8 / 3
    idf_cat = math.log(1 + (3 - 2 + 0.5) / (2 + 0.5))

    def term(tf, dl):
        return tf * 1.9 / (tf + 0.9 * (1 - 0.4 + 0.4 * dl / avgdl))

    scores = index.scores("CAT")
    assert scores[0] == pytest.approx(idf_cat * term(1, 3))
    assert scores[2] == pytest.approx(idf_cat * term(2, 3))
    assert scores[1] == -math.inf
    assert [doc for doc, _ in index.search("cat", 5)] == [2, 0]  # the non-matching doc is left out
    assert [doc for doc, _ in index.search("the dog", 1)] == [1]
    assert index.search("zebra", 3) == []
    assert tokenize("Qwen2.5's tool-call") == ["qwen2", "5", "s", "tool", "call"]


CORPUS = [
    {"id": "0", "contents": '"Paris"\nParis is the capital of France.'},
    {"id": "1", "contents": '"Berlin"\nBerlin is the capital of Germany.'},
    {"id": "2", "contents": '"France"\nFrance is a country in Europe.'},
]


@pytest.fixture
def search_tool(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in CORPUS))
    return LocalSearchTool({"corpus_path": str(corpus), "topk": 2})


def test_search_tool_answers_in_verls_format(search_tool):
    response, reward, metrics = execute(search_tool, {"query_list": ["Paris capital", "Germany"]})
    result = json.loads(response.text)["result"]
    assert result == (
        'Doc 1 (Title: "Paris")\nParis is the capital of France.\n\n'
        'Doc 2 (Title: "Berlin")\nBerlin is the capital of Germany.'
        "\n---\n"
        'Doc 1 (Title: "Berlin")\nBerlin is the capital of Germany.'
    )
    assert reward == 0.0
    assert metrics == {
        "query_count": 2,
        "status": "success",
        "total_results": 3,
        "api_request_error": None,
    }
    none = execute(search_tool, {"query_list": ["zebra"]})
    assert json.loads(none[0].text) == {"result": "No search results found."}
    assert none[2]["status"] == "no_results"
    bad = execute(search_tool, {"query_list": "capital"})[0].text
    assert json.loads(bad) == {
        "result": "Error: 'query_list' is missing, empty, or not a list in parameters."
    }


def test_a_bad_corpus_line_is_named(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "0", "contents": "ok"}\n{"id": "1"}\n')
    with pytest.raises(ValueError, match=r"c.jsonl:2: expected an object with a 'contents' string"):
        LocalSearchTool({"corpus_path": str(corpus)})


# -- calculator -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("123456789123456789 * 987654321987654321", str(123456789123456789 * 987654321987654321)),
        ("2 ** 200 - 1", str(2**200 - 1)),
        ("-(7 + 5) // 5", "-3"),
        ("17 % 5 + +1", "3"),
        ("10 / 4", "5/2"),
        ("10 / 5", "2"),
        ("2 ** -2", "1/4"),
        ("1 / 0", "Error: division by zero"),
        ("2 ^ 3", "Error: '^' is not a power here: write ** for powers"),
        ("__import__('os').system('true')", "Error: only integers, + - * / // % ** and parentheses are allowed"),
        ("1.5 * 2", "Error: only integers, + - * / // % ** and parentheses are allowed"),
        ("10 ** 5000", "Error: result has more than 1000 digits"),
        ("(10 ** 600) * (10 ** 600)", "Error: result has more than 1000 digits"),
        ("1 +", "Error: not an arithmetic expression (SyntaxError)"),
        ("", "Error: 'expression' must be a non-empty string"),
    ],
)  # fmt: skip
def test_calculator_is_exact_and_safe(expression, expected):
    response, reward, _ = execute(CalculatorTool({}), {"expression": expression})
    assert (response.text, reward) == (expected, 0.0)


def test_calculator_value_is_a_fraction():
    assert evaluate("(2**64 + 1) * 3") == 3 * (2**64 + 1)
