"""The settings tree: every default of chatloom once, and where values come from.

A leaf room: it imports nothing else of chatloom, so every other room (the engine too) may take its
defaults from here. tree.py holds the groups, root.py the root and its sources, loading.py the
order (defaults, TOML file, CHATLOOM_* environment, command-line flags) and the one-line errors.
"""
from chatloom.settings.loading import load_settings
from chatloom.settings.root import Settings, SettingsError, nest, validated
from chatloom.settings.tree import DEFAULT_MODEL, DEFAULT_SYSTEM_PROMPT

DEFAULTS = Settings.model_construct()  # the defaults alone, no environment: what lower layers default to


def environment_settings() -> Settings:
    """The defaults with the CHATLOOM_<GROUP>__<KEY> environment variables applied (no file, no flags)."""
    return load_settings()

__all__ = ["DEFAULTS", "DEFAULT_MODEL", "DEFAULT_SYSTEM_PROMPT", "Settings", "SettingsError", "environment_settings", "load_settings",
           "nest", "validated"]
