"""Build hooks for the xlakit package (metadata lives in pyproject.toml).

VERSIONS.toml is baked into the package as `xlakit/_pins.toml` on every build
(wheel, sdist, editable), so an installed xlakit knows the profile it was
built for without a checkout.
"""

import shutil
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
PINS_SOURCE = ROOT / "VERSIONS.toml"
PINS_BAKED = ROOT / "python" / "xlakit" / "_pins.toml"

if PINS_SOURCE.exists():  # absent only when building from an sdist, which carries the baked copy
    shutil.copyfile(PINS_SOURCE, PINS_BAKED)

setup(package_data={"xlakit": ["_pins.toml", "*.pyi", "data/*.toml"]})
