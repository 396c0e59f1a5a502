"""The ``tracecmp`` command line."""
