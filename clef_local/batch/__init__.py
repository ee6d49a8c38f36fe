"""``clef-local batch``: decide over a whole file of requests, resumable, on this machine or a Ray cluster.

``job.py`` drives one job (the command line too), ``io.py`` reads and writes each file format, ``journal.py`` keeps
the committed chunks that make a job resumable and exact-once, ``work.py`` decides one chunk (the same code on this
machine and in a Ray replica), ``replicas.py`` sizes the replicas from a cluster's resources and ``ray_runner.py``
runs chunks as Ray Data over an actor pool. docs/batch.md is the user's guide.
"""
