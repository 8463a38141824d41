"""Glue for RL frameworks' own weight-sync seams, one module per framework.

Each module imports its framework when it is imported itself; nothing here is
imported eagerly (``p2pweights.integrations.verl`` needs verl installed).
"""
