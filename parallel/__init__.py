"""Layouts, process groups, CPU compatibility, resharding and checkpoint IO; knows bytes, not RL."""
