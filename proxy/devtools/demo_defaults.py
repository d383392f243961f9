"""The demo's defaults, shared by its command line (demo_cli.py, kept light) and the demo itself."""

from typing import Final

DEFAULT_PLOT: Final = "quota-proxy-demo.png"
DEFAULT_DURATION: Final = 60.0
