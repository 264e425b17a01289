"""The search tool (verl's ``verl.tools.search_tool.SearchTool``, Search-R1's ``search``): the model
gives a ``query_list`` and reads back the top passages of each query, formatted as verl formats them
(``{"result": "Doc 1 (Title: ...)\\n...\\n---\\n..."}``). ``config``: ``retrieval_service_url`` (verl's:
a retrieval service with Search-R1's API, e.g. ``python -m rlhf_hpc.tools.retrieval_server`` or
Search-R1's own) or ``local_index`` (not verl's: a JSONL passage corpus, searched by BM25 in each
rank), one of them; ``topk`` (3) and ``timeout`` (s, 30) as verl's."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rlhf_hpc.tools.bm25 import Bm25Index, read_corpus
from rlhf_hpc.tools.tool import Tool, ToolOutput

__all__ = ["SearchTool", "format_passages"]


def format_passages(results: list[list[dict]]) -> str:
    """verl's result text: per query, each passage as "Doc i (Title: <its first line>)" and its text."""
    per_query = []
    for retrieval in results:
        docs = []
        for i, item in enumerate(retrieval):
            title, _, text = item["document"]["contents"].partition("\n")
            docs.append(f"Doc {i + 1} (Title: {title})\n{text}\n\n")
        per_query.append("".join(docs).strip())
    return json.dumps({"result": "\n---\n".join(per_query)}, ensure_ascii=False)


class SearchTool(Tool):
    @classmethod
    def config_problems(cls, config: dict) -> list[str]:
        url, index = config.get("retrieval_service_url"), config.get("local_index")
        if bool(url) == bool(index):
            return [
                "the search tool needs one of config.retrieval_service_url (a retrieval service with Search-R1's "
                "API: python -m rlhf_hpc.tools.retrieval_server --corpus FILE serves one) and config.local_index "
                "(a JSONL passage corpus searched in each rank)"
            ]
        if index and not Path(index).expanduser().is_file():
            return [f'config.local_index={index}: no such file (a JSONL passage corpus: {{"id", "contents"}} a line)']
        return []

    def __init__(self, config: dict, schema: dict):
        super().__init__(config, schema)
        problems = self.config_problems(self.config)
        if problems:
            raise ValueError(f"tool {self.name}: {problems[0]}")
        self.url = self.config.get("retrieval_service_url")
        self.topk, self.timeout = int(self.config.get("topk", 3)), float(self.config.get("timeout", 30))
        index = self.config.get("local_index")
        self.index = Bm25Index(read_corpus(index)) if index else None

    def execute(self, arguments: dict[str, Any], create_kwargs: dict[str, Any]) -> ToolOutput:
        queries = arguments.get("query_list")
        if not queries or not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
            return ToolOutput(
                json.dumps({"result": "Error: 'query_list' is missing, empty, or not a list in parameters."}),
                status="error",
            )
        if self.index is not None:
            return ToolOutput(format_passages(self.index.retrieve(queries, self.topk)))
        try:
            return ToolOutput(format_passages(self._post(queries)))
        except (OSError, ValueError, KeyError, TypeError) as e:  # (urllib's errors are OSErrors)
            return ToolOutput(json.dumps({"result": f"Search error: {type(e).__name__}: {e}"}), status="error")

    def _post(self, queries: list[str]) -> list[list[dict]]:
        """The service's results; a refused connection is retried (a service still starting) within the timeout."""
        body = json.dumps({"queries": queries, "topk": self.topk, "return_scores": True}).encode()
        deadline = time.monotonic() + self.timeout
        while True:
            request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=max(deadline - time.monotonic(), 0.1)) as reply:
                    return json.loads(reply.read())["result"]
            except urllib.error.URLError as e:
                if isinstance(e, urllib.error.HTTPError) or time.monotonic() + 1 > deadline:
                    raise
                time.sleep(1)
