"""``python -m services.cli`` (in a checkout) runs the ``millwheel`` command."""

import sys

from . import main

sys.exit(main())
