import sys

from onegpu.cli import entry

sys.exit(entry())
