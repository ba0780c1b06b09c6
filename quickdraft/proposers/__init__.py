"""Proposers, grouped by family: lookup/ (ngram, suffix: no model), draft/ (draft_model,
layer_skip: a model drafts), heads/ (eagle3, medusa: heads over the target's states), and none.py.
base.py holds the protocol, its no-op defaults and the registry; draft_sampling.py and
tree_drafts.py what the model-driven families share."""
