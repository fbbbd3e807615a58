"""The models of bench/django_cost.py (an app of its own: the benchmark's database only)."""
