"""refit's tools: the ``refit`` command line (``cli``), ``demo``, ``verify``, ``soak``, fault injection
(``faults``), a local process launcher (``launch``) and the benchmark harness (``bench``).

They use the library; the library never imports them.
"""
