import sys

from kda.verify.cli import main

sys.exit(main())
