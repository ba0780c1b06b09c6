"""Proposers that run a model to draft: a separate draft model (``draft_model``: model.py, read
through text when its tokenizer differs: text.py, retokenize.py; loaded by load.py, its head cut
to a frequent vocabulary by vocab.py) and the target itself with layers skipped (``layer_skip``).

Kept free of imports: the registry (proposers/base.py) imports only the module of the method asked for.
"""
