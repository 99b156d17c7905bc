"""The applications: the ``python -m gradsync`` commands and what only they need.

:mod:`.cli` dispatches to :mod:`.train`, :mod:`.bench`, :mod:`.sim` (the simulator),
:mod:`.report`, :mod:`.demo` and ``profile``; :mod:`.models` and :mod:`.data` are the model zoo
and data sets they train on; :mod:`.common` is the output they share (tables, JSON + PNG, the
median timer). Applications use the library's public names only, and each other's too
(``tests/test_architecture.py``).
"""
