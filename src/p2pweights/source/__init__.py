"""Trainer tensors -> loader inputs: checking, grouping, and conversion into the engine's
checkpoint format (e.g. block fp8), before any replica loader runs."""
