"""In-memory BM25 retrieval over a corpus of `Document`s (bm25s, no disk).

Shared by every episode's env (the index is read-only after building), and by every rollout over
the same documents: `shared_index` keeps the last few indexes by a content hash of their corpus,
so an iteration's rollout does not rebuild the index the previous one built.
A document is indexed as its title followed by its text, so a query naming an entity finds that
entity's own page first even when other pages mention the entity too. Tokenization is the bm25s
default (lowercase, words of 2+ word characters, English stopwords removed), without stemming:
PyStemmer is not a dependency, and made-up entity names must match exactly anyway.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections import OrderedDict
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


# A run rolls out over one corpus (the dev evaluation's is usually the same); two entries leave room
# for a second without keeping every corpus a long-lived process ever saw.
SHARED_INDEXES = 2
_shared: OrderedDict[bytes, Bm25Index] = OrderedDict()
_shared_lock = threading.Lock()


def corpus_key(documents: Sequence[Document]) -> bytes:
    """A content hash of `documents` (ids, titles, texts, in order): equal corpora, equal keys.

    Each field is length-prefixed, so no two different corpora hash the same byte stream.
    """
    digest = hashlib.blake2b(digest_size=16)
    for doc in documents:
        for part in (doc.doc_id, doc.title, doc.text):
            data = part.encode("utf-8", "surrogatepass")
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)
    return digest.digest()


def clear_shared_indexes() -> int:
    """Drop every shared index (a run's resources end with the run); how many there were."""
    with _shared_lock:
        count = len(_shared)
        _shared.clear()
        return count


def shared_index(documents: Sequence[Document]) -> Bm25Index:
    """The BM25 index of `documents`, built on the first call for this corpus and reused after.

    An index is read-only, so one object can serve every rollout over the same documents; it gives
    exactly the results a fresh `Bm25Index(documents)` gives (the documents are equal, the build
    deterministic). Hashing the demo's corpus (372 documents) takes ~0.3 ms, building its index ~30 ms.
    """
    key = corpus_key(documents)
    with _shared_lock:  # also keeps two threads from building the same index twice
        index = _shared.get(key)
        if index is None:
            index = _shared[key] = Bm25Index(documents)
            while len(_shared) > SHARED_INDEXES:
                _shared.popitem(last=False)
        _shared.move_to_end(key)
        return index
