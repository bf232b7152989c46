"""Attention paths over a cache: exact (dense keys), the token-tile walk every xla path shares,
attention read from PQ codes (``pq_xla``) and from uniform int codes (``uniform_xla``), and the
one kernel-or-xla decision for PQ codes (``pq_dispatch``)."""
