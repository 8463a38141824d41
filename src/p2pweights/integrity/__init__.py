"""Checking that every byte an update wrote arrived: digests of what a sender staged,
compared with digests each engine rank takes of the same regions before
``end_weight_update`` (see docs/reliability.md, "Verified writes")."""
