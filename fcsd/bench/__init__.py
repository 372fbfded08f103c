"""Measuring the expert-parallel runtime (paper Sec. 4, Appendix C-D; design §4), a tool beside the library:

- ``overlap.py``: ``fcsd bench overlap``, exposed communication per phase on GPUs and CPUs; ``timeline.py`` its timer;
- ``modelled_link.py``, ``modelled_run.py``, ``hidden_share.py``, ``picture.py``: the schedules run over a modelled
  link (``fcsd bench overlap --link``): hidden share, structural limit, schedule efficiency, the timeline picture.

The runtime (:mod:`fcsd.parallel`) never imports this package; a modelled link reaches it through
:data:`fcsd.parallel.collectives.LINK`."""
