import sys

from kda.bench.cli import main

sys.exit(main())
