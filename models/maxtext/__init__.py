"""MaxText model families (maxtext 0.2.4), each built through MaxText's Linen and NNX paths.

Install with ``pip install -e '.[maxtext]'``; without it, the families stay registered and
every test on them skips with the reason (see :meth:`MaxTextFamily.unavailable`).
"""
