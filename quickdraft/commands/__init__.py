"""The ``quickdraft`` subcommands, one module each (cli.py loops over them); ``serve``, ``bench``
and ``train`` register from their packages (server/cli.py, bench/cli.py, train/cli.py). What
several commands share lives below them: arguments.py (the flags) and evaluation/ (prompt sets,
statistics, measurements, report tables)."""
