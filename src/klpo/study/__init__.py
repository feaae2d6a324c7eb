"""Studies of KL choices on real training: grids of runs, their reports and the fits read from them."""
