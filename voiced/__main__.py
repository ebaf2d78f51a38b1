import sys

from voiced.cli import main

sys.exit(main())
