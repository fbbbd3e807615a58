"""The user's application of the docs' examples (see ``tests/docs_apps``)."""
