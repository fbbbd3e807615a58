"""The ``taskonce demo`` command's demos: a real Celery or Dramatiq worker, duplicate deliveries
and a ledger whose balance holds. Not part of the library's API: nothing here is imported by
:mod:`taskonce`, :mod:`taskonce.celery_ext` or :mod:`taskonce.dramatiq_ext`.

- :mod:`taskonce.demo.celery_demo` and :mod:`taskonce.demo.celery_app`: the Celery demo and the
  app its worker runs;
- :mod:`taskonce.demo.dramatiq_demo` and :mod:`taskonce.demo.dramatiq_app`: the same for
  Dramatiq;
- :mod:`taskonce.demo.common`: what both share (event counting, progress bar, ledger, report).
"""
