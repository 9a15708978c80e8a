"""In-memory BM25 retrieval over a corpus of `Document`s (bm25s, no disk).

Built once per rollout and shared by every episode's env (the index is read-only after building).
A document is indexed as its title followed by its text, so a query naming an entity finds that
entity's own page first even when other pages mention the entity too. Tokenization is the bm25s
default (lowercase, words of 2+ word characters, English stopwords removed), without stemming:
PyStemmer is not a dependency, and made-up entity names must match exactly anyway.
"""

from __future__ import annotations

import logging
import re
from typing import Sequence

import bm25s
from bm25s.stopwords import STOPWORDS_EN

from agent_core.types import Document

# bm25s sets its own logger to DEBUG at import, which prints a line per index build.
logging.getLogger("bm25s").setLevel(logging.WARNING)

_WORD = re.compile(r"(?u)\b\w\w+\b")
_STOPWORDS = frozenset(STOPWORDS_EN)


def bm25_terms(text: str) -> list[str]:
    """The terms BM25 sees in `text`: lowercased words, stopwords dropped."""
    return [word for word in _WORD.findall(text.lower()) if word not in _STOPWORDS]


class Bm25Index:
    """BM25 (Lucene variant, k1=1.5, b=0.75: the bm25s defaults) over `documents`. An empty corpus
    (a dataset of your own without documents, whose envs do not search) is an index that finds nothing."""

    def __init__(self, documents: Sequence[Document]):
        self._documents = tuple(documents)
        corpus_terms = [bm25_terms(f"{doc.title} {doc.text}") for doc in self._documents]
        self._vocabulary = frozenset(term for terms in corpus_terms for term in terms)
        self._retriever = bm25s.BM25()
        if self._documents:
            self._retriever.index(corpus_terms, show_progress=False)

    @property
    def documents(self) -> tuple[Document, ...]:
        return self._documents

    def __len__(self) -> int:
        return len(self._documents)

    def search(self, query: str, top_k: int) -> list[Document]:
        """The (at most) `top_k` best-matching documents, best first.

        Only documents sharing a term with the query are returned, so an empty query, a
        stopword-only query or one with no known term gives [].
        """
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        # Unknown terms carry no score; filtering them also keeps bm25s from falling back to
        # its empty-token placeholder for a query with nothing it knows.
        terms = [term for term in bm25_terms(query) if term in self._vocabulary]
        if not terms:
            return []
        k = min(top_k, len(self._documents))
        doc_indices, scores = self._retriever.retrieve([terms], k=k, show_progress=False)
        return [
            self._documents[int(index)]
            for index, score in zip(doc_indices[0], scores[0])
            if score > 0
        ]
