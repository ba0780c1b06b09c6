"""Proposers that draft with a small head over the target's own hidden states: EAGLE-3
(eagle3.py) and Medusa (medusa.py), serving the head files models/eagle3.py and models/medusa.py
read; common.py holds what both share (finding the head, its GGUF-block weights, sampling rows).

Kept free of imports: the registry (proposers/base.py) imports only the module of the method asked for.
"""
