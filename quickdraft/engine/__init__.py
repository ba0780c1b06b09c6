"""The engine: the scheduler (CPU bookkeeping), the runner (propose, one target pass, verify,
commit), the engine loop, the plan (``plan``: K per sequence, tree sizes, whether speculating pays
at this batch), the prefix cache and the CPU threads the passes run on."""

from quickdraft.engine.threads import fit_to_quota

fit_to_quota()  # a container's CPU limit, not the node's cores (engine/threads.py)
