"""The two halves of a search and their fusion: filters, FTS5 keyword candidates and the topic-word order inside
long documents, the vector index, section priors, snippets and hits.
"""
