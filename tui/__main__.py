import sys

from workbench.tui.cli import main

sys.exit(main())
