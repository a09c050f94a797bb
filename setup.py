"""Build hooks for the xlakit package (metadata lives in pyproject.toml)."""

from setuptools import setup

setup()
