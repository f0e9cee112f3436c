"""The admission shell, synchronous and free of I/O: the controller that books charges and orders the
hold queue (``controller``), the lane watch that learns the idle figure and raises the margin
(``lane_watch``), and the clock both read (``clock``). May import ``core``, ``policy``, ``intake`` and
``signals``."""
