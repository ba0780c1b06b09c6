"""Serving past one process: Ray Serve replicas (``ray_serve.py``, ``replica.py``), a Triton
Python-backend model (``triton.py``); the Kubernetes and Triton files live in ``deploy/`` at the
repository root. Nothing here distributes work by itself: Ray, Kubernetes and Triton do."""
