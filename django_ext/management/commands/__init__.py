"""``manage.py taskonce``."""
