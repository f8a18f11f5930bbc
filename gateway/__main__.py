import sys

from prismgate.cli import main

sys.exit(main())
