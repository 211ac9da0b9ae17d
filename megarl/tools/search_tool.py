"""``LocalSearchTool``: retrieval over a local corpus file with BM25, for Search-R1-style data.

It takes the place of verl's ``SearchTool`` (``verl.tools.search_tool``, which posts the queries
to a retrieval server at ``retrieval_service_url``; verl 0.9.1 no longer ships it) and answers
in its format, written from its behaviour: ``execute({"query_list": [...]})`` returns the JSON
text ``{"result": ...}`` where each query's hits read ``Doc <i> (Title: <first line>)\\n<rest of
the document>``, joined by blank lines, queries joined by ``\\n---\\n``; a missing, empty or
non-list ``query_list`` answers ``{"result": "Error: 'query_list' is missing, empty, or not a
list in parameters."}``; no hit for any query answers ``{"result": "No search results found."}``.
Metrics: ``query_count``, ``status`` (success / no_results), ``total_results``,
``api_request_error`` (None). The step reward is 0.0.

Config: ``corpus_path`` (required: JSON lines with ``id`` and ``contents``, Search-R1's corpus
format, where ``contents`` is the title line and the text), ``topk`` (3, verl's default), BM25's
``k1`` (0.9) and ``b`` (0.4). verl's ``retrieval_service_url`` without ``corpus_path`` is refused
in one line; ``num_workers``, ``rate_limit``, ``timeout`` and ``enable_global_rate_limit`` are
accepted and unused. The index is built once when the tool is built, in memory (pure Python):
meant for corpora of up to a few hundred thousand passages, not Wikipedia (use a retrieval
server for that; not built).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megarl.tools.base_tool import BaseTool
from megarl.tools.bm25 import BM25Index
from megarl.tools.event_loop import to_tool_thread
from megarl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["DEFAULT_SCHEMA", "LocalSearchTool", "format_hits", "read_corpus"]

DEFAULT_SCHEMA = OpenAIFunctionToolSchema.model_validate(
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Searches the web for relevant information based on the given query.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query_list": {
                        "type": "array",
                        "description": "A list of fully-formed semantic queries. The tool will "
                        "return search results for each query.",
                    }
                },
                "required": ["query_list"],
            },
        },
    }
)
"""verl's example schema (``search_tool_config.yaml``), used when the config gives none."""

BAD_QUERY_LIST = "Error: 'query_list' is missing, empty, or not a list in parameters."


def read_corpus(path: str | Path) -> list[dict[str, Any]]:
    """The documents of a JSON-lines corpus (each needs ``contents``; ``id`` is kept if given).
    A bad line is a ValueError naming the file and line."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"corpus_path={str(path)!r}: no such file")
    documents = []
    with open(file, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{file}:{number}: not valid JSON ({exc.msg})") from exc
            if not isinstance(doc, dict) or not isinstance(doc.get("contents"), str):
                raise ValueError(  # noqa: TRY004 - a bad input file
                    f"{file}:{number}: expected an object with a 'contents' string"
                )
            documents.append(doc)
    if not documents:
        raise ValueError(f"corpus_path={str(path)!r}: no documents")
    return documents


def format_hits(documents: list[dict[str, Any]]) -> str:
    """verl's passage text: ``Doc i (Title: first line)\\nrest``, blank-line separated."""
    parts = []
    for i, doc in enumerate(documents, 1):
        title, _, text = doc["contents"].partition("\n")
        parts.append(f"Doc {i} (Title: {title})\n{text}\n\n")
    return "".join(parts).strip()


class LocalSearchTool(BaseTool):
    """BM25 search over the documents of ``config["corpus_path"]``."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config, tool_schema)
        if not config.get("corpus_path"):
            if config.get("retrieval_service_url"):
                raise ValueError(
                    "retrieval_service_url is not supported (no retrieval-server client): give "
                    "corpus_path, a local JSON-lines corpus with id and contents"
                )
            raise ValueError("config.corpus_path is required (JSON lines with id and contents)")
        self.topk = int(config.get("topk", 3))
        self.documents = read_corpus(config["corpus_path"])
        self.index = BM25Index(
            [doc["contents"] for doc in self.documents],
            k1=float(config.get("k1", 0.9)),
            b=float(config.get("b", 0.4)),
        )

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return getattr(self, "tool_schema", None) or DEFAULT_SCHEMA

    def search(self, query_list: list[str]) -> tuple[str, dict[str, Any]]:
        """The response text and metrics for ``query_list`` (blocking)."""
        hits = [
            [self.documents[i] for i, _ in self.index.search(str(q), self.topk)] for q in query_list
        ]
        total = sum(len(h) for h in hits)
        metrics: dict[str, Any] = {
            "query_count": len(query_list),
            "status": "success" if total else "no_results",
            "total_results": total,
            "api_request_error": None,
        }
        if not total:
            return json.dumps({"result": "No search results found."}), metrics
        result = "\n---\n".join(format_hits(h) for h in hits)
        return json.dumps({"result": result}, ensure_ascii=False), metrics

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        query_list = parameters.get("query_list")
        if not query_list or not isinstance(query_list, list):
            return ToolResponse(text=json.dumps({"result": BAD_QUERY_LIST})), 0.0, {}
        text, metrics = await to_tool_thread(self.search, query_list)
        return ToolResponse(text=text), 0.0, metrics
