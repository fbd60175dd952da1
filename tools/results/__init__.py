"""Results: the challenge analysis, prediction categories, the report, the leaderboard and their figures."""
