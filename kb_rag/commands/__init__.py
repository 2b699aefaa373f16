"""The commands: their handlers with their request fields (core), the watch and sync commands (sync), and the
command table with the host contract and ``Engine`` (table).
"""
