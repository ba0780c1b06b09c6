"""Training draft heads on the target's own states (``quickdraft train``).

``data``: teacher-forced passes of the target over texts, sharded and resumable; ``eagle3``: the
EAGLE-3 head's training-time test; ``medusa``: Medusa heads; ``loop``: what they share; ``cli``:
the commands. The heads themselves, and their files, are in models/eagle3.py and models/medusa.py;
the proposers that serve them in proposers/heads/eagle3.py and proposers/heads/medusa.py.
"""
