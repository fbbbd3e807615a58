"""System checks (``manage.py check``) for taskonce's settings. Filled in below."""

from __future__ import annotations
