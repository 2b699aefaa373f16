"""Answering a search: snippet boxes on the page (evidence), highlighted page pictures and ``show``, and the
search and rag requests that put the halves, the reranker and the evidence together.
"""
