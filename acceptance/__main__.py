import sys

from semif_serve.tools.cli import main

sys.exit(main())
