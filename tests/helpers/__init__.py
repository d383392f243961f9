"""Helpers shared by several test modules (fixtures stay in ``tests/conftest.py``).

A test module imports what it shares from here or from conftest, never from another test
module. ``conftest.py`` registers this package for pytest's assertion rewriting, so a failed
``assert`` in a helper explains itself like one in a test.
"""
