"""Worker-side examples for quota-proxy: a response classifier and Celery / Dramatiq jobs.

See ``examples/README.md``. Not part of the installed package.
"""
