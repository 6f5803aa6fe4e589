"""``python -m tandem.cli`` is the ``tandem`` command."""

import sys

from tandem.cli.main import main

sys.exit(main())
