"""The package's version (pyproject.toml's), in a module of its own that imports nothing, so that
the modules that record it (models/pass_cost.py's calibration cache) need not import the package root."""

__version__ = "0.1.0"
