import sys

from cupyflash.cli import main

sys.exit(main())
