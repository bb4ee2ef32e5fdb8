"""Hydra config tree (a package so Hydra finds it after a regular, non-editable install)."""
