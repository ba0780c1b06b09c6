"""Triton's Python backend loads this file: quickdraft's model (quickdraft/deploy/triton.py).

The backend's stub starts its interpreter without reading $PYTHONPATH, so the paths it names (a
virtual environment's site-packages, a source checkout) are put first on sys.path here."""
import os
import sys

for _path in reversed([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from quickdraft.deploy.triton import TritonPythonModel  # noqa: E402,F401
