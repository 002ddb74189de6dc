import sys

from onegpu.cli import main

sys.exit(main())
