"""Management commands of taskonce's Django app."""
