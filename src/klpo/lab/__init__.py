"""The estimator lab: exact and Monte Carlo statistics of every KL estimator, value and gradient.

Imports only the library (``klpo.kl`` and friends), never the trainer or the CLI.
"""
