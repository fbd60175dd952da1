"""Results: what is made of a finished run. `analysis` (the background analysis of the `--full` matrix, whose
files `matrix` writes and reads), `categories` (the paper's prediction categories), `report` (the Markdown
report, its inputs read back by `reading`), `leaderboard`, `figures` (all Pillow drawing and fonts), and
`publish` (what the commands write, composed here so that the evaluation never imports this package)."""
