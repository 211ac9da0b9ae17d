"""Okapi BM25 over a small in-memory corpus, in plain Python and numpy (no new dependency).

Scoring is Okapi BM25 with Lucene's idf,
``idf(t) = ln(1 + (N - df + 0.5) / (df + 0.5))``,
``score(q, d) = Σ_t∈q idf(t) · tf·(k1 + 1) / (tf + k1·(1 - b + b·|d|/avgdl))``, and Pyserini's
defaults ``k1 = 0.9``, ``b = 0.4`` (Search-R1's BM25 retriever is Pyserini). The ranking is
Lucene's except where Lucene's lossy one-byte document lengths reorder near ties (Lucene also
drops the constant factor ``k1 + 1``). A term repeated in the query counts once per occurrence.
Text is lower-cased and split into ``\\w+`` runs (no stemming or stop words, unlike Pyserini's
English analyzer). Documents matching no query term are never returned; ties keep corpus order.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Sequence

import numpy as np

__all__ = ["BM25Index", "tokenize"]

_WORD = re.compile(r"\w+")


def tokenize(text: str) -> list[str]:
    """Lower-cased ``\\w+`` runs of ``text``."""
    return _WORD.findall(text.lower())


class BM25Index:
    """An inverted index of ``documents`` (texts), searched with :meth:`search`."""

    def __init__(self, documents: Sequence[str], k1: float = 0.9, b: float = 0.4):
        if k1 < 0 or not 0 <= b <= 1:
            raise ValueError(f"BM25 needs k1 >= 0 and 0 <= b <= 1, got k1={k1}, b={b}")
        self.k1, self.b = k1, b
        postings: dict[str, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
        lengths = np.zeros(len(documents), dtype=np.float64)
        for doc, text in enumerate(documents):
            counts = Counter(tokenize(text))
            lengths[doc] = sum(counts.values())
            for term, tf in counts.items():
                docs, tfs = postings[term]
                docs.append(doc)
                tfs.append(tf)
        self.num_docs = len(documents)
        avgdl = float(lengths.mean()) if self.num_docs and lengths.mean() > 0 else 1.0
        norm = k1 * (1 - b + b * lengths / avgdl)
        self._postings: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for term, (docs, tfs) in postings.items():
            doc_ids = np.asarray(docs, dtype=np.int64)
            tf = np.asarray(tfs, dtype=np.float64)
            idf = math.log(1 + (self.num_docs - len(docs) + 0.5) / (len(docs) + 0.5))
            self._postings[term] = (doc_ids, idf * tf * (k1 + 1) / (tf + norm[doc_ids]))

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every document for ``query`` (``[num_docs]``)."""
        total = np.zeros(self.num_docs, dtype=np.float64)
        matched = np.zeros(self.num_docs, dtype=bool)
        for term in tokenize(query):
            if term in self._postings:
                doc_ids, weights = self._postings[term]
                total[doc_ids] += weights
                matched[doc_ids] = True
        total[~matched] = -np.inf
        return total

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        """The ``k`` best (document index, score) pairs, best first; only matching documents."""
        scores = self.scores(query)
        order = np.argsort(-scores, kind="stable")[:k]
        return [(int(i), float(scores[i])) for i in order if np.isfinite(scores[i])]
