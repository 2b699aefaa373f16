"""Bringing files into the library: the walk, triage and one transaction per file (files), and the reader
processes, the encoding thread and the batch loop that feed it (pipeline).
"""
