"""A small Django project the tests (and their relay and worker subprocesses) run."""
