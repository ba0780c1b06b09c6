"""Proposers that draft by looking text up, with no model: ``ngram`` (prompt lookup, ngram.py)
and ``suffix`` (suffix tries over the request and past outputs, suffix.py over suffix_tree.py).

Kept free of imports: the registry (proposers/base.py) imports only the module of the method asked for.
"""
