"""Bibliographies: references formatted in the citation styles researchers submit with (styles), from the CSL items
the cite command builds.
"""
