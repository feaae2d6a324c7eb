"""Rewards: the reward functions and their registry, reward models, the proxy and the gold reward."""
