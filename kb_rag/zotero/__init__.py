"""Zotero: a consistent snapshot of its database and what it holds (snapshot), and the zotero command that brings
its attachments in through the ingest pipeline (importer).
"""
