"""xlakit's own version (the Python package; the patch level lives in VERSIONS.toml)."""

__version__ = "0.1.0"
