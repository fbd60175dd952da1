"""Results: what is made of a finished run (analysis, categories, reports, leaderboard, figures), and `publish`,
what the commands write, so that the evaluation never imports this package."""
