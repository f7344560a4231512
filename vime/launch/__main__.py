import sys

from vime.launch.cli import main

sys.exit(main())
