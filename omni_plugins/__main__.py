import sys

from omni_plugins.cli import main

sys.exit(main())
