"""Answers for other engines' connectors, above the planner: what only a drop-in for one engine needs."""
