"""A BM25 index over a passage corpus in Search-R1's format (JSONL, one ``{"id", "contents"}`` a line,
``contents`` = the title, a newline, the text): the retrieval behind the search tool's
``local_index`` and ``python -m rlhf_hpc.tools.retrieval_server``. In memory and pure Python, for
corpora up to a few hundred thousand passages; Search-R1's 21M-passage Wikipedia wants a dense or
Lucene retrieval service (the search tool's ``retrieval_service_url``)."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path

__all__ = ["Bm25Index", "read_corpus"]

TOKEN = re.compile(r"\w+")


def terms(text: str) -> list[str]:
    return TOKEN.findall(text.lower())


def read_corpus(path: str) -> list[dict]:
    """The corpus's passages; a ValueError names the line that is not one."""
    docs = []
    for n, line in enumerate(Path(path).expanduser().read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}, line {n}: not JSON ({e})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("contents"), str):
            raise ValueError(f'{path}, line {n}: expected {{"id": ..., "contents": "title\\ntext"}}')
        docs.append(doc)
    if not docs:
        raise ValueError(f"{path}: no passages")
    return docs


class Bm25Index:
    """Okapi BM25 (k1 0.9, b 0.4: pyserini's defaults, which Search-R1's BM25 retriever uses)."""

    def __init__(self, docs: list[dict], k1: float = 0.9, b: float = 0.4):
        self.docs, self.k1, self.b = docs, k1, b
        self.counts = [Counter(terms(d["contents"])) for d in docs]
        self.lengths = [sum(c.values()) for c in self.counts]
        self.mean_length = sum(self.lengths) / len(docs)
        df = Counter(t for c in self.counts for t in c)
        self.idf = {t: math.log(1 + (len(docs) - n + 0.5) / (n + 0.5)) for t, n in df.items()}
        self.postings: dict[str, list[int]] = {}
        for i, c in enumerate(self.counts):
            for t in c:
                self.postings.setdefault(t, []).append(i)

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        """The ``k`` best (passage index, score), best first (ties: the earlier passage)."""
        scores: dict[int, float] = {}
        for t in set(terms(query)):
            for i in self.postings.get(t, ()):
                tf = self.counts[i][t]
                norm = tf + self.k1 * (1 - self.b + self.b * self.lengths[i] / self.mean_length)
                scores[i] = scores.get(i, 0.0) + self.idf[t] * tf * (self.k1 + 1) / norm
        return sorted(scores.items(), key=lambda s: (-s[1], s[0]))[:k]

    def retrieve(self, queries: list[str], k: int) -> list[list[dict]]:
        """Search-R1's ``/retrieve`` result: per query, ``{"document": passage, "score": s}``, best first."""
        return [[{"document": self.docs[i], "score": s} for i, s in self.search(q, k)] for q in queries]
