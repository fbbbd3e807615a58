"""``python -m taskonce.cli`` (and spark-submit's script: this file)."""

import sys

from taskonce.cli import main

sys.exit(main())
