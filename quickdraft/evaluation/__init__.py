"""What the commands and the bench share to measure a run, below both of them: the prompt sets
(``datasets``), the statistics of a run (``stats``), measurements of a request, the machine and
its passes (``measure``), and report tables and figures (``report_format``).

Nothing here imports a command or the bench: ``measure`` times the passes of the models and
engine it is handed, importing nothing above the models and
sampling layers."""
