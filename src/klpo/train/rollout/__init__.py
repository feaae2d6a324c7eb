"""Sampling completions: the samplers, the engines behind them, and the reference's own samples."""
